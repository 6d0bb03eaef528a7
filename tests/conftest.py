"""Scaffolding shared by the test modules: the table of layouts the pools
run, the pools themselves (one per world size, spawned once per session:
spawning processes and importing torch costs seconds per rank), the tiny config and
the one way a test assembles a run (`build`, `trainer`: the worker's)."""

from __future__ import annotations

import pytest

from cli_support import scaled, slowness
from tpctl.launch.pool import DistPool
from tpctl.parallel.layout import Layout

WORLD = 8
# Every layout the pools run, by name (Layout.parse): those of 4 ranks on
# the 4-rank pool, the 8-rank ones (2.5d and 3d, and dp composed with 2d)
# on the 8-rank pool (Pools).
LAYOUTS = {name: Layout.parse(name) for name in
           ("none-dp4", "1d-2-dp2", "1d-4", "1d-2-sp-dp2", "1d-4-sp", "2d-4",
            "none-dp8", "1d-2-dp4", "1d-4-dp2", "1d-2-sp-dp4", "1d-4-sp-dp2", "2d-4-dp2", "2.5d-8-d2", "3d-8")}


def layouts(*names: str) -> dict[str, Layout]:
    """The layouts `names` of LAYOUTS, in that order."""
    return {name: LAYOUTS[name] for name in names}


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path_factory, monkeypatch):
    """Every test its own data cache (tpctl honours TPCTL_CACHE_DIR; the
    subprocesses and workers a test starts inherit it): never the user's
    ~/.cache/tpctl, which a test running beside it (pytest -n) may be
    building at that moment."""
    path = tmp_path_factory.mktemp("tpctl-cache")
    monkeypatch.setenv("TPCTL_CACHE_DIR", str(path))
    return path


def tiny_config(steps: int, **overrides):
    """The default config on a tiny GPT and the built-in text, for a few
    training steps on the pool; `overrides` are dotted keys (top-level ones
    such as mode= can be passed as keywords).

    AdamW's eps is 1e-5, as in every exactness curve of the suite (the rule
    in docs/DESIGN.md, "Exactness on any CPU"; tests/test_exactness_rule.py):
    with 1e-8 a gradient element near zero takes a full lr step from the
    sign of its round-off, which differs between CPUs."""
    from omegaconf import OmegaConf

    from tpctl.config import default_config

    cfg = default_config()
    base = {"model.n_embd": 16, "model.n_head": 4, "model.block_size": 16, "model.vocab_size": 256,
            "data.name": "text", "data.max_bytes": 200_000,
            "train.batch_size": 8, "train.seq_len": 16, "train.eval_every": 0, "train.log_every": 1,
            "train.progress": False, "optim.lr": 1e-2, "optim.eps": 1e-5, "optim.warmup_steps": 2, "train.steps": steps}
    base.update(overrides)
    for key, value in base.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def build(cfg, layout=None, *, pooled: bool = True, bucket_bytes: int | None = None, **options):
    """`cfg`'s run on this rank (a training.build.Run), assembled as the
    worker assembles it (build_run): on a pool rank's reused process groups
    (pooled: launch.pool.pooled_run), else on groups of its own (or none:
    groups=False). `layout`: default the config's; `options` are
    build_run's (lazy, verify, step, groups, device)."""
    if pooled:
        from tpctl.launch.pool import pooled_run

        return pooled_run(cfg, layout, bucket_bytes, **options)
    from tpctl.training.build import build_run

    return build_run(cfg, layout=layout, **options)


def build_trainer(cfg, layout=None, *, run_dir=None, scan_ids: bool = True, **build_options):
    """The Trainer of `cfg`'s run (`build`; its options) on its data."""
    return trainer_of(build(cfg, layout, **build_options), run_dir, scan_ids)


def trainer_of(run, run_dir=None, scan_ids: bool = True):
    """The Trainer of a built run on its config's data (with step=False, the
    Trainer makes the step); `run_dir`: where it writes checkpoints and
    metrics (None: nowhere)."""
    from pathlib import Path

    from tpctl.data.batches import TokenData
    from tpctl.data.corpora import prepare_data
    from tpctl.training.loop import Trainer

    return Trainer(run, TokenData(run.cfg, prepare_data(run.cfg, scan_ids=scan_ids)), Path(run_dir) if run_dir else None)


class Pools:
    """The session's pools of gloo ranks, one per world size, each started
    on first use: spawning ranks and importing torch, transformers and the
    test modules costs about 1 s per rank on 2 cores, once instead of once
    per module. A call runs on the pool whose world is its layout's
    (`_world_of`; `ranks=` says it for a call without one): on 2 cores a collective costs per message about
    four times as much CPU over 8 processes as over 4, so a layout that
    needs only 4 ranks runs on 4. A call that timed out or lost a rank
    closes its pool; the next call starts a new one."""

    def __init__(self):
        self._by_world: dict[int, DistPool] = {}

    def of(self, world: int) -> DistPool:
        pool = self._by_world.get(world)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close()
            pool = self._by_world[world] = DistPool(world, timeout_s=scaled(POOL_TIMEOUT_S))
        return pool

    def run(self, fn, *args, ranks: int | None = None, timeout_s: float = None, **kwargs):
        """fn(*args, **kwargs) on every rank of the pool of `ranks` (default:
        the layout's world); the results by rank (DistPool.run). `timeout_s`:
        the call's seconds on an idle machine (default POOL_TIMEOUT_S), scaled."""
        return self.of(ranks or _world_of(args)).run(fn, *args, timeout_s=scaled(timeout_s or POOL_TIMEOUT_S), **kwargs)

    def release_groups(self) -> None:
        for pool in self._by_world.values():
            if pool.alive():
                pool.release_groups()

    def close(self) -> None:
        while self._by_world:
            self._by_world.popitem()[1].close()


def _world_of(args) -> int:
    """The world of a pool call: its first layout's (a Layout, or a name of
    LAYOUTS), else WORLD."""
    for arg in args:
        if isinstance(arg, Layout):
            return arg.world
        if isinstance(arg, str) and arg in LAYOUTS:
            return LAYOUTS[arg].world
    return WORLD


POOL_TIMEOUT_S = 180  # a pool call's, and its process group's, on an idle machine (scaled)
_pools = Pools()


@pytest.fixture(scope="module")
def pool():
    """The session's pools (Pools): one per world size, shared by every
    module; each module's process groups are released after it."""
    yield _pools
    _pools.release_groups()


def pytest_sessionfinish(session, exitstatus):
    _pools.close()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's timeout (its timeout mark, else the ini's `timeout`) is
    stretched by the slowness measured as it starts (cli_support.scaled: at
    most 10 minutes unless written longer), before pytest-timeout reads it."""
    mark = item.get_closest_marker("timeout")
    written = (mark.args[0] if mark and mark.args else mark.kwargs.get("timeout") if mark else None)
    if written is None and not mark:
        written = item.config._env_timeout if hasattr(item.config, "_env_timeout") else None
    if written:
        kwargs = dict(mark.kwargs) if mark else {}
        kwargs.pop("timeout", None)
        item.add_marker(pytest.mark.timeout(scaled(float(written)), *(mark.args[1:] if mark else ()), **kwargs),
                        append=False)
    yield


def pytest_report_header(config):
    return f"tpctl: timeouts stretched by the measured slowness, now {slowness():.1f} (tests/cli_support.py: scaled)"


def pytest_collection_modifyitems(config, items):
    """The modules with the most slow tests first, and in each module its
    slow tests first: under `pytest -n 2` the long end-to-end runs then
    share the machine with each other early on, and the suite does not end
    with one worker on a long run while the other sits idle. (Every test is
    independent of the order; the suite passes in any.)"""
    from collections import Counter

    slow = Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    first_seen = {name: i for i, name in enumerate(dict.fromkeys(item.module.__name__ for item in items))}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-slow[item.module.__name__], first_seen[item.module.__name__],
                                 item.get_closest_marker("slow") is None, position[id(item)]))


def worst_grad_error(model, ref) -> float:
    """The largest relative error (norm of the difference over the norm) of
    a rank's gradients against the whole reference's, each sliced to the
    rank's shard (its ShardSpec; whole where it has none)."""
    ref_grads = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        spec = getattr(p, "tpctl_spec", None)
        want = ref_grads[name].grad
        want = spec.slice(want) if spec is not None else want
        worst = max(worst, ((p.grad - want).norm() / want.norm().clamp_min(1e-30)).item())
    return worst


@pytest.fixture(scope="module")
def none_curves(pool) -> dict:
    """A test module's mode=none curves by family, each made once by the
    first test that needs it (test_families_anymodel.trains_like_mode_none)."""
    return {}
