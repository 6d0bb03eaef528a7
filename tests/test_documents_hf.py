"""data.documents=true on Hugging Face causal LMs (parallel/context/documents.py,
install_hf): a window's documents each computed as if alone (no attention
across a boundary, rotary positions restarting per document), the same in
every layout as in mode=none; the families it cannot reach refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cli_support import tpctl  # noqa: F401  (fixture)
from conftest import tiny_config
from test_documents import (EOS, RUN, _deviation, _ids, _model, corpus, curve_of,  # noqa: F401  (corpus: fixture)
                            errors_against)

from tpctl.parallel.layout import Layout

LLAMA = {"model.arch": "llama", "model.bias": None, "model.n_embd": 32, "model.n_head": 8, "model.n_kv_head": 4,
         "model.n_layer": 2}


def _config(arch: str = "llama", steps: int = 1, window=None, **overrides):
    """A tiny `arch` (with `window`: Mistral's sliding window of that many positions)."""
    sliding = {} if window is None else {"model.config": {"sliding_window": window}}
    return tiny_config(steps, **{**LLAMA, "model.arch": arch, **sliding, **overrides})


def _logits(model, ids):
    from tpctl.parallel.roles.plan import logits_of

    return logits_of(model(ids))


DOCS = [torch.tensor([[5, 6, 7, 8, EOS]]), torch.tensor([[9, 10, 11, EOS]]), torch.tensor([[12, 13, 14, 15, 16]])]
# A sliding window shorter than every document of DOCS (and than
# train.seq_len): it cuts inside each document.
WINDOW = min(d.shape[1] for d in DOCS) - 1


def _window_against_alone(arch: str, window=None) -> tuple[float, float]:
    """A window of three documents against each document run alone from
    position 0 (the definition; with Mistral's sliding `window`, the
    family's own sliding mask alone), both against the window's next
    tokens: (|the window's loss - the sum of the documents'| relative, the
    largest difference of a logit)."""
    from tpctl.models import build_model
    from tpctl.parallel.context import documents

    cfg = _config(arch, window=window)
    model = build_model(cfg.model, cfg.seed)
    assert window is None or model.config.sliding_window == window
    docs = DOCS
    window = torch.cat(docs, 1)
    x, y = window[:, :-1], window[:, 1:]
    documents.install(model, None, None, EOS)
    try:
        together = _logits(model, x)[0]
    finally:
        documents.install(model, None, None, None)
    # The last document's last token predicts nothing.
    alone = torch.cat([_logits(model, d)[0] for d in docs], 0)[:x.shape[1]]
    losses = [F.cross_entropy(logits, y[0], reduction="sum").item() for logits in (together, alone)]
    return abs(losses[0] - losses[1]) / abs(losses[1]), (together - alone).abs().max().item()


@pytest.mark.parametrize("arch,window", [("llama", None), ("qwen2", None), ("mistral", None), ("qwen3", None),
                                         ("mistral", WINDOW)])
def test_a_window_s_loss_is_the_sum_of_its_documents_run_alone(arch, window):
    loss_err, logit_err = _window_against_alone(arch, window)
    assert loss_err < 1e-6 and logit_err < 1e-5, (loss_err, logit_err)


def test_the_definition_fails_without_the_sliding_window(monkeypatch):
    """The documents' mask not cut to Mistral's window (each document alone
    is): the check above fails."""
    from tpctl.parallel.context import documents

    whole = documents.Documents.mask
    monkeypatch.setattr(documents.Documents, "mask", lambda self, window=None: whole(self))
    loss_err, logit_err = _window_against_alone("mistral", WINDOW)
    assert loss_err > 1e-5 and logit_err > 1e-2, (loss_err, logit_err)


def test_the_definition_fails_without_the_mask(monkeypatch):
    """The check above is not vacuous: documents that keep the plain causal
    mask fail it."""
    from tpctl.parallel.context import documents

    def causal(self, window=None):
        n = self.held.numel()
        self._mask = torch.ones(n, n, dtype=torch.bool).tril()
        return self._mask
    monkeypatch.setattr(documents.Documents, "mask", causal)
    loss_err, logit_err = _window_against_alone("llama")
    assert loss_err > 1e-5 and logit_err > 1e-2, (loss_err, logit_err)


@pytest.mark.parametrize("mutation", [False, True])
def test_the_rotary_table_is_fed_each_position_s_index_in_its_document(monkeypatch, mutation):
    """Rotary attention depends on positions only through their differences,
    which the mask keeps within a document: the window's positions would
    give the same numbers (up to round-off). So the positions are checked
    where they enter, the rotary table (and the check fails without them)."""
    from tpctl.models import build_model
    from tpctl.parallel.context import documents

    if mutation:
        monkeypatch.setattr(documents, "_rotary_positions", lambda module, args, kwargs: None)
    cfg = _config()
    model = build_model(cfg.model, cfg.seed)
    documents.install(model, None, None, EOS)
    fed = []
    model.model.rotary_emb.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["position_ids"]), with_kwargs=True)
    ids = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    if mutation:
        with pytest.raises(RuntimeError, match="computed its positions without its rotary embedding module"):
            model(ids)
        assert fed[0].tolist() == [list(range(8))]
    else:
        model(ids)
        assert fed[0].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_a_mask_of_its_own_or_attention_without_sdpa_is_refused_naming_the_module():
    from tpctl.models import build_model
    from tpctl.parallel.context import documents

    cfg = _config()
    model = build_model(cfg.model, cfg.seed)
    documents.install(model, None, None, EOS)
    ids = _ids(2, 8)
    model.config._attn_implementation = "eager"  # its own matmuls: the documents would not reach them
    with pytest.raises(RuntimeError, match=r"model.layers.0.self_attn \(LlamaAttention\) computes attention without"):
        model(ids)
    model.config._attn_implementation = "sdpa"
    padding = torch.ones_like(ids, dtype=torch.bool)
    assert documents.current() is None
    model(ids, attention_mask=padding)  # a call of its own masks is the family's, unchanged
    docs = documents.Documents(torch.zeros(2, 8, dtype=torch.long), torch.arange(8), torch.zeros(2, 8), None)
    docs.replaces_causal = True
    window = torch.ones(8, 8, dtype=torch.bool).tril().triu(1 - WINDOW)
    # A sliding window is recognised (and cut into the documents' mask) by
    # _Masks only: cp's handler, which asks `takes`, has no window.
    assert docs.window(window) == WINDOW and docs.window(window.float().log()) == WINDOW
    with pytest.raises(RuntimeError, match="attn.x calls attention with a mask of its own"):
        docs.takes("attn.x", window, False)
    assert docs.window(window.triu(1)) is None and docs.window(padding[:, None, None, :].expand(2, 1, 8, 8)) is None
    assert docs.takes("attn.x", torch.ones(8, 8, dtype=torch.bool).tril(), False)
    assert docs.takes("attn.x", None, True)


def _against_one_process(name: str, impl: str, arch: str) -> tuple[float, float]:
    """One forward and backward of a batch with documents in layout `name`
    against one process's: the loss's relative error and the worst
    gradient's (norm-relative)."""
    from conftest import build

    cfg = _config(arch, **{"context.impl": impl})
    return errors_against(build(cfg, Layout.parse(name)), _model(cfg), cfg)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,impl,arch", [
    # (1d with sequence parallelism and pipeline stages: the whole runs below.)
    ("2d-4", "ring", "llama"), ("none-cp2-dp2", "ring", "qwen2"), ("1d-2-cp2", "ulysses", "llama"),
    # 8 ranks on 2 cores: the pool of its own; measured 6.5e-8 / 5.8e-7.
    pytest.param("3d-8", "ring", "llama", marks=pytest.mark.slow),
])
def test_every_layout_masks_hf_documents_as_one_process(pool, name, impl, arch):
    for loss_err, grad_err in pool.run(_against_one_process, name, impl, arch, ranks=Layout.parse(name).world):
        assert loss_err < 1e-6 and grad_err < 1e-6, (name, impl, arch, loss_err, grad_err)


# ---- whole runs on a prepared corpus ----------------------------------------


def _curve(name: str, path: str, arch: str = "llama", impl: str = "ring", documents: bool = True, window=None,
           pretrained=None) -> list[tuple]:
    """Every step's loss and grad norm (and the last val loss) of a 3-step
    run of `arch` (with Mistral's sliding `window`; or the save_pretrained
    directory `pretrained`) on `path` in layout `name`, as this rank logs them."""
    layout = Layout.parse(name)
    cfg = _config(arch, 3, window, **{"data.path": path, "data.documents": documents, "context.impl": impl,
                                      "train.eval_every": 3, "train.eval_batches": 1, "model.pretrained": pretrained})
    return curve_of(layout.write_to(cfg), layout)


_reference: dict = {}


def _one_process(pool, corpus: str, arch: str, documents: bool = True, window=None,  # noqa: F811
                 pretrained=None) -> list[tuple]:
    key = (arch, documents, window, pretrained)
    if key not in _reference:
        _reference[key] = pool.run(_curve, "none", corpus, arch, "ring", documents, window, pretrained, ranks=1)[0]
    return _reference[key]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,impl,arch", [
    ("1d-2-sp-dp2", "ring", "llama"), ("2d-4", "ring", "llama"), ("1d-2-pp2", "ring", "llama"),
    ("none-cp2-dp2", "ring", "llama"), ("none-pp2-cp2", "ulysses", "qwen2"),
])
def test_a_run_of_a_hf_model_with_documents_trains_as_one_process(pool, corpus, name, impl, arch):  # noqa: F811
    """Loss, gradient norm and validation loss of three steps within fp32
    round-off of mode=none's, with sequence parallelism, 2d's blocks,
    pipeline stages (each stage's forward computes the documents) and
    both cp attentions."""
    want = _one_process(pool, corpus, arch)
    assert _deviation(_one_process(pool, corpus, arch, documents=False), want) > 1e-3  # the documents change the run
    for curve in pool.run(_curve, name, corpus, arch, impl, ranks=Layout.parse(name).world):
        assert _deviation(curve, want) < 1e-6, (name, impl, curve, want)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,impl", [("1d-2", "ring"), ("2d-4", "ring"), ("1d-2-cp2", "ring"),
                                       ("none-cp2-dp2", "ulysses")])
def test_a_mistral_with_a_sliding_window_and_documents_trains_as_one_process(pool, corpus, name, impl):  # noqa: F811
    """Mistral's window shorter than the sequence and than the corpus's
    longer documents: the documents' mask cut to it (across cp ranks: each
    pair of chunks masked by documents and window) trains as mode=none's,
    and the window changes the run (it is not dropped)."""
    want = _one_process(pool, corpus, "mistral", window=WINDOW)
    assert _deviation(_one_process(pool, corpus, "mistral"), want) > 1e-3
    for curve in pool.run(_curve, name, corpus, "mistral", impl, True, WINDOW, ranks=Layout.parse(name).world):
        assert _deviation(curve, want) < 1e-6, (name, curve, want)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    """A tiny Llama save_pretrained directory, as tests/test_hf_io.py makes them."""
    from test_hf_io import save_family

    directory = tmp_path_factory.mktemp("pretrained") / "llama"
    save_family("llama", directory)
    return str(directory)


@pytest.mark.timeout(900)
def test_a_pretrained_model_with_documents_trains_in_1d_as_one_process(pool, corpus, pretrained):  # noqa: F811
    """model.pretrained: the family read from the directory (not
    model.arch) is the one the documents reach, its weights train as
    mode=none's in 1d-2, and the documents change the run."""
    want = _one_process(pool, corpus, "llama", pretrained=pretrained)
    assert _deviation(_one_process(pool, corpus, "llama", documents=False, pretrained=pretrained), want) > 1e-3
    for curve in pool.run(_curve, "1d-2", corpus, "llama", "ring", True, None, pretrained,
                          ranks=Layout.parse("1d-2").world):
        assert _deviation(curve, want) < 1e-6, (curve, want)


# ---- the command line ---------------------------------------------------------

BASE = [o for o in RUN if not o.startswith("model")]  # the run without its model
HF = BASE + ["model=hf", "model.arch=llama", "model.n_layer=1", "model.n_head=8", "model.n_kv_head=4",
             "model.n_embd=32", "model.block_size=16"]


@pytest.mark.timeout(600)
def test_tpctl_train_a_llama_with_documents_in_cp_ring_equals_mode_none(tpctl, corpus):  # noqa: F811
    import json

    losses = {}
    for name, layout in (("none", ["mode=none"]), ("cp", ["mode=1d", "size=2", "cp=2", "context.impl=ring"])):
        run = tpctl.cwd / name
        done = tpctl.run(["train", *HF, f"data.path={corpus}", *layout, f"hydra.run.dir={run}"], timeout=300)
        assert done.returncode == 0, done.stderr
        losses[name] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["none"]) == 3 and losses["cp"] == pytest.approx(losses["none"], rel=1e-6)


@pytest.mark.parametrize("overrides,says", [
    (["model.arch=gpt2", "model.bias=null"], "model.arch=gpt2 is not a model whose attention and positions"),
    (["model.arch=bloom", "model.n_kv_head=null"], "model.arch=bloom is not a model whose attention and positions"),
    (["model=custom", "model._target_=tests.custom_model.build", "+model.width=16", "+model.max_len=16",
      "+model.vocab_size=256", "train.seq_len=16"], "model.arch=custom is not a model"),
])
def test_a_hf_model_documents_cannot_reach_is_refused_in_one_line(tpctl, corpus, overrides, says):  # noqa: F811
    model = BASE if overrides[0] == "model=custom" else HF
    args = ["train", *model, f"data.path={corpus}", *overrides, f"hydra.run.dir={tpctl.cwd / 'run'}"]
    done = tpctl.run(args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0] and "data.documents" in lines[0], done.stderr
    assert not (tpctl.cwd / "run" / "metrics.jsonl").exists()
