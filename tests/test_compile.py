"""train.compile: the compiled model trains to the losses of eager, in every
mode (collectives stay eager: a graph break at each), on one pool of 8 gloo
ranks; and the settings' checks (true refused without a compiler, auto falls
back to eager, bad values one line).

Most modes compile with the aot_eager backend (dynamo's capture, graph
breaks and AOT autograd, without inductor's C++ build: eight ranks building
C++ on a 2-core CI machine take minutes); inductor itself, the default,
compiles mode=none and 1d (marked slow: measured ~1-2 minutes on 2 cores).
"""

from __future__ import annotations

import os

import pytest

from cli_support import scaled
from tpctl.parallel.layout import Layout
from conftest import build_trainer, tiny_config

# Every mode once (1d with sequence parallelism, its harder case). Every rank
# traces and compiles: the modes that fit in 4 ranks run on 4, without the
# data-parallel replicas (their gradient all-reduce is outside the model).
# The collectives kept eager around the compiled graphs are the same
# wrappers in every mode (training/compile.py); 1d, 2d (whose SUMMA 2.5d
# runs too) and the data-parallel buckets stand for the rest (3d's
# all-gathers and reduce-scatters go through the same comm.py wrappers).
MESHES = {name: Layout.parse(name) for name in ("none-dp4", "1d-4-sp", "2d-4")}
STEPS = 3
# The fp32 band of the suite (test_mesh_and_training: modes against none):
# compiled kernels may fuse and reorder fp32 sums.
TOL = 1e-5


def _cfg(**overrides):
    # One block: the second would be the same graphs again (the time is
    # tracing and compiling them, not running them).
    return tiny_config(STEPS, **{"model.n_layer": 1, **overrides})


def _train(key: str, compile: str, backend: str = "aot_eager", **overrides) -> dict:
    import torch

    from tpctl.parallel import comm
    from tpctl.training.compile import BACKEND_ENV

    os.environ[BACKEND_ENV] = backend
    torch._dynamo.reset() if compile != "false" else None
    layout = MESHES.get(key, Layout())
    trainer = build_trainer(_cfg(**layout.to_dict(), **{"train.compile": compile}, **overrides), pooled=False)
    model = trainer.model
    comm.STATS.reset()
    losses = [r["loss"] for r in trainer.fit()]
    return {"losses": losses, "compiled": trainer.compiled, "comm_bytes": trainer.comm_train_bytes,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _close(compiled: list[dict], eager: list[dict]) -> None:
    for e, c in zip(eager, compiled):
        assert c["compiled"] and not e["compiled"]
        for a, b in zip(c["losses"], e["losses"]):
            assert abs(a - b) <= TOL * abs(b), (c["losses"], e["losses"])
        assert c["comm_bytes"] == e["comm_bytes"]  # every collective ran, and was counted, as in eager
        for name, p in c["params"].items():
            assert (p - e["params"][name]).abs().max() <= 1e-4, name


# Each rank traces and compiles its graphs: up to a minute per mode on 2 busy cores.
COMPILE_TIMEOUT_S = 900


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("key", list(MESHES))
def test_compiled_equals_eager(pool, key):
    _close(pool.run(_train, key, "true", timeout_s=COMPILE_TIMEOUT_S),
           pool.run(_train, key, "false", timeout_s=COMPILE_TIMEOUT_S))


@pytest.fixture(scope="module")
def pool1():
    from tpctl.launch.pool import DistPool

    # Inductor's pool of compile workers would outlive each call and make
    # closing the pool wait for it; one tiny graph needs no pool.
    saved = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    p = DistPool(1, timeout_s=scaled(600))
    if saved is None:
        os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS")
    else:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = saved
    yield p
    p.close()


@pytest.mark.slow  # inductor builds C++ with the machine's gcc
@pytest.mark.timeout(600)
def test_inductor_equals_eager(pool1):
    """The default backend, end to end on CPU: mode=none on one rank."""
    _close(pool1.run(_train, "none-1", "true", backend="inductor"), pool1.run(_train, "none-1", "false"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["none", "1d-1"])
def test_no_graph_break_and_no_recompile_in_none_and_1d_size_1(monkeypatch, name):
    """Counted by dynamo over 2 steps (the step index changes; tracing only,
    backend eager): one graph, no break. With model.dropout > 0 this fails
    (tpctl's dropout generators: zlib.crc32 and a Generator argument)."""
    import torch
    from torch._dynamo.utils import counters

    from conftest import build
    from tpctl.training.compile import BACKEND_ENV, compile_model

    monkeypatch.setenv(BACKEND_ENV, "eager")
    layout = Layout.parse(name)
    run = build(layout.write_to(_cfg()), layout, pooled=False, groups=False)
    torch._dynamo.reset()
    counters.clear()
    assert compile_model(run.model, "true", "cpu", say=print)
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    for step in range(2):
        run.step([(ids[:, :-1], ids[:, 1:])], step)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_the_compile_log_is_kept_in_a_file(monkeypatch, tmp_path):
    """keep_log (each rank's <run dir>/logs/compile_rank<r>.log): a graph
    break is written there with its reason."""
    import torch
    import torch._logging

    from tpctl.training.compile import keep_log

    monkeypatch.setenv("TORCH_LOGS_OUT", "")
    path = tmp_path / "logs" / "compile_rank0.log"
    try:
        keep_log(path)
        torch._dynamo.reset()

        def broken(x):
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2

        torch.compile(broken, backend="eager")(torch.ones(2))
    finally:
        monkeypatch.delenv("TORCH_LOGS_OUT")
        torch._logging.set_logs()
        torch._dynamo.reset()
    text = path.read_text()
    assert "Graph break" in text or "graph break" in text, text[:2000]
