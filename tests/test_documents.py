"""data.documents=true (tpctl/data/documents.py, parallel/context/documents.py):
a prepared corpus's documents kept apart, no attention across a boundary
and positions restarting per document, the same in every layout as in
mode=none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_support import tpctl  # noqa: F401  (fixture)
from conftest import build_trainer, tiny_config, worst_grad_error

from tpctl.parallel.layout import Layout

EOS = 0  # the byte tokenizer's separator


def _ids(rows: int, seq: int, seed: int = 5, vocab: int = 256) -> torch.Tensor:
    """Random ids with a separator at about one position in five."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq), generator=g)
    return ids.masked_fill(torch.rand(rows, seq, generator=g) < 0.2, EOS)


def _model(cfg, eos=EOS):
    from tpctl.models import build_model
    from tpctl.parallel.context import documents

    model = build_model(cfg.model, cfg.seed)
    documents.install(model, None, None, eos)
    return model


def test_a_window_s_documents_and_positions_count_from_its_separators():
    from tpctl.parallel.context.documents import document_ids, document_positions

    ids = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    doc = document_ids(ids, EOS)
    # A separator ends the document it closes; the window's first document starts at 0.
    assert doc.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_the_ring_skips_exactly_the_chunk_pairs_that_see_nothing():
    """The ring's table of which chunk pairs see a key (one look at the host
    per forward) equals each pair's mask looked at whole, over windows with
    many, few and no separators."""
    from tpctl.parallel.context.attention import _chunks_seen, _pair_mask
    from tpctl.parallel.context.documents import document_ids

    chunk, n = 3, 8
    for seed, rate in [(1, 0.05), (2, 0.3), (3, 0.9), (4, 0.0)]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, 256, (3, chunk * n), generator=g).masked_fill(torch.rand(3, chunk * n, generator=g) < rate, EOS)
        doc = document_ids(ids, EOS)
        seen = _chunks_seen(doc, chunk)
        skipped = 0
        for a in range(n):
            for b in range(a):
                whole = bool(_pair_mask(doc, a, b, chunk, False).any())
                assert seen[a][b] == whole, (seed, a, b)
                skipped += not whole
        assert (skipped > 0) == (rate > 0.1), seed  # the cases do skip pairs (and none without separators)


def test_a_token_never_sees_another_document():
    """Another document's tokens changed: this document's logits do not
    move; a document inside a window gives the logits it gives alone (its
    positions restart); without documents the mask and positions do matter."""
    cfg = tiny_config(1, **{"model.n_layer": 2})
    model = _model(cfg)
    ids = _ids(2, 16)
    ids[0, 5], ids[0, 10] = EOS, EOS
    ids[0, 6:10] = torch.tensor([11, 12, 13, 14])
    out = model(ids)
    for doc_of in range(3):
        other = ids.clone()
        span = {0: slice(0, 5), 1: slice(6, 10), 2: slice(11, 16)}[doc_of]
        other[0, span] = (other[0, span] + 7) % 255 + 1  # no separator: the same boundaries
        moved = (model(other)[0] - out[0]).abs().amax(-1)
        unmoved = torch.ones(16, dtype=torch.bool)
        unmoved[span.start:span.stop + (1 if doc_of < 2 else 0)] = False  # its tokens and its separator
        assert moved[unmoved].max() == 0, doc_of
        assert moved[~unmoved].max() > 1e-3, doc_of
    alone = _model(cfg, eos=None)(ids[:1, 6:11])  # the document 11..14 and its separator, from position 0
    assert (out[0, 6:11] - alone[0]).abs().max() < 1e-5
    plain = _model(cfg, eos=None)(ids)
    assert (plain[0, 6:11] - out[0, 6:11]).abs().max() > 1e-3


def _against_one_process(name: str, impl: str) -> tuple[float, float]:
    """One forward and backward of a batch with documents in layout `name`
    (context.impl `impl`) against one process's: the loss's relative error
    and the worst gradient's (norm-relative)."""
    from conftest import build

    cfg = tiny_config(1, **{"model.n_embd": 32, "model.n_head": 8, "context.impl": impl})
    return errors_against(build(cfg, Layout.parse(name)), _model(cfg), cfg)


def errors_against(run, ref, cfg) -> tuple[float, float]:
    """One forward and backward of a batch with documents on `run` (built
    for the layout) against `ref` (one process's model reading documents):
    the loss's relative error and the worst gradient's (norm-relative)."""
    import torch.nn.functional as F

    from tpctl.parallel.context import documents
    from tpctl.parallel.roles.plan import logits_of

    par = run.par
    documents.install(run.model, par.mode, par.cp, EOS)
    batch, seq, vocab = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    ids = _ids(batch, seq + 1)
    x, y = ids[:, :-1], ids[:, 1:]
    ref_loss = F.cross_entropy(logits_of(ref(x)).reshape(-1, vocab), y.reshape(-1), reduction="sum") / y.numel()
    ref_loss.backward()
    loss_sum = run.step.forward_backward([(par.shard_batch(x), par.shard_targets(y))], 0)
    par.finish_grads([run.model])
    loss = par.global_mean(loss_sum, y.numel())
    documents.install(run.model, par.mode, par.cp, None)
    return abs(loss - ref_loss.item()) / abs(ref_loss.item()), worst_grad_error(run.model, ref)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,impl", [
    ("none-cp4", "ring"), ("none-cp2-dp2", "ulysses"), ("1d-2-sp-cp2", "ring"), ("2d-4", "ring"),
    ("2d-4-cp2", "ring"),
    # 8 ranks on 2 cores: a pool of its own, a minute or more each.
    pytest.param("3d-8", "ring", marks=pytest.mark.slow), pytest.param("2.5d-8-d2", "ring", marks=pytest.mark.slow),
])
def test_every_layout_masks_documents_as_one_process(pool, name, impl):
    for loss_err, grad_err in pool.run(_against_one_process, name, impl, ranks=Layout.parse(name).world):
        assert loss_err < 1e-6 and grad_err < 1e-6, (name, impl, loss_err, grad_err)


# ---- whole runs on a prepared corpus ----------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A prepared corpus (byte tokenizer) of documents of 1 to 12 bytes:
    every window of 16 tokens crosses several boundaries."""
    from tpctl.data.prepare import prepare

    root = tmp_path_factory.mktemp("documents")
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(400):
        n = int(torch.randint(1, 13, (1,), generator=g))
        lines.append(json.dumps({"text": "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=g))}))
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(root / "docs.jsonl")], root / "corpus", "bytes", val_fraction=0.1)
    return str(root / "corpus")


def _curve(name: str, path: str, impl: str = "ring", documents: bool = True, dropout: float = 0.0) -> list[tuple]:
    """Every step's loss and grad norm (and the last val loss) of a short run
    on `path` in layout `name`, as this rank logs them."""
    layout = Layout.parse(name)
    return curve_of(layout.write_to(tiny_config(3, **{"model.n_layer": 2, "data.path": path, "data.documents": documents,
                                                      "context.impl": impl, "train.eval_every": 3,
                                                      "train.eval_batches": 1, "model.dropout": dropout})), layout)


def curve_of(cfg, layout: Layout) -> list[tuple]:
    """Every step's (loss, grad norm, last val loss) of `cfg` trained in
    `layout` (stages: 1F1B over 2 micro-batches), as this rank logs them."""
    from tpctl.config import check_layout

    if layout.pp > 1:
        cfg.pipeline.schedule, cfg.pipeline.microbatches = "1f1b", 2
    check_layout(cfg, layout)
    records = build_trainer(cfg, layout, verify=True).fit()
    return [(r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in records]


_reference: dict = {}


def _one_process(pool, corpus: str, documents: bool = True) -> list[tuple]:
    if documents not in _reference:
        _reference[documents] = pool.run(_curve, "none", corpus, "ring", documents, ranks=1)[0]
    return _reference[documents]


def _deviation(curve: list[tuple], want: list[tuple]) -> float:
    assert len(curve) == len(want) == 3
    return max(abs(a - b) / abs(b) for got, ref in zip(curve, want) for a, b in zip(got, ref) if b is not None)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,impl", [
    ("1d-2-sp-dp2-z1", "ring"), ("1d-2-pp2-dp2", "ring"), ("none-cp2-dp2", "ring"), ("1d-2-cp2", "ulysses"),
    ("none-pp2-cp2", "ring"),
])
def test_a_run_with_documents_trains_as_one_process(pool, corpus, name, impl):
    """Loss, gradient norm and validation loss of three steps within fp32
    round-off of mode=none's, with ZeRO, sequence parallelism, pipeline
    stages (the ids reach every stage; with cp each stage gathers them)
    and both cp attentions."""
    want = _one_process(pool, corpus)
    assert _deviation(_one_process(pool, corpus, documents=False), want) > 1e-3  # the documents change the run
    for curve in pool.run(_curve, name, corpus, impl, ranks=Layout.parse(name).world):
        assert _deviation(curve, want) < 1e-6, (name, impl, curve, want)


# ---- the command line ---------------------------------------------------------

RUN = ["model=gpt-tiny", "model.n_layer=1", "optim.eps=1e-5", "train.batch_size=4", "train.seq_len=16",
       "train.log_every=1", "train.eval_every=0", "train.progress=false", "train.steps=3", "data.documents=true"]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_tpctl_train_with_documents_in_cp_ring_equals_mode_none(tpctl, corpus):  # noqa: F811
    runs = {}
    for name, layout in (("none", ["mode=none"]), ("cp", ["mode=1d", "size=2", "cp=2", "context.impl=ring"])):
        runs[name] = tpctl.cwd / name
        done = tpctl.run(["train", *RUN, f"data.path={corpus}", *layout, f"hydra.run.dir={runs[name]}"], timeout=300)
        assert done.returncode == 0, done.stderr
    want, got = _losses(runs["none"]), _losses(runs["cp"])
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("overrides,says", [
    (["data.name=synthetic"], "data.name=synthetic has no document boundaries"),
    ([], "data.path is the default corpus, which has no document boundaries"),
    (["data.path=a.txt"], "a token or text file, which has no document boundaries"),
    (["data.path=CORPUS", "train.activation_checkpointing=true"], "expected train.activation_checkpointing=false"),
    (["data.path=CORPUS", "model.arch=gpt2", "model.bias=null"], "expected model.arch in gpt, llama"),
    (["data.documents=maybe"], "data.documents"),
])
def test_what_cannot_keep_documents_apart_is_refused_in_one_line(tpctl, corpus, overrides, says):  # noqa: F811
    (tpctl.cwd / "a.txt").write_text("x" * 1000)
    args = ["train", *RUN, *[o.replace("CORPUS", corpus) for o in overrides], f"hydra.run.dir={tpctl.cwd / 'run'}"]
    done = tpctl.run(args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
    assert not (tpctl.cwd / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(600)
def test_dropout_on_attention_with_documents_under_cp_drops_as_without_cp(pool, corpus):
    """With dropout, cp gathers the keys (the probabilities must be the
    final ones to drop them): masked by the documents, the same run as the
    same replicas without cp."""
    want = pool.run(_curve, "none-dp2", corpus, "ring", True, 0.1, ranks=2)[0]
    for curve in pool.run(_curve, "none-cp2-dp2", corpus, "ulysses", True, 0.1, ranks=4):
        assert _deviation(curve, want) < 1e-6, (curve, want)
