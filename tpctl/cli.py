"""The `tpctl` command line: the usage and the dispatch, nothing else.
Each command is a module in tpctl/commands/ with `main(args) -> int`;
`tpctl train` is tpctl/commands/train.py.

Exit status, for every command: 0 done, 1 training failed, 2 bad config or
usage (one line, `tpctl: error: <message>`, before anything starts), 130
interrupted (Ctrl-C). See docs/DESIGN.md, section 3.
"""

from __future__ import annotations

import importlib
import sys

from tpctl.errors import EXIT_OK, EXIT_USAGE, fail, import_torch, interrupted_status


USAGE = """\
usage: tpctl <command> [arguments]

commands:
  train    train a model with tensor parallelism; arguments are Hydra overrides:
             tpctl train mode=2d size=4 model=gpt-tiny train.steps=100
             tpctl train -m mode=1d size=2,4        (one run per value)
             tpctl train --cfg job                  (print the config, run nothing)
             tpctl train --help                     (groups, options and flags)
             tpctl train --dry-run launcher=slurm launcher.nnodes=2 ...  (print the submission)
  inspect  what the rewrite does to a model in a mode (roles, layers, shard shapes), no training:
             tpctl inspect model=hf model.arch=llama mode=3d size=8
  export   write a checkpoint's full weights (safetensors; a from_pretrained directory for model=hf):
             tpctl export outputs/.../checkpoints/step_200 model.safetensors
  prepare-data SRC... out=DIR tokenizer=DIR|bytes [workers=N ...]
           tokenise .txt/.jsonl(.gz)/.parquet/datasets corpora into token shards (then data.path=DIR):
             tpctl prepare-data corpus/ out=data/corpus tokenizer=bytes
  recipes  list the named experiments in recipes/ (tpctl train recipe=NAME [overrides])
  check-recipes [--fast] [NAME...]
           run recipes and check their loss bands and equalities (--fast: CI's short form)
  plan     per-rank memory, FLOPs, bytes/calls per collective and predicted step time of every split:
             tpctl plan model=gpt-small world=64 hardware=h100 [--json]
  bench    run modes side by side on one model and world (with PyTorch's own TP as a baseline):
             tpctl bench model=gpt-tiny size=4 modes=[1d,dtensor,2d]
  generate text from a checkpoint (any layout) or a save_pretrained directory, in any mode, streamed:
             tpctl generate outputs/.../checkpoints/step_200 prompt="def " temperature=0 mode=2d size=4
  report   PNG plots (loss, tokens/s, comm bytes/step) of run dirs:
             tpctl report outputs/2026-01-01/12-00-00 ... [--out DIR]

exit status: 0 trained, 1 training failed, 2 bad config or usage, 130 interrupted
"""

# Every command: name -> its module in tpctl/commands, with `main(args) -> int`.
COMMANDS = {
    "train": "tpctl.commands.train",
    "inspect": "tpctl.commands.inspect_model",
    "export": "tpctl.commands.export",
    "prepare-data": "tpctl.commands.prepare_data",
    "recipes": "tpctl.commands.recipes",
    "check-recipes": "tpctl.commands.check_recipes",
    "plan": "tpctl.commands.plan",
    "bench": "tpctl.commands.bench",
    "report": "tpctl.commands.report",
    "generate": "tpctl.commands.generate",
}

# Commands that never import torch (prepare-data forks its workers from a
# light process); the others import it first, safely (errors.import_torch).
WITHOUT_TORCH = ("prepare-data", "recipes", "report")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(USAGE, file=sys.stderr, end="")
        sys.exit(EXIT_USAGE)
    command, rest = args[0], args[1:]
    if command in ("-h", "--help", "help"):
        print(USAGE, end="")
        sys.exit(EXIT_OK)
    if command in COMMANDS:
        try:
            if command not in WITHOUT_TORCH:
                import_torch()
            sys.exit(importlib.import_module(COMMANDS[command]).main(rest))
        except KeyboardInterrupt as e:
            # Ctrl-C (or a command's SIGTERM, errors.Interrupted) where the
            # command does not say it itself: while torch is imported, the
            # config composed, the model built. One line, no traceback.
            import signal

            # A second SIGINT while leaving (a terminal's Ctrl-C reaches the
            # whole process group) must not end the process by the signal.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            name, status = interrupted_status(e)
            print(f"tpctl: {command} interrupted by {name}", file=sys.stderr)
            sys.exit(status)
    sys.exit(fail(f"unknown command {command!r}; expected one of: {', '.join(COMMANDS)} (see tpctl --help)"))


if __name__ == "__main__":
    main()
