"""What a pipeline's cut reads from a model, as one frozen record
(parallel/pipeline/stage_map.py, `StageMap`): read once per model, adopted
by another cut without a trace (placed again where its cut differs), and
what the planner's dry runs cache (cost/dry_run.py)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import tiny_config

from tpctl.parallel.layout import Layout
from tpctl.parallel.pipeline.stages import PipelineSpec


def _cut(spec: PipelineSpec, pp_rank: int = 0):
    from tpctl.parallel.mesh import build_mesh
    from tpctl.parallel.pipeline.schedule import Pipeline

    layout = Layout("none", pp=spec.stages)
    return Pipeline(build_mesh(layout, rank=layout.rank_of({"pp": pp_rank}), groups=False), spec)


def _model():
    from tpctl.models import build_model

    cfg = tiny_config(1, **{"model.n_layer": 6})
    return build_model(cfg.model, cfg.seed, lazy=True)


def test_a_cut_reads_a_frozen_record_once():
    from tpctl.parallel.pipeline.stage_map import StageMap

    pipe = _cut(PipelineSpec(2, "1f1b", 1, 2, seq_len=16))
    found = pipe.assign(_model())
    assert isinstance(found, StageMap) and pipe.assign(None) is found and pipe.stage_map is found
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.hidden = 1
    hash(found)  # names, numbers and ranges only: no tensor or module of the model
    assert found.model == "GPT" and found.stack_name == "blocks" and found.block_keys == tuple("012345")
    assert [b.where for b in found.beside if b.name in ("wte", "lm_head")] == ["before", "after"]
    assert len(found.block_weights) == 6 and found.weights == (found.block_weights, found.before, found.after)
    assert found.spec == PipelineSpec(2, "", 1, 0, seq_len=16) and pipe.blocks_of == list(found.blocks_of)
    assert [c.blocks for c in found.chunks(0)] == [tuple(found.blocks_of[0])] == [c.blocks for c in pipe.chunks]


def test_another_cut_adopts_the_record_as_if_it_had_read_the_model():
    """The same cut on another rank, another schedule, or another number of
    stages (placed again from the record's weights) hold what their own
    read gives them."""
    read = _cut(PipelineSpec(2, "1f1b", 1, 2, seq_len=16)).assign(_model())
    for spec, rank in ((PipelineSpec(2, "1f1b", 1, 2, seq_len=16), 1), (PipelineSpec(2, "gpipe", 1, 8, seq_len=16), 0),
                       (PipelineSpec(3, "interleaved", 2, 6, seq_len=16), 2)):
        adopted, own = _cut(spec, rank), _cut(spec, rank)
        adopted.adopt(read)
        assert adopted.stage_map == own.assign(_model()), spec
        assert adopted.chunks == own.chunks and adopted.first == own.first and adopted.last == own.last
        assert [adopted.holds(n) for n in ("wte", "lm_head", "blocks.0", "blocks.5")] == \
            [own.holds(n) for n in ("wte", "lm_head", "blocks.0", "blocks.5")]
    with pytest.raises(ValueError, match="seq_len=16 placed at seq_len=32"):
        _cut(PipelineSpec(2, "1f1b", 1, 2, seq_len=32)).adopt(read)


def test_a_record_placed_under_too_many_stages_is_refused_as_a_read_is():
    from tpctl.parallel.pipeline.cut import PipelineRefused

    read = _cut(PipelineSpec(2, "1f1b", 1, 2)).assign(_model())
    with pytest.raises(PipelineRefused, match="pp=8 makes 8 stages, more than the 6 blocks of GPT") as refused:
        _cut(PipelineSpec(8, "1f1b", 1, 8)).adopt(read)
    assert refused.value.key == "pp"


def test_the_planner_caches_the_record():
    """The dry runs' cache holds the StageMap a cut read, and a later cut
    of the model adopts it: the plans equal those made without a cache."""
    from tpctl.cost.planner import model_shape, plan_split
    from tpctl.parallel.pipeline.stage_map import StageMap

    cfg = tiny_config(1, **{"model.n_layer": 4})
    shape, cache = model_shape(cfg.model, cfg.seed), {}
    layouts = [Layout("none", pp=2), Layout("none", pp=2, dp=2), Layout("1d", 2, pp=2), Layout("none", pp=4)]
    t = cfg.train
    for layout in layouts:
        cached = plan_split(shape, layout, t.batch_size, t.seq_len, cache=cache)
        fresh = plan_split(shape, layout, t.batch_size, t.seq_len)
        assert (cached.memory_bytes, cached.flops, cached.comm) == (fresh.memory_bytes, fresh.flops, fresh.comm), layout
    records = {k: v for k, v in cache.items() if isinstance(k, tuple) and k[0] in ("cut", "read")}
    assert records and all(isinstance(v, StageMap) for v in records.values())
    assert {v.spec.stages for v in records.values()} == {2, 4}
