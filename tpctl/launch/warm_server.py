"""The fork server's first import (warm.PRELOAD).

- It dies with the launcher, even by SIGKILL, and its workers with it
  (each asks for SIGTERM when its parent, this server, dies:
  worker.die_with_parent). multiprocessing alone would keep the server
  alive while any worker lives, since every child holds its end of the
  pipe the server watches.
- A worker dies with it from its first instruction on (SIGKILL, asked for
  in the fork itself): one the launcher asked for just as it was
  interrupted, and so never learnt of, ends when the launch ends
  (warm.server kills the server), before it can say anything.
- It leads a session of its own, as each worker does when the launcher
  starts it as a command: Ctrl-C at the terminal reaches the launcher,
  which stops the workers once (a second SIGINT, from the terminal, would
  interrupt a worker's orderly exit).
- Ctrl-C while it imports torch ends it quietly, as it does a worker that
  starts (errors.quiet_interrupts); the launcher says it once. Once its
  imports are done the server ignores SIGINT itself (multiprocessing's
  forkserver) and the launcher stops the run.
"""

import os
import signal

from tpctl.errors import LAUNCHER_PID_ENV, die_with_parent, quiet_interrupts

quiet_interrupts()
try:
    os.setsid()
except OSError:  # already a session's leader: nothing to detach from
    pass
die_with_parent(signal.SIGKILL)
os.register_at_fork(after_in_child=lambda: die_with_parent(signal.SIGKILL))
if os.environ.get(LAUNCHER_PID_ENV) and os.getppid() != int(os.environ[LAUNCHER_PID_ENV]):
    os._exit(128 + signal.SIGTERM)  # the launcher died before the line above
