"""Every command README.md shows runs.

The README's code blocks (indented or fenced shell) are read line by line;
each line is a command, and every command is accounted for:

  * `make TARGET`: TARGET must be a target of the Makefile (not run: it
    installs and runs the whole suite); `make test` must be the README's
    test command (.ci/run and the docs rely on it).
  * `source .venv/bin/activate`: the venv `make install` creates.
  * `tpctl ...`: run through the venv's `tpctl`, as a user would; each code
    block's commands in order in a fresh directory of its own (a block may
    train, then resume, export or generate from what the command before
    wrote), two blocks at a time. Only what makes a run tiny is added
    (below); a command the README gives its own steps and run dir keeps
    them.
  * anything else fails: a README command no test runs.

What is added, per command:

  * `tpctl train`: `train.steps=2` unless it says `train.steps`,
    `train.progress=false`, and unless it says `hydra.run.dir=`, a run dir
    of the test with `checkpoint.at_end=false train.eval_every=0` (no later
    command can read that run's checkpoint); the run must write
    summary.json.
  * Commands that need a GPU (`device=cuda`) or other nodes
    (`launcher.nnodes>1` with a rendezvous host that is not here) are
    checked with tpctl's own dry run instead (`tpctl train --dry-run`:
    compose, validate every key, the layout against the model, write the
    run dir's config.yaml, say what would start, start nothing). A GPU
    command is validated with `device=cpu`: this machine need not have a
    GPU, let alone one per rank; the layout, the model and every other key
    are checked as written. A command that is already a dry run
    (`--dry-run launcher=slurm ...`) runs as written.
  * `tpctl bench`: `steps=1 rounds=1` unless given.
  * `tpctl generate`: `max_new_tokens=8` unless given.
  * `tpctl prepare-data SRC/`: a SRC folder that does not exist is made: a
    few .jsonl files of the standard library's sources (the user's corpus).

Each `tpctl` runs under the test's TPCTL_CACHE_DIR (conftest; cache
entries are written atomically, so two commands may build one at once) with
a timeout; whatever the test leaves running is killed (cli_support's
marker).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cli_support import REPO, Tpctl, new_marker

README = REPO / "README.md"
MAKEFILE = REPO / "Makefile"
# The commands of one block share a directory; each may take this long.
COMMAND_TIMEOUT_S = 300
# A training run the README shows must stay tiny (the README's commands
# cost about 140 CPU-seconds in all): at most this many steps when it says.
MAX_README_STEPS = 30


# ---- reading the README ------------------------------------------------------

def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(the heading above it, its lines) of every shell code block: fenced
    (``` with no language or a shell one) and indented (4 spaces, after a
    blank line, outside a fence)."""
    blocks: list[tuple[str, list[str]]] = []
    heading, fence, current, previous_blank = "top", None, None, True
    for line in text.splitlines():
        if fence is not None:
            if line.strip().startswith("```"):
                if fence in ("", "sh", "bash", "shell", "console"):
                    blocks.append((heading, current))
                fence, current = None, None
            else:
                current.append(line)
            continue
        if line.strip().startswith("```"):
            fence, current = line.strip()[3:].strip(), []
            continue
        indented = line.startswith("    ") and line.strip()
        if current is not None and not indented and line.strip():
            blocks.append((heading, current))
            current = None
        if indented and (current is not None or previous_blank):
            if current is None:
                current = []
            current.append(line[4:])
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        previous_blank = not line.strip()
    if current is not None:
        blocks.append((heading, current))
    return blocks


def commands_of(lines: list[str]) -> list[list[str]]:
    """Each command of a block as its words (shell comments dropped,
    backslash continuations joined)."""
    commands, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        if words:
            commands.append(words)
    return commands


def readme_blocks() -> list[tuple[str, list[list[str]]]]:
    return [(heading, commands_of(lines)) for heading, lines in code_blocks(README.read_text())]


def make_targets() -> set[str]:
    targets = set()
    for line in MAKEFILE.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", line)
        if m and not m.group(1).startswith("."):
            targets.add(m.group(1))
    return targets


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


BLOCKS = readme_blocks()
RUN_BLOCKS = [(heading, cmds) for heading, cmds in BLOCKS if any(c[0] == "tpctl" for c in cmds)]


# ---- what is checked without running anything ----------------------------------

def test_every_readme_command_is_one_this_test_runs_or_checks():
    assert BLOCKS, "no code blocks found in README.md"
    known = {"make", "source", "tpctl"}
    unknown = [" ".join(c) for _, cmds in BLOCKS for c in cmds if c[0] not in known]
    assert not unknown, f"README.md shows commands tests/test_readme.py neither runs nor checks: {unknown}"


def test_make_commands_are_makefile_targets():
    targets = make_targets()
    shown = [c for _, cmds in BLOCKS for c in cmds if c[0] == "make"]
    assert ["make", "test"] in shown, "`make test` must be the README's test command (.ci/run relies on it)"
    assert ["make", "demo"] in shown
    for command in shown:
        assert len(command) == 2 and command[1] in targets, f"{' '.join(command)}: not a Makefile target ({sorted(targets)})"


def test_source_commands_name_the_venv_make_creates():
    venv = re.search(r"^VENV\s*:=\s*(\S+)", MAKEFILE.read_text(), re.M).group(1)
    for command in (c for _, cmds in BLOCKS for c in cmds if c[0] == "source"):
        assert command == ["source", f"{venv}/bin/activate"], " ".join(command)


def test_the_readme_states_the_supported_versions():
    text = README.read_text()
    assert "torch 2.5" in text and "transformers>=5.23" in text


# ---- running the tpctl commands --------------------------------------------------

def _key(word: str) -> str:
    return word.lstrip("+~").split("=", 1)[0]


def _value(words: list[str], key: str) -> str | None:
    for word in words:
        if "=" in word and _key(word) == key:
            return word.split("=", 1)[1]
    return None


def _elsewhere(words: list[str]) -> bool:
    """A node of a job whose other nodes (and rendezvous host) are not here."""
    nnodes = _value(words, "launcher.nnodes")
    endpoint = _value(words, "launcher.rdzv_endpoint") or ""
    return nnodes not in (None, "1") and not endpoint.startswith(("127.", "localhost"))


def adapt(words: list[str], cwd: Path, n: int) -> tuple[list[str], Path | None]:
    """(the arguments of the tpctl command as run, the run dir that must hold
    summary.json afterwards, if it trains)."""
    sub, args = words[1], list(words[2:])
    if sub == "train":
        if any(a in ("--help", "--cfg", "--hydra-help", "--check") for a in args) or "--dry-run" in args:
            return [sub, *args], None  # (--check: validates and prints the memory table, starts nothing)
        if _value(args, "device") == "cuda" or _elsewhere(args):
            # Validation only (see the module docstring): a GPU command on the CPU.
            args = ["--dry-run", *("device=cpu" if _key(a) == "device" else a for a in args)]
            if _value(args, "hydra.run.dir") is None:
                args.append(f"hydra.run.dir={cwd / f'dry-{n}'}")
            return [sub, *args], None
        steps = _value(args, "train.steps")
        if steps is None:
            args.append("train.steps=2")
        else:
            assert int(steps) <= MAX_README_STEPS, f"keep README runs tiny: train.steps={steps}"
        if "-m" in args or "--multirun" in args:
            if _value(args, "hydra.sweep.dir") is None:
                args.append(f"hydra.sweep.dir={cwd / f'sweep-{n}'}")
            run_dir = None
        else:
            run_dir = _value(args, "hydra.run.dir")
            if run_dir is None:
                # A run dir no later command can name: nothing reads its
                # checkpoint or a validation loss.
                run_dir = str(cwd / f"run-{n}")
                args += [f"hydra.run.dir={run_dir}"] + [o for o in ("checkpoint.at_end=false", "train.eval_every=0")
                                                        if _value(args, _key(o)) is None]
            run_dir = cwd / run_dir
        args.append("train.progress=false")
        return [sub, *args], run_dir
    if sub == "bench":
        args += [f"{k}=1" for k in ("steps", "rounds") if _value(args, k) is None]
    if sub == "generate" and _value(args, "max_new_tokens") is None:
        args.append("max_new_tokens=8")
    if sub == "prepare-data":
        for source in (a for a in args if "=" not in a and a.endswith("/")):
            provide_corpus(cwd / source)
    return [sub, *args], None


def provide_corpus(folder: Path, files: int = 4, per_file: int = 25) -> None:
    """A user's corpus, if the folder is not there: .jsonl files of
    {"text": ...} lines, from the standard library's sources (enough
    documents that the validation split, a tenth of them by a hash of
    their text, is never empty)."""
    if folder.exists():
        return
    folder.mkdir(parents=True)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: files * per_file]
    for i in range(files):
        lines = [json.dumps({"text": p.read_text(errors="replace")}) for p in sources[i::files]]
        (folder / f"{i:02d}.jsonl").write_text("\n".join(lines) + "\n")


class ReadmeTpctl(Tpctl):
    """cli_support's runner, through the venv's `tpctl` script (the command
    the README tells a user to run), each a fresh process."""

    forked = False

    def command(self, args: list[str]) -> list[str]:
        script = Path(sys.executable).with_name("tpctl")
        return [str(script), *args] if script.exists() else super().command(args)


def run_block(runner: ReadmeTpctl, heading: str, commands: list[list[str]]) -> str | None:
    """The block's tpctl commands in order in `runner.cwd`; None, or what
    went wrong (the block stops there: later commands may read its files)."""
    for n, words in enumerate(commands):
        if words[0] != "tpctl":
            continue  # make and source lines: checked above
        args, run_dir = adapt(words, runner.cwd, n)
        shown = " ".join(words)
        try:
            result = runner.run(args, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"README ({heading}): `{shown}` ran past {COMMAND_TIMEOUT_S} s"
        where = f"README ({heading}): `{shown}` (run as `tpctl {' '.join(args)}`)"
        if result.returncode != 0:
            return (f"{where} exited {result.returncode}\n--- stdout\n{result.stdout[-2000:]}\n"
                    f"--- stderr\n{result.stderr[-2000:]}")
        if run_dir is not None and not (run_dir / "summary.json").exists():
            return f"{where}: no summary.json in {run_dir}"
        if "--dry-run" in args and "dry run" not in result.stdout:
            return f"{where}: no dry run said\n{result.stdout[-2000:]}"
        if args[0] == "export" and not (runner.cwd / args[-1]).exists():
            return f"{where} wrote nothing"
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_tpctl_command_of_the_readme_runs(tmp_path):
    """Each code block in a directory of its own, two blocks at a time: a
    tpctl command mostly keeps one core busy (its launcher, then its ranks
    taking turns), so on 2 cores two lanes roughly halve the wall time."""
    marker = new_marker()
    runners = []
    for i, (heading, _) in enumerate(RUN_BLOCKS):
        (tmp_path / f"{i}-{_slug(heading)}").mkdir()
        runners.append(ReadmeTpctl(cwd=tmp_path / f"{i}-{_slug(heading)}", marker=marker, extra_env={}))
    try:
        with ThreadPoolExecutor(max_workers=2) as lanes:
            failures = [f for f in lanes.map(run_block, runners, *zip(*RUN_BLOCKS)) if f]
    finally:
        runners[0].kill_leftovers()
    assert not failures, "\n\n".join(failures)
