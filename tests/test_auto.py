"""layout=auto (tpctl/cost/auto.py): the search, its refusals and the
command lines, in process on a tiny GPT (no ranks started; the run of the
pick equal to mode=none is in test_e2e.py)."""

from __future__ import annotations

import pytest

from cli_support import tpctl  # noqa: F401  (fixture)

TINY = ["model=gpt-tiny", "model.n_layer=4", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "train.batch_size=8",
        "train.seq_len=16"]


@pytest.fixture(scope="module")
def tiny_cfg():
    from tpctl.config import compose_jobs

    return compose_jobs(TINY)[0]


def test_search_ranks_every_axis_and_predicts_peaks(tiny_cfg):
    """World 4: every axis appears among the choices, the ranking is by
    predicted step, and checkpointing lowers the predicted activations."""
    from tpctl.cost.auto import search
    from tpctl.cost.hardware import load_hardware

    found = search(tiny_cfg, 4, load_hardware("cpu"))
    names = [c.choice.name for c in found.ranked]
    assert len(names) == len(set(names)) > 50
    for part in ("1d-", "2d-4", "-pp2", "-dp", "-z3", "-sp", "gpipe", "1f1b", "interleaved", "accum=", "ckpt"):
        assert any(part in n for n in names), part
    times = [c.step_time_s for c in found.ranked]
    assert times == sorted(times)
    by_name = {c.choice.name: c for c in found.ranked}
    plain, ckpt = by_name["1d-2-dp2"], by_name["1d-2-dp2 ckpt"]
    assert ckpt.parts["activations"] < plain.parts["activations"] and ckpt.step_time_s > plain.step_time_s
    assert by_name["none-dp4-z3"].parts["optimizer"] < by_name["none-dp4"].parts["optimizer"]
    assert all(c.peak_bytes == sum(c.parts.values()) for c in found.ranked)
    assert found.splits == len(found.ranked) // 2  # with and without checkpointing: one split costed


def test_search_with_reused_dry_runs_equals_fresh_ones():
    """The search's shortcuts (one trace for every pipeline cut, rewrites
    of a copied model trimmed to the stage, a split's parameter counts kept
    across schedules and micro-batches) leave every choice's numbers, and so
    the ranking and the top five, as dry-running each split afresh gives
    them: a grouped-query Llama (Hugging Face code, tied embedding) at world 4."""
    from tpctl.config import compose_jobs
    from tpctl.cost.auto import search
    from tpctl.cost.hardware import load_hardware

    cfg = compose_jobs(["model=hf", "model.arch=llama", "model.n_layer=4", "model.n_embd=32", "model.n_head=4",
                        "model.n_kv_head=2", "model.intermediate_size=64", "train.batch_size=4", "train.seq_len=8"])[0]
    hw = load_hardware("cpu")
    fast, fresh = search(cfg, 4, hw), search(cfg, 4, hw, reuse=False)

    def numbers(found):
        return ([(c.to_json(), c.step_time_s, c.plan.to_json(), [s.to_json() for s in c.plan.stages]) for c in found.ranked],
                [c.to_json() for c in found.unfit], found.invalid, found.splits)

    assert len(fast.ranked) > 50 and any("interleaved" in c.choice.name for c in fast.ranked)
    assert numbers(fast) == numbers(fresh)


def test_plan_auto_prints_the_pick(capsys):
    from tpctl.commands.plan import main

    assert main(["--auto", "world=2", "hardware=cpu", *TINY]) == 0
    out = capsys.readouterr().out
    assert "★" in out and "run the pick: tpctl train mode=" in out and "searched" in out


@pytest.mark.parametrize("args, words", [
    (["world=2", "hardware=h100", "memory=0.0001"], ["memory=", "smallest peak", "per rank", "to fit"]),
    (["world=7", "hardware=cpu"], ["world=7", "no layout of 7 ranks"]),
])
def test_plan_auto_refuses_in_one_line(capsys, args, words):
    from tpctl.commands.plan import main

    assert main(["--auto", *args, *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tpctl: error:")
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("args, words", [
    (["layout=auto", "world=2", "mode=1d"], ["mode=", "1d", "layout=auto picks it"]),
    (["layout=auto"], ["world=None", "world=N"]),
    (["layout=auto", "world=2", "hardware=h100", "memory=1"], ["memory"]),  # not a key of train: composition refuses
    (["layout=wide", "world=2"], ["layout='wide'", "expected auto"]),
    (["layout=auto", "world=2", "hardware=tpu"], ["hardware='tpu'", "expected one of", "cpu", "h100", "h200"]),
    (["hardware=h1000"], ["hardware='h1000'", "expected one of", "did you mean 'h100'"]),
])
def test_train_layout_auto_refuses_before_any_worker(capsys, tmp_path, args, words):
    from tpctl.commands.train import main

    assert main([*args, *TINY, f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tpctl: error:") and all(w in err[-1] for w in words), err
    assert not (tmp_path / "run").exists()


def test_collectives_stretch_only_beyond_the_turns_the_profile_measured():
    """A CPU profile timed its all-reduces over comm_world ranks: those
    turns are in its latency already; more ranks than that take more,
    fewer take fewer (2 ranks on 2 cores: none)."""
    import dataclasses

    from tpctl.cost.hardware import load_hardware

    cpu = dataclasses.replace(load_hardware("cpu"), cores=2, comm_world=0)
    assert [cpu.comm_turns(w) for w in (1, 2, 8)] == [1.0, 1.0, 4.0]
    timed_at_8 = dataclasses.replace(cpu, comm_world=8)
    assert [timed_at_8.comm_turns(w) for w in (2, 8, 16)] == [0.25, 1.0, 2.0]
    assert dataclasses.replace(load_hardware("h100"), comm_world=8).comm_turns(64) == 1.0  # a GPU: no turns


def test_every_collective_takes_its_kinds_measured_time():
    """A profile's reduce_scatter_factor stretches every reduce-scatter,
    those a step waits for and those issued beside other work (1d with
    sequence parallelism has both): issuing one asynchronously hides it
    behind compute, it does not make gloo run it faster."""
    import dataclasses

    from tpctl.config import compose_jobs
    from tpctl.cost.hardware import load_hardware
    from tpctl.cost.planner import model_shape, plan_split, predict
    from tpctl.parallel.layout import Layout

    cfg = compose_jobs(TINY)[0]
    plan = plan_split(model_shape(cfg.model), Layout.parse("1d-2-sp-dp2"), 8, 16)
    hw = dataclasses.replace(load_hardware("cpu"), reduce_scatter_factor=1.0, all_gather_factor=1.0)
    base = predict(dataclasses.replace(plan), hw)
    stretched = predict(dataclasses.replace(plan), dataclasses.replace(hw, reduce_scatter_factor=3.0))
    c = plan.comm[("reduce_scatter", "tp")]
    assert 0 < c.hidden_calls < c.calls
    sent = c.calls * hw.intra_latency + c.wire_bytes / hw.intra_bw
    # comm_s + hidden_s: every collective's time, before any is hidden
    assert (stretched.comm_s + stretched.hidden_s) - (base.comm_s + base.hidden_s) == pytest.approx(2 * sent)
    assert stretched.hidden_s >= base.hidden_s


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calibrate_writes_a_profile_the_planner_reads(tmp_path, monkeypatch):
    """`tpctl plan --calibrate` on 2 ranks: every number it fits is there
    and positive, and load_hardware reads it back."""
    from tpctl.cost import hardware
    from tpctl.cost.calibrate import calibrate

    monkeypatch.setattr(hardware, "HARDWARE_DIR", tmp_path)
    assert calibrate("probe", 2, TINY) == 0
    hw = hardware.load_hardware("probe")
    assert hw.comm_world == 2 and hw.cores > 0 and "calibrated" in hw.note
    for value in (hw.peak_flops, hw.intra_bw, hw.intra_latency, hw.base_bytes, hw.reduce_scatter_factor,
                  hw.all_gather_factor):
        assert value > 0


def test_a_choices_exposed_communication_is_the_one_in_its_step(tiny_cfg):
    """What `plan --auto` prints as exposed communication is the part of
    the predicted step spent in collectives: the split's, and with
    checkpointing also the recomputed forward's (1d re-sends its sums)."""
    from tpctl.cost.auto import search
    from tpctl.cost.hardware import load_hardware

    hw = load_hardware("cpu")
    by_name = {c.choice.name: c for c in search(tiny_cfg, 4, hw).ranked}
    plain, ckpt = by_name["1d-2-dp2"], by_name["1d-2-dp2 ckpt"]
    turns = hw.comm_turns(4)
    assert plain.exposed_comm_s == pytest.approx(plain.plan.comm_s * turns) and 0 < plain.exposed_comm_s < plain.step_time_s
    assert ckpt.exposed_comm_s > plain.exposed_comm_s  # the same split, its sums sent again
    assert ckpt.to_json()["exposed_comm_ms"] == pytest.approx(ckpt.exposed_comm_s * 1e3)


def test_train_layout_auto_prices_the_pick_on_the_hardware_named(tpctl, tmp_path):
    """`tpctl train layout=auto world=N hardware=NAME` (the profiles of
    configs/hardware_profiles/ are no Hydra group: the key takes the name).
    Through the CLI: Hydra's job logging would stay installed in this process."""
    from omegaconf import OmegaConf

    hardware = "h100"
    done = tpctl.run(["train", "layout=auto", "world=2", f"hardware={hardware}", *TINY,
                      f"hydra.run.dir={tmp_path / 'run'}", "--dry-run"], timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"on hardware={hardware}:" in done.stderr
    cfg = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert cfg.hardware == hardware and cfg.auto.hardware == hardware
