"""What the pipeline, ZeRO and the Hugging Face round trip let through
(issue 31): layout keys read as written, export's write failures, damaged
safetensors found before start, the bench's layout, dependencies' warnings
kept off the terminal, and dropout under pipeline stages. In-process where
possible; each CLI case is one short subprocess."""

from __future__ import annotations

import re

import pytest
from cli_support import tiny_gpt2_directory, scaled
from omegaconf import OmegaConf

from tpctl.config import compose_jobs
from tpctl.config.layout_checks import check_layout
from tpctl.errors import ConfigError
from tpctl.parallel.layout import Layout

# --------------------------------------------------------------------------
# Every integer layout key reaches validation as written
# --------------------------------------------------------------------------

LAYOUT_KEYS = ("size", "depth", "dp", "pp", "zero", "train.grad_accum", "train.batch_size",
               "pipeline.microbatches", "pipeline.virtual_stages")


@pytest.fixture(scope="module")
def plain_config() -> dict:
    """A composed config as a plain mapping: a key can then hold any value
    (a manifest's or a plan's config is untyped too), so what validation
    itself does with it is seen, not what Hydra's typing refused first."""
    return OmegaConf.to_container(compose_jobs(["data=synthetic", "model=gpt-tiny"])[0])


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, 2.0, True], ids=repr)
@pytest.mark.parametrize("key", LAYOUT_KEYS)
def test_every_layout_key_is_validated_as_written(plain_config, key, value):
    if key == "zero" and value == 0 and type(value) is int:
        pytest.skip("zero=0 is the default: no ZeRO")
    cfg = OmegaConf.create(plain_config)
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError) as e:
        check_layout(cfg)
    assert e.value.key == key and e.value.value is value, str(e.value)


def test_a_layout_read_from_a_mapping_keeps_its_values():
    # `pp or 1` once made pp=0 one stage: the run said pp: 0, its summary pp: 1.
    assert Layout.from_config({"mode": "none", "pp": 0, "depth": 0, "zero": 0}).pp == 0
    assert Layout.from_config({"mode": "1d"}) == Layout("1d")  # keys a config predates: the defaults
    with pytest.raises(ConfigError, match=r"^invalid config: pp=0: expected a positive number of pipeline stages$"):
        Layout.from_config({"pp": 0}).validate()


# --------------------------------------------------------------------------
# tpctl export: OUT that cannot be written is one line
# --------------------------------------------------------------------------


def _tiny_export_inputs(hf: bool) -> tuple[dict, dict]:
    """(manifest, whole tensors) of a checkpoint without writing one: a
    tiny llama for the Hugging Face directory, tpctl's gpt for one file."""
    import torch

    if not hf:
        return {"step": 1, "model": {"arch": "gpt"}, "config": {}}, {"wte.weight": torch.zeros(64, 64)}
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tpctl.models.hf import family_config
    from tpctl.schema import ModelConfig

    model = OmegaConf.to_container(OmegaConf.structured(ModelConfig(
        arch="llama", vocab_size=16, n_layer=1, n_head=2, n_embd=8, block_size=8, bias=None)))
    built = AutoModelForCausalLM.from_config(family_config(OmegaConf.create(model)))
    return {"step": 1, "model": model, "config": {}}, {k: v.detach() for k, v in built.named_parameters()}


def _export(monkeypatch, capsys, hf: bool, out, file_limit: int | None = None) -> tuple[int, list[str]]:
    """`tpctl export CKPT OUT` in this process on a checkpoint's stand-in;
    (status, stderr lines)."""
    import resource

    import tpctl.checkpoint
    from tpctl.commands import export

    manifest, tensors = _tiny_export_inputs(hf)
    monkeypatch.setattr(tpctl.checkpoint, "verify", lambda path: manifest)
    monkeypatch.setattr(export, "full_weights", lambda path: (manifest, tensors))
    saved = resource.getrlimit(resource.RLIMIT_FSIZE)
    if file_limit is not None:  # the kernel refuses writes past it (EFBIG), as a full disk does (ENOSPC)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, saved[1]))
    try:
        status = export.main(["ckpt", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, saved)
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("hf", [False, True], ids=["file", "hf-dir"])
def test_an_export_that_cannot_be_written_is_one_line_naming_out(monkeypatch, capsys, tmp_path, hf):
    name = "out" if hf else "model.safetensors"
    # /sys: writes refused (EACCES) even to root, as on a read-only mount.
    status, lines = _export(monkeypatch, capsys, hf, f"/sys/{name}")
    assert status == 1 and len(lines) == 1, lines
    assert re.fullmatch(rf"tpctl: error: export OUT='/sys/{name}': not written: OSError \[E(ACCES|PERM)\] \w.*", lines[0])
    # Past a file-size limit, inside safetensors' writer (its own error type).
    status, lines = _export(monkeypatch, capsys, hf, tmp_path / name, file_limit=2000)
    assert status == 1 and lines == [f"tpctl: error: export OUT='{tmp_path / name}': not written: OSError [EFBIG] "
                                     "File too large"], lines
    assert list(tmp_path.iterdir()) == []  # nothing half-written left beside it
    status, lines = _export(monkeypatch, capsys, hf, tmp_path / name)  # and where it can be written, it is
    assert status == 0 and lines == [] and [p.name for p in tmp_path.iterdir()] == [name], lines


def test_an_export_under_a_regular_file_says_so(monkeypatch, capsys, tmp_path):
    (tmp_path / "A").write_text("a file")
    status, lines = _export(monkeypatch, capsys, False, tmp_path / "A" / "out")
    assert status == 2 and lines == [f"tpctl: error: export OUT='{tmp_path / 'A' / 'out'}': {tmp_path / 'A'} is a "
                                     "file, not a directory"], lines


# --------------------------------------------------------------------------
# A damaged or truncated model.safetensors: found before anything starts
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_directory(tmp_path_factory):
    return tiny_gpt2_directory(tmp_path_factory, n_positions=16)


def _damaged_copy(source, tmp_path, damage) -> tuple:
    import shutil

    directory = tmp_path / "pretrained"
    shutil.copytree(source, directory)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    weights.write_bytes(damage(data))
    return directory, weights


@pytest.mark.parametrize("damage,why", [
    (lambda data: data[:-100], r"truncated: its header places tensor data up to byte (\d+), the file holds (\d+)$"),
    (lambda data: data[:9] + b"#" + data[10:], r"its header is not JSON \(Expecting .*\): damaged$"),
], ids=["truncated", "header"])
def test_a_damaged_safetensors_file_is_named_before_anything_starts(gpt2_directory, tmp_path, capsys, monkeypatch,
                                                                     damage, why):
    from tpctl.commands import generate, train

    directory, weights = _damaged_copy(gpt2_directory, tmp_path, damage)
    capsys.readouterr()
    expected = rf"tpctl: error: invalid config: model.pretrained='{directory}': {weights}: {why}"
    assert generate.main([str(directory), "prompt=hi"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), lines
    # train: refused before its run dir exists (once a worker's short read, ~40 s in, naming no file).
    monkeypatch.setenv("TPCTL_WORKER_MODULE", "tests.fake_worker")  # were it accepted: nothing real starts
    monkeypatch.chdir(tmp_path)
    assert train.main(["model=hf", f"model.pretrained={directory}", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrained"]


# --------------------------------------------------------------------------
# tpctl bench: pp with no mode that runs stages
# --------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_bench_refuses_stages_that_no_listed_mode_runs(capsys):
    from tpctl.commands import bench

    # Once: exit 0, a header of "3 ranks (pp=3)" over one rank of a 2-block model.
    assert bench.main(["size=1", "modes=[none]", "pp=3", "steps=1", "rounds=1", "warmup=0"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpctl: error: invalid config: pp=3: pipeline stages are for "
                                                   "tpctl's tensor-parallel modes, and modes=[none] has none"), lines


# --------------------------------------------------------------------------
# Generation: transformers' current interface, no warnings on the terminal
# --------------------------------------------------------------------------


def test_decoding_a_transformers_model_warns_nothing(gpt2_directory):
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from tpctl.training.generation import Stepper

    stepper = Stepper(AutoModelForCausalLM.from_pretrained(gpt2_directory).eval())
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        first = stepper(torch.tensor([[1, 2, 3]]))
        second = stepper(torch.tensor([[4]]))  # through the cache
    assert [str(w.message) for w in caught] == []
    assert first.shape[1] == 3 and second.shape[1] == 1
    assert stepper.cache.get_seq_length() == 4


# --------------------------------------------------------------------------
# Dropout under pipeline stages: what the equality is
# --------------------------------------------------------------------------

MICRO = 4


def _dropout_curves() -> dict:
    """Two steps of a 2-block GPT with dropout 0.3: as pp=2 with M=MICRO
    (both ranks), and on rank 0 alone as one process accumulating over
    MICRO micro-batches and over one: {run: [(loss, grad_norm)]}."""
    import torch.distributed as dist
    from conftest import build_trainer, tiny_config

    def curve(layout: Layout, **overrides) -> list:
        cfg = layout.write_to(tiny_config(2, **{"model.n_layer": 2, "model.dropout": 0.3, "data.name": "synthetic",
                                                "data.synthetic_tokens": 4096, **overrides}))
        check_layout(cfg, layout)
        pooled = layout.world > 1  # one process: no process groups at all
        trainer = build_trainer(cfg, layout, pooled=pooled, **({} if pooled else {"groups": False}))
        return [(r["loss"], r["grad_norm"]) for r in trainer.fit()]

    out = {"pp2": curve(Layout("none", pp=2), **{"pipeline.microbatches": MICRO})}
    if dist.get_rank() == 0:
        out["accumulated"] = curve(Layout("none"), **{"train.grad_accum": MICRO})
        out["one batch"] = curve(Layout("none"))
    return out


@pytest.mark.timeout(600)
def test_a_pipeline_with_dropout_is_one_process_accumulating_over_its_micro_batches():
    """docs/guide/pipeline.md's statement: masks are drawn per (step, micro-batch,
    block), so pp=P with M micro-batches equals mode=none train.grad_accum=M
    (fp32 round-off), not one unsplit batch."""
    from tpctl.launch.pool import DistPool
    from tpctl.parallel.pipeline.stages import PipelineSpec

    # What the start-up line and `tpctl inspect` say of such a run.
    assert PipelineSpec(2, "1f1b", 1, MICRO).dropout_note(0.3) == (
        f"dropout=0.3 with M={MICRO} micro-batches: masks are drawn per micro-batch, so this run equals pp=1 "
        f"train.grad_accum={MICRO} (fp32 round-off), not pp=1 on one unsplit batch")
    assert PipelineSpec(2, "1f1b", 1, MICRO).dropout_note(0.0) is None

    pool = DistPool(2, timeout_s=scaled(500))
    try:
        rank0, rank1 = pool.run(_dropout_curves)
    finally:
        pool.close()
    assert rank0["pp2"] == rank1["pp2"], "every rank logs the same loss"
    for (loss, norm), (want_loss, want_norm) in zip(rank0["pp2"], rank0["accumulated"]):
        assert loss == pytest.approx(want_loss, rel=1e-6) and norm == pytest.approx(want_norm, rel=1e-5)
    assert abs(rank0["pp2"][0][0] - rank0["one batch"][0][0]) > 1e-4, "dropout draws other masks for one batch"
