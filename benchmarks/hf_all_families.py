"""Every model type transformers builds as a causal LM, through model=hf:
built from tpctl's size keys with random weights (width 32, 4 heads, 2
layers, vocabulary 256), exported with save_hf (the family's stored names),
and read back with model.pretrained: the logits against from_pretrained's.

    python benchmarks/hf_all_families.py              # all of them
    python benchmarks/hf_all_families.py qwen2 opt    # some

Families run 20 to a process with a 6 GB address-space limit (some
families' defaults are large; a family that kills its process, or runs out
of memory, is retried alone), and each prints one line: OK with the largest
logit difference, or FAIL with the stage and the first line of the error.

    python benchmarks/hf_all_families.py --train              # every family, trained
    python benchmarks/hf_all_families.py --train qwen2 opt    # some
    python benchmarks/hf_all_families.py --train --timeout=600 hy_v3   # a family's limit (default 120 s)

--train trains each family instead, at the same sizes (and, for a few
families, settings the size keys do not reach, each with its reason in
hf_zoo/family_keys.py and named in the family's row): 3 steps (batch 8,
sequence 8, lr 1e-2 without warm-up, AdamW eps 1e-5: tests/test_families.py's
recipe) in mode=none, 1d-2 and 2d-4, each run as a worker starts it (the
rewrite checked, then proven against the original before step 1), on the
gloo ranks of pools of 1, 2 and 4 ranks (tpctl/launch/pool.py). A process
trains 25 families in turn (its pools' start costs tens of seconds), 2 such
processes at a time; a family has 120 s (--timeout=S) for its three runs,
and one that ends its process, or runs out of memory building, is retried
alone. One line per family: `exact` (every step's loss and gradient norm
within 1e-4 relative of mode=none's, in both layouts; or, its first step
within 1e-5, no further off than 10x mode=none's own curve from weights one
fp32 round-off away: "amplified round-off"), `refused (<layout>:
<reason>)`, `wrong (<layout>: loss dev X, grad-norm dev Y)`, `crash
(<layout>: <error>)` (`timeout`: past the limit; `none: ...`: mode=none
itself failed), or `unbuilt` (it does not build from the size keys: outside
the counts); then a table (type, 1d-2, 2d-4, reason) and the counts.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import threading
import time

from hf_zoo.family_keys import SEQ, model_keys, note


# The survey's sizes, and the training pass's.
SIZES = {"vocab_size": 256, "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 64, "bias": None,
         "tie_embeddings": False}


def one(family: str) -> str:
    import torch
    import transformers
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from tpctl.config import typed_model
    from tpctl.models import build_model, logits_of
    from tpctl.models.hf import save_hf

    transformers.logging.set_verbosity_error()
    stage = "config"
    try:
        cfg = typed_model(OmegaConf.create({**SIZES, "arch": family}))
        stage = "build"
        model = build_model(cfg, seed=0).eval()
        stage = "save"
        directory = tempfile.mkdtemp(prefix=f"{family}-")
        save_hf(cfg, {name: p.detach() for name, p in model.named_parameters()}, directory)
        stage = "read"
        read = build_model(typed_model(OmegaConf.create({"arch": family, "pretrained": directory, "bias": None})),
                           seed=1).eval()
        ref = AutoModelForCausalLM.from_pretrained(directory).eval()
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            gap = (logits_of(read(ids)) - ref(ids, use_cache=False).logits).abs().max().item()
        return f"OK {family} {gap:.1e}"
    except Exception as e:  # a survey: every family gets its line
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return f"FAIL {family} at {stage}: {type(e).__name__}: {first}"


def run(families: list[str], timeout_s: float) -> dict[str, str]:
    """{family: its line}, from one process for all of `families`; those
    it did not reach (it died, or ran out of time) are left out."""
    lines: dict[str, str] = {}
    try:
        done = subprocess.run([sys.executable, __file__, "--in-process", *families], capture_output=True, text=True,
                              timeout=timeout_s)
        out = done.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    for line in out.splitlines():
        if line.startswith(("OK ", "FAIL ")):
            lines[line.split()[1]] = line
    return lines


# ---- the training pass (--train) ---------------------------------------------

LAYOUTS = ("1d-2", "2d-4")  # each against mode=none
STEPS, BATCH = 3, 8  # (the sequence length, SEQ, is family_keys': falcon_h1's chunk follows it)
TOLERANCE = 1e-4  # relative, every step's loss and gradient norm (tests/test_families.py)
FAMILY_S = 120  # all of a family's runs together
CHUNK = 25  # families a process trains in turn (its pools' start-up: 45 s on a loaded machine)
PROCESSES = 2  # at a time: a 2-core machine shared with others


def train_cfg(family: str, key: str):
    """The config of `family` (model=hf, the survey's sizes) trained a few
    steps in layout `key`: lr 1e-2 with no warm-up, so that a wrong gradient
    moves every later loss; AdamW's eps 1e-5, as in every exactness curve of
    the suite (with 1e-8 a gradient near zero steps by its round-off's sign)."""
    from omegaconf import OmegaConf

    from tpctl.config import default_config, typed_model
    from tpctl.parallel.layout import Layout

    cfg = Layout.parse(key).write_to(default_config())
    # (and a few families' own settings the size keys do not reach: hf_zoo/family_keys.py)
    cfg.model = typed_model(OmegaConf.create({**SIZES, "arch": family, "dropout": 0.0, **model_keys(family)}))
    for k, v in {"data.name": "text", "data.max_bytes": 200_000, "train.batch_size": BATCH, "train.seq_len": SEQ,
                 "train.steps": STEPS, "train.eval_every": 0, "train.log_every": 1, "train.progress": False,
                 "optim.lr": 1e-2, "optim.eps": 1e-5, "optim.warmup_steps": 0}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def curve(family: str, key: str, perturb: float = 0.0):
    """On every rank of a pool: [(loss, grad norm)] of every step of
    `family` in `key`, or ("refused", the reason), as a worker starts: the
    rewrite checked, then proven against the original before step 1.
    `perturb`: every initial weight multiplied by (1 + perturb * N(0, 1))
    first (fixed draws), the round-off's own effect on the curve."""
    import torch

    from tpctl.data.batches import TokenData
    from tpctl.data.corpora import prepare_data
    from tpctl.launch.pool import pooled_run
    from tpctl.parallel.verify.proof import RewriteRefused
    from tpctl.training.loop import Trainer

    cfg = train_cfg(family, key)
    try:
        run = pooled_run(cfg, lazy=False, verify=True, step=False)
    except (ValueError, RewriteRefused) as e:
        return ("refused", first_line(e))
    if perturb:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in run.model.parameters():
                p.mul_(1 + perturb * torch.randn(p.shape, generator=gen))
    records = Trainer(run, TokenData(run.cfg, prepare_data(run.cfg)), None).fit()
    return [(r["loss"], r["grad_norm"]) for r in records]


def first_line(e: BaseException | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def error_line(traceback_text: str) -> str:
    """The exception's own line of a rank's traceback (DistPool.run's
    RuntimeError holds it whole): its last line that is not indented."""
    lines = [line for line in traceback_text.strip().splitlines() if line and not line.startswith(" ")]
    return lines[-1][:300] if lines else traceback_text[:300]


def deviation(want, got) -> tuple[float, float]:
    """Largest relative difference of the losses and of the gradient norms
    (NaN: infinitely wrong)."""
    def rel(w: float, g: float) -> float:
        d = abs(g - w) / abs(w) if w else abs(g - w)
        return d if d == d else float("inf")

    return (max(rel(w[0], g[0]) for w, g in zip(want, got)), max(rel(w[1], g[1]) for w, g in zip(want, got)))


def ready() -> bool:
    return True


class Pools:
    """This process's pools of gloo ranks, one per world size (1 for
    mode=none, 2 and 4 for the split layouts), started together and again
    after a call that timed out or lost a rank (which closes its pool).
    A pool's start (importing torch in a process, forking its ranks, gloo's
    rendezvous: tens of seconds on a loaded machine) is waited for before a
    family's clock starts."""

    WORLDS = (1, 2, 4)
    START_S = 300

    def __init__(self):
        self.by_world: dict = {}

    def start(self) -> None:
        from tpctl.launch.pool import DistPool

        for world in self.WORLDS:
            pool = self.by_world.get(world)
            if pool is None or not pool.alive():
                if pool is not None:
                    pool.close()
                self.by_world[world] = DistPool(world, timeout_s=FAMILY_S)
        for pool in self.by_world.values():
            pool.run(ready, timeout_s=self.START_S)

    def run(self, key: str, family: str, timeout_s: float, perturb: float = 0.0):
        from tpctl.parallel.layout import Layout

        return self.by_world[Layout.parse(key).world].run(curve, family, key, perturb,
                                                          timeout_s=max(timeout_s, 1.0))[0]

    def close(self) -> None:
        while self.by_world:
            self.by_world.popitem()[1].close()


def judge(family: str, pools: Pools) -> dict:
    """{layout: its result} of one family: exact, refused: reason, wrong:
    deviations, crash: error; or {"build": error} when it does not build from
    the size keys (outside the count of families that train)."""
    from tpctl.models import build_model

    try:  # as the survey builds it, in this process: the pools' ranks never hold it
        build_model(train_cfg(family, "none").model, seed=0)
    except Exception as e:
        return {"build": f"{type(e).__name__}: {first_line(e)[:200]}"}
    deadline = time.monotonic() + FAMILY_S
    curves, results = {}, {}
    for key in ("none", *LAYOUTS):
        try:
            waited = time.monotonic()
            pools.start()  # (again after a timeout closed one: not on the family's clock)
            deadline += time.monotonic() - waited
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            curves[key] = pools.run(key, family, left)
        except TimeoutError:
            curves[key] = ("crash", f"timeout (past the family's {FAMILY_S:g} s)")
        except RuntimeError as e:
            curves[key] = ("crash", error_line(str(e)))
        if key == "none" and isinstance(curves[key], tuple):  # mode=none trains every model
            kind, detail = curves[key]
            return {k: f"crash: none: {'refused: ' if kind == 'refused' else ''}{detail}" for k in LAYOUTS}
    want, floor = curves["none"], None
    for key in LAYOUTS:
        got = curves[key]
        if isinstance(got, tuple):  # (crash or refused, why)
            results[key] = f"{got[0]}: {got[1]}"
        elif len(got) != len(want):
            results[key] = f"crash: {len(got)} steps recorded, mode=none {len(want)}"
        else:
            loss, norm = deviation(want, got)
            ok = loss <= TOLERANCE and norm <= TOLERANCE
            results[key] = "exact" if ok else f"wrong: loss dev {loss:.2e}, grad-norm dev {norm:.2e}"
            if not ok and max(deviation(want[:1], got[:1])) <= FIRST_STEP:
                if floor is None:  # once a family: mode=none from weights one round-off away
                    floor = _floor(family, want, pools, deadline)
                results[key] = _amplified(results[key], max(loss, norm), floor)
    return results


# A layout whose later steps deviate past TOLERANCE is still exact when its
# first step (the gradient of the same weights: what a rewrite could get
# wrong) agrees within FIRST_STEP and mode=none itself, started from weights
# perturbed by fp32's unit round-off, deviates as much (within FLOOR_RATIO):
# a curve that amplifies round-off (lr 1e-2 on tiny models with large
# family defaults), not a wrong gradient.
FIRST_STEP, ROUNDOFF, FLOOR_RATIO = 1e-5, 2.0 ** -24, 10.0
FLOOR_S = 60  # its one run of mode=none, past the family's time if need be


def _floor(family: str, want: list, pools: Pools, deadline: float):
    """The largest deviation of mode=none's curve when its initial weights
    move by one round-off, or the reason it could not be measured."""
    try:
        pools.start()  # (one a timeout closed)
        left = deadline - time.monotonic()
        moved = pools.run("none", family, max(left, FLOOR_S), ROUNDOFF)
        return max(deviation(want, moved))
    except (TimeoutError, RuntimeError) as e:
        return f"no floor ({type(e).__name__})"


def _amplified(result: str, dev: float, floor) -> str:
    if isinstance(floor, float) and dev <= FLOOR_RATIO * floor:
        return (f"exact: amplified round-off ({result[len('wrong: '):]}; step 1 within {FIRST_STEP:g}; "
                f"mode=none from weights {ROUNDOFF:.0e} away: {floor:.2e})")
    return f"{result} (mode=none from weights {ROUNDOFF:.0e} away: {floor if isinstance(floor, str) else f'{floor:.2e}'})"


def verdict(results: dict) -> str:
    """The family's line: exact in every layout, else the first layout's
    worst outcome (crash, wrong, refused), as `kind (layout: detail)`."""
    if "build" in results:
        return f"unbuilt (build: {results['build']})"
    for kind in ("crash", "wrong", "refused"):
        for key in LAYOUTS:
            if results[key].startswith(kind):
                return f"{kind} ({key}: {results[key][len(kind) + 2:]})"
    notes = [f"{key}: {results[key][len('exact: '):]}" for key in LAYOUTS if results[key].startswith("exact: ")]
    return f"exact ({'; '.join(notes)})" if notes else "exact"


def table_row(family: str, results: dict) -> str:
    """`| type | 1d-2 | 2d-4 | reason |`: each layout's outcome and its
    reason (a refusal's, an error's, a deviation), once if both layouts'
    are the same."""
    if "build" in results:
        return f"| `{family}` | – | – | does not build: {results['build']} |"
    kinds = [results[key].split(":")[0] for key in LAYOUTS]
    reasons = list(dict.fromkeys(results[key].split(": ", 1)[1] for key in LAYOUTS if results[key] != "exact"))
    # The first layout's reason; both where they differ (wrong in one, a timeout in the other).
    reason = reasons[0] if len(reasons) == 1 else "; ".join(f"{key}: {results[key].split(': ', 1)[1]}"
                                                           for key in LAYOUTS if results[key] != "exact")
    reason = "; ".join(r for r in (reason, note(family)) if r)  # what the family was given beyond the size keys
    return f"| `{family}` | {' | '.join(kinds)} | {reason.replace('|', '/')} |"


def train_in_process(families: list[str]) -> None:
    """Each family's results, one line each: `TRAIN <family> <json of judge>`."""
    import os
    import warnings

    import transformers

    import tpctl.models  # noqa: F401  (loaded before the pools start: their ranks fork with it)
    import tpctl.training.build  # noqa: F401
    import tpctl.training.loop  # noqa: F401

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    # This process's own data cache: the other process preparing the same
    # text at the same moment never meets it.
    os.environ["TPCTL_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo-cache-")
    pools = Pools()
    try:
        for family in families:
            print(f"TRAIN {family} {json.dumps(judge(family, pools))}", flush=True)
    finally:
        pools.close()


def kill_session(pid: int) -> None:
    """End a training process and every process it started (its pools)."""
    import os
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended just before
        pass


def train_batch(families: list[str], timeout_s: float, show) -> tuple[list[str], str]:
    """One process training `families` in turn, show(family, results) for
    each as it is reported; returns the families it did not reach (it died,
    or ran past `timeout_s`: its session is killed, pools and all) and its
    last line of error output."""
    with tempfile.TemporaryFile("w+") as err:
        cmd = [sys.executable, __file__, "--train-in-process", f"--timeout={FAMILY_S:g}", *families]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        timer = threading.Timer(timeout_s, kill_session, (proc.pid,))
        timer.start()
        left = list(families)
        for line in proc.stdout:
            if line.startswith("TRAIN "):
                _, family, results = line.split(" ", 2)
                show(family, json.loads(results))
                left.remove(family)
        proc.wait()
        timer.cancel()
        err.seek(0)
        errors = [line for line in err.read().splitlines() if line.strip()]
    return left, (errors[-1][:200] if errors else f"exit {proc.returncode}, no error output")


def train_all(families: list[str]) -> None:
    """Every family's verdict line as it comes, then the table and the
    counts. Chunks of families run in PROCESSES processes at a time; the
    first family a chunk's process did not reach is retried alone (a crash
    if that process dies too), the rest in a new process, and so is a family
    that ran out of memory building (as the survey does)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    start, verdicts, lock = time.perf_counter(), {}, threading.Lock()

    def show(family: str, results: dict) -> None:
        with lock:
            verdicts[family] = results
            print(f"[{len(verdicts)}/{len(families)} {time.perf_counter() - start:.0f}s] {family}: "
                  f"{verdict(results)}{f' ({note(family)})' if note(family) else ''}", flush=True)

    def chunk_then_alone(chunk: list[str]) -> None:
        short: list[str] = []  # out of the memory the chunk's earlier families left its process

        def show_or_defer(family: str, results: dict) -> None:
            if "allocate memory" in results.get("build", ""):
                short.append(family)
            else:
                show(family, results)

        while chunk:
            chunk, _ = train_batch(chunk, (FAMILY_S + 15) * len(chunk) + 90, show_or_defer)
            if chunk:  # the first one not reached ended its process: alone, then the others anew
                short.append(chunk.pop(0))
        for family in short:
            missed, why = train_batch([family], FAMILY_S + 90, show)
            if missed:
                died = f"crash: its process died or ran over {FAMILY_S + 90:g} s: {why}"
                show(family, {key: died for key in LAYOUTS})

    size = min(CHUNK, -(-len(families) // PROCESSES))  # a few families: still PROCESSES processes
    with ThreadPoolExecutor(PROCESSES) as ex:
        for f in as_completed([ex.submit(chunk_then_alone, families[i:i + size])
                               for i in range(0, len(families), size)]):
            f.result()
    print("\n| type | 1d-2 | 2d-4 | reason |\n|---|---|---|---|")
    for family in families:
        print(table_row(family, verdicts[family]))
    lines = [verdict(results) for results in verdicts.values()]
    counts = {k: sum(v.startswith(k) for v in lines) for k in ("exact", "refused", "wrong", "crash")}
    built = len(families) - sum(v.startswith("unbuilt") for v in lines)
    print(f"\n{built} of {len(families)} build: " + ", ".join(f"{n} {k}" for k, n in counts.items())
          + f" ({time.perf_counter() - start:.0f}s)")


def every_family() -> list[str]:
    from tpctl.models.hf import causal_lm_types

    return list(causal_lm_types())


def main(families: list[str]) -> None:
    global FAMILY_S
    for arg in [a for a in families if a.startswith("--timeout=")]:  # the training pass's, per family
        FAMILY_S = float(arg.split("=", 1)[1])
        families.remove(arg)
    if families and families[0] in ("--in-process", "--train-in-process"):
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a family whose defaults are huge fails alone
        if families[0] == "--train-in-process":
            return train_in_process(families[1:])
        for family in families[1:]:
            print(one(family), flush=True)
        return
    if families and families[0] == "--train":
        return train_all(families[1:] or every_family())
    families = families or every_family()
    start = time.perf_counter()
    # Chunks of families share one process (imports cost seconds); a
    # family that kills its process, or runs out of the memory the others
    # left it, is retried alone.
    lines: dict[str, str] = {}
    for i in range(0, len(families), 20):
        lines.update(run(families[i:i + 20], 120 * 20))
    for family in families:
        if family not in lines or any(m in lines[family] for m in ("can't allocate memory", "Cannot allocate memory")):
            lines.update(run([family], 300))
        print(lines.get(family, f"FAIL {family}: its process died (out of memory?) or ran over 300 s"), flush=True)
    ok = sum(line.startswith("OK") for line in lines.values())
    print(f"{ok} of {len(families)} read back to from_pretrained's logits ({time.perf_counter() - start:.0f}s)")


if __name__ == "__main__":
    main(sys.argv[1:])
