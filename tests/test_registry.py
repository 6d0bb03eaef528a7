"""Adding a tensor-parallel mode is one class and one registration line.

`RowSplit`, below, is a whole mode written here, outside the package: a
grid of `size` ranks that splits the batch rows and keeps every weight
whole (data parallelism expressed as a mode, the simplest mode there is).
It declares its grid and geometry and where a Linear's weight and bias
live (its Linears are the default conversion's), registers itself with one
line, and from then on `Layout`, the mesh, the planner's layouts and the
trainer know it by name, and it trains equal to mode=none: in this
process, and through `tpctl train` from a module of its own named by
`mode_module`."""

from __future__ import annotations

import contextlib
import inspect
import json

import pytest
import torch.nn.functional as F
from cli_support import tpctl  # noqa: F401  (fixture)
from conftest import build_trainer, tiny_config

from tpctl.parallel.dropout import ParallelDropout
from tpctl.parallel.geometry import Geometry
from tpctl.parallel.layout import Layout
from tpctl.parallel.registry import register, unregister
from tpctl.parallel.tensor.mode import ParallelMode


class RowSplit(ParallelMode):
    """Rank p of the grid reads row block p of its replica's micro-batch and
    holds every parameter whole; the copies' gradients are partial sums
    over their rows, summed over the grid (their ShardSpec says so)."""

    name = "rows"
    axes = ("p",)

    @classmethod
    def geometry(cls, size: int, depth: int = 1) -> Geometry:
        return Geometry(cls.name, size, 1, 1, batch_split=size, hidden_split=1, head_split=1, vocab_multiple=1)

    def read_block(self):
        return self.mesh.tp_rank, self.mesh.tp_size

    def weight_spec(self, weight, role, layout=None, n=None):
        return self.split_spec(weight, replicas="tp")

    output_spec = weight_spec

    def linear_fn(self, role):
        return F.linear

    def _whole(self, module, ctx):
        # Through ctx.shard, as the Linears' weights are: the embedding tied to the LM head stays tied.
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, ctx.shard(param, self.split_spec(param, replicas="tp")))
        return module

    convert_embedding = convert_pos_embedding = convert_norm = convert_head_norm = _whole

    def convert_dropout(self, module, ctx):
        return ParallelDropout(module.p, self.mesh.rng_local)  # every rank holds other rows

    convert_attn_dropout = convert_dropout


@contextlib.contextmanager
def registered():
    """RowSplit registered while the block runs (in this process): other
    tests see only the package's modes."""
    register(RowSplit)  # the one line
    try:
        yield
    finally:
        unregister(RowSplit.name)


def _curve(layout: Layout) -> list[tuple[float, float]]:
    from tpctl.config import check_layout

    with registered():
        cfg = layout.write_to(tiny_config(6, **{"model.dropout": 0.0}))
        check_layout(cfg, layout)
        return [(r["loss"], r["grad_norm"]) for r in build_trainer(cfg, layout).fit()]


@registered()
def test_a_mode_registered_outside_the_package_is_a_layout():
    from tpctl.errors import ConfigError
    from tpctl.parallel.layout import layouts_of

    assert Layout.parse("rows-4-dp2").geo.batch_split == 4
    assert "rows-8" in {layout.name for layout in layouts_of(8)}
    with pytest.raises(ConfigError, match="mode='nope'.*rows"):
        Layout("nope", 2).validate()


def test_a_mode_registered_here_trains_like_mode_none(pool):
    want = pool.run(_curve, Layout.parse("none-dp8"))[0]
    got = pool.run(_curve, Layout.parse("rows-4-dp2"))[0]
    assert want[-1][0] < want[0][0], "the reference did not learn"
    for (loss, norm), (want_loss, want_norm) in zip(got, want):
        assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5)


def write_mode_module(folder) -> str:
    """A module of its own under `folder` that defines RowSplit and
    registers it (a mode outside tpctl, as a user writes one); its name."""
    header = ("import torch.nn.functional as F\n\n"
              "from tpctl.parallel.tensor.mode import ParallelMode\n"
              "from tpctl.parallel.geometry import Geometry\n"
              "from tpctl.parallel.dropout import ParallelDropout\n"
              "from tpctl.parallel.registry import register\n\n\n")
    (folder / "my_rows_mode.py").write_text(header + "@register\n" + inspect.getsource(RowSplit))
    return "my_rows_mode"


TRAIN = ["model=gpt-tiny", "model.dropout=0.0", "data=synthetic", "data.synthetic_tokens=20000", "train.batch_size=8",
         "train.seq_len=16", "train.steps=4", "train.log_every=1", "train.eval_every=0", "train.progress=false",
         "checkpoint.every=0", "checkpoint.at_end=false", "optim.lr=0.01", "optim.eps=1e-5", "optim.warmup_steps=0", "seed=0"]


@pytest.mark.timeout(400)
def test_a_mode_in_a_module_of_its_own_trains_through_the_cli_like_mode_none(tpctl, tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    tpctl.extra_env["PYTHONPATH"] = str(plugins)  # the launcher adds the repository before it
    module = write_mode_module(plugins)
    curves = {}
    for name, layout in (("none", ["mode=none", "dp=2"]), ("rows", ["mode=rows", "size=2", f"mode_module={module}"])):
        result = tpctl.run(["train", *TRAIN, *layout, f"hydra.run.dir={tpctl.cwd / name}"], timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in (tpctl.cwd / name / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    # (Random tokens: the loss stays near ln 256; the gradient norms show the weights moving.)
    assert len(curves["rows"]) == len(curves["none"]) == 4 and len({norm for _, norm in curves["none"]}) == 4
    for (loss, norm), (want_loss, want_norm) in zip(curves["rows"], curves["none"]):
        assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5)
    assert tpctl.leftover_pids() == []


@pytest.mark.timeout(60)
def test_a_mode_module_that_does_not_import_is_refused_in_one_line(tpctl):
    tpctl.extra_env["TPCTL_WORKER_MODULE"] = "tests.fake_worker"
    result = tpctl.run(["train", "mode=rows", "mode_module=no_such_mode_module", f"hydra.run.dir={tpctl.cwd / 'run'}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "tpctl: error: invalid config: mode_module='no_such_mode_module': expected an importable module that registers "
        "a mode (on PYTHONPATH): ModuleNotFoundError: No module named 'no_such_mode_module'"]
    assert not (tpctl.cwd / "run").exists()


@registered()
def test_bench_takes_its_mode_names_from_the_registry():
    from tpctl.config import compose_jobs
    from tpctl.cost.measure import check, layout_of, mode_names
    from tpctl.errors import ConfigError
    from tpctl.parallel.registry import mode_classes

    names = mode_names()
    assert {cls.name for cls in mode_classes()} | {"plain", "dtensor"} <= set(names) and "rows" in names
    assert [f"{cls.name}-sp" for cls in mode_classes() if cls.sequence_parallel] == [n for n in names if n.endswith("-sp")]
    cfg = compose_jobs(["model=gpt-tiny"])[0]
    check(cfg, ["none", "rows"], 2, None)
    assert layout_of("rows", 4, None) == Layout("rows", 4)
    with pytest.raises(ConfigError) as refused:
        check(cfg, ["4d"], 2, None)
    assert str(refused.value) == (f"invalid config: modes='4d': expected a list of {', '.join(names)}, "
                                  f"or layout names such as {Layout(dp=2, zero=1).name}")
