"""Errors with a contract: a bad config exits 2 with one line naming the key,
the value and what would be valid (see docs/DESIGN.md, section 3)."""

from __future__ import annotations

# The exit status of a command stopped by Ctrl-C (128 + SIGINT), and of each
# rank it stopped.
EXIT_INTERRUPTED = 130
# The launcher's pid, exported to its workers: a worker whose parent is
# another process (the launcher died before the worker could ask to die
# with it) does not start (launch/worker.py, `die_with_parent`).
LAUNCHER_PID_ENV = "TPCTL_LAUNCHER_PID"


class ConfigError(ValueError):
    """An invalid configuration value, found before any worker starts."""

    def __init__(self, key: str, value: object, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"invalid config: {self.key}={self.value!r}: {self.valid}"
