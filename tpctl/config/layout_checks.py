"""The refusals of a run config that depend on its layout: the head and
hidden sizes the grid splits, the batch split into row blocks, the
pipeline's stages against the model's blocks, and what decoding
(`tpctl generate`) cannot split. The layout's own rules, which need no
config, stay with it (`Layout.validate`): the mesh checks them too."""

from __future__ import annotations

from typing import Any, Optional

from tpctl.errors import ConfigError
from tpctl.parallel.geometry import Geometry
from tpctl.parallel.layout import Layout, layouts_of

from .messages import check_integer
from .pipeline import check_pipeline


def check_layout(cfg: Any, layout: Optional[Layout] = None) -> Geometry:
    """Check the layout of `cfg` (or `layout`, planned for it) and
    everything that depends on it; ConfigError names the first bad key.
    Returns the grid's geometry."""
    layout = Layout.from_config(cfg) if layout is None else layout
    geo = layout.validate()
    _check_model_sizes(cfg, layout, geo)
    if layout.cp > 1:
        check_context(cfg, layout, geo)
    if layout.seq_parallel and cfg.train.seq_len % layout.size:
        raise ConfigError("train.seq_len", cfg.train.seq_len,
                          f"seq_parallel splits the sequence {layout.size} ways: expected a multiple of {layout.size}")
    t = cfg.train
    for key in ("grad_accum", "batch_size"):
        check_integer(f"train.{key}", t[key])
    if t.grad_accum < 1:
        raise ConfigError("train.grad_accum", t.grad_accum, "expected a positive number of micro-batches")
    if layout.pp > 1:
        _check_pipeline(cfg, layout)  # the pipeline's own split of the batch
        return geo
    check_pipeline(layout, cfg)  # its keys' values, even where one stage does not read them
    split = t.grad_accum * layout.dp * geo.batch_split
    if t.batch_size < 1 or t.batch_size % split:
        raise ConfigError(
            "train.batch_size", t.batch_size,
            f"the global batch is split into grad_accum({t.grad_accum}) x dp({layout.dp}) x {geo.batch_split} row blocks "
            f"(mode={layout.mode}): expected a positive multiple of {split}",
        )
    return geo


def _check_pipeline(cfg: Any, layout: Layout) -> None:
    """A pipeline of `layout.pp` stages for this config: what a stage cannot
    do, and its chunks against the model's blocks (the schedule's own
    arithmetic refuses in config/pipeline.py)."""
    if layout.seq_parallel:
        raise ConfigError("seq_parallel", True, "the stream a pipeline stage sends is not sequence-sharded yet: "
                          "expected seq_parallel=false with pp > 1")
    if cfg.train.get("sample_every", 0):
        raise ConfigError("train.sample_every", cfg.train.sample_every, "samples are decoded by one tensor-parallel "
                          "group, not through pipeline stages: expected 0 with pp > 1 (tpctl generate decodes a "
                          "checkpoint of any pp in any layout)")
    spec = check_pipeline(layout, cfg)
    m = cfg.model
    blocks = m.get("n_layer") if m.get("arch") not in ("custom", None) and not m.get("pretrained") else None
    if blocks is not None and spec.chunks > blocks:
        key, value = ("pp", layout.pp) if spec.virtual == 1 else ("pipeline.virtual_stages", spec.virtual)
        raise ConfigError(key, value, f"{spec.describe_chunks()}, more than the model's {blocks} blocks "
                          f"(model.n_layer): expected at most {blocks} stages")
    if blocks is not None and spec.split is not None and sum(spec.split) != blocks:
        raise ConfigError("pipeline.split", list(spec.split), f"expected {spec.chunks} numbers of blocks summing to "
                          f"the model's {blocks} (model.n_layer)")


# Models whose attention context parallelism replaces, each proven against
# one process (tests/test_context.py): tpctl's GPT (learned positions) and
# the Hugging Face families of GPT-2 (learned) and Llama, Mistral and Qwen2
# (rotary), whose attention calls torch's scaled_dot_product_attention.
CP_ARCHS = ("gpt", "gpt2", "llama", "mistral", "qwen2")


def check_context(cfg: Any, layout: Layout, geo: Geometry) -> None:
    """What context parallelism (cp > 1) can make exact: the models of
    CP_ARCHS (dropout: tpctl's GPT without sequence parallelism), without
    compiling or decoding; a sequence length the
    split divides; with Ulysses, heads the tensor split and cp divide."""
    from tpctl.parallel.context.split import IMPLS

    impl = cfg.get("context", {}).get("impl", "ring")
    if impl not in IMPLS:
        raise ConfigError("context.impl", impl, f"expected one of {', '.join(IMPLS)}")
    m, t, cp = cfg.model, cfg.train, layout.cp
    if m.get("arch") not in CP_ARCHS:
        raise ConfigError("cp", cp, f"model.arch={m.get('arch')}: context parallelism replaces attention computed by "
                          "torch's scaled_dot_product_attention with positions from a learned table or a rotary "
                          "embedding module, proven for model.arch in " + ", ".join(CP_ARCHS) + "; this model's "
                          "attention module is not: expected cp=1")
    dropout = m.dropout > 0
    refused = (("model.dropout", m.dropout, dropout and m.arch != "gpt",
                f"model.arch={m.arch} draws its attention's dropout inside torch's attention kernel, which cannot "
                "draw by global position (tpctl's own model.arch=gpt can): expected 0"),
               ("model.dropout", m.dropout, dropout and layout.seq_parallel,
                "sequence parallelism's stream shards draw their own masks, not by global position: expected 0 "
                "(or seq_parallel=false)"),
               ("train.compile", t.get("compile"), t.get("compile") not in (False, None),
                "the attention is replaced at run time, which the compiler does not see: expected false"),
               ("train.sample_every", t.get("sample_every"), bool(t.get("sample_every")),
                "samples decode whole sequences: expected 0 (tpctl generate decodes a cp checkpoint with cp=1)"))
    for key, value, bad, why in refused:
        if bad:
            raise ConfigError(key, value, f"with cp={cp}: {why}")
    pieces = 2 * cp if impl == "ring" else cp
    if t.seq_len % pieces:
        raise ConfigError("train.seq_len", t.seq_len, f"cp={cp} context.impl={impl} cuts each sequence into {pieces} "
                          f"equal chunks: expected a multiple of {pieces}")
    if layout.pp > 1 and m.get("arch", "gpt") != "gpt":
        window = declared_window(m)
        if window is not None and window < t.seq_len:
            raise ConfigError("cp", cp, f"with pp={layout.pp}: model.arch={m.arch} attends through a sliding window of "
                              f"{window} positions, shorter than train.seq_len={t.seq_len}, which cp reads from the "
                              "family's masks on whole sequences, a forward pipeline stages do not run: expected "
                              "cp=1 or pp=1")
    if impl == "ulysses" and m.n_head % (geo.head_split * cp):
        raise ConfigError("model.n_head", m.n_head, f"context.impl=ulysses gives each of cp={cp} ranks whole heads of "
                          f"the {m.n_head // geo.head_split} its tensor group holds: expected a multiple of "
                          f"{geo.head_split * cp} (or context.impl=ring)")


def declared_window(m: Any):
    """The sliding window a Hugging Face family's config declares for some
    layer (None: none; its layer_types, where it has them, say which)."""
    from tpctl.models.hf import family_config

    config = family_config(m)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(window, int) or (types is not None and "sliding_attention" not in types):
        return None
    return window


def name_unreplaceable_attention(cfg: Any) -> None:
    """With cp > 1 on a model outside CP_ARCHS: the refusal names the
    attention module (the model built on the meta device, its roles found
    as the rewrite finds them) and why, before check_context's refusal by
    arch (which planners use without building the model)."""
    m = cfg.model
    if cfg.get("cp", 1) <= 1 or m.get("arch") in CP_ARCHS:
        return
    from tpctl.models import build_checked
    from tpctl.parallel.context.split import attention_modules
    from tpctl.parallel.roles.inference import resolve_plan

    model = build_checked(m, cfg.seed)
    try:
        names = attention_modules(resolve_plan(model, m.get("plan")).roles)
    except (ValueError, TypeError, RuntimeError):
        return  # check_model says what tracing found
    if not names:
        raise ConfigError("cp", cfg.cp, f"model.arch={m.get('arch')} has no attention module (no attn_out role) whose "
                          "sequence cp could split: expected cp=1")
    kind = type(model.get_submodule(names[0])).__name__
    raise ConfigError("cp", cfg.cp, f"attention module {names[0]} ({kind}) of model.arch={m.get('arch')} is not one "
                      "context parallelism is proven to replace (causal scaled_dot_product_attention, positions from "
                      "a learned table or a rotary module, as in model.arch " + ", ".join(CP_ARCHS) + "): expected cp=1")


def _check_model_sizes(cfg: Any, layout: Layout, geo: Geometry) -> None:
    """Head and hidden sizes the config states (a built-in or size-keyed
    model); any model is checked module by module too, once built
    (models.check_model)."""
    m = cfg.model
    if m.arch == "custom" or m.get("pretrained"):
        return
    where = f"mode={layout.mode} size={layout.size}"
    for key, heads in (("model.n_head", m.n_head), ("model.n_kv_head", m.get("n_kv_head"))):
        if heads is not None and heads % geo.head_split:
            raise ConfigError(key, heads, f"{where} splits heads {geo.head_split} ways: expected a multiple of {geo.head_split}")
    if m.n_embd % m.n_head:
        raise ConfigError("model.n_embd", m.n_embd, f"expected a multiple of model.n_head={m.n_head}")
    inner = ("model.intermediate_size", m.intermediate_size) if m.get("intermediate_size") else ("model.mlp_ratio", m.n_embd * m.mlp_ratio)
    for key, dim in (("model.n_embd", m.n_embd), inner):
        if dim % geo.hidden_split:
            raise ConfigError(key, m[key.split(".")[1]], f"{where} splits the hidden dim {geo.hidden_split} ways: hidden size {dim} does not divide")


def check_decoding(cfg: Any) -> None:
    """A config only decoded (tpctl generate): one tensor-parallel group
    decoding one token at a time. Its training keys become a batch of the
    rows the mode splits (the prompt, replicated: training/generation.py),
    nothing resumed."""
    if cfg.dp != 1:
        raise ConfigError("dp", cfg.dp, "generate runs one tensor-parallel group: expected dp=1")
    if cfg.pp != 1:
        raise ConfigError("pp", cfg.pp, "generate decodes in one tensor-parallel group, not through pipeline stages: "
                          "expected pp=1 (a checkpoint written with any pp loads into any layout)")
    if cfg.seq_parallel:
        raise ConfigError("seq_parallel", True, "generate decodes one token at a time, which cannot be split along the sequence: expected false")
    if cfg.get("cp", 1) != 1:
        raise ConfigError("cp", cfg.cp, "generate decodes one token at a time, which cannot be split along the sequence: "
                          "expected cp=1 (a checkpoint written with any cp loads into any layout)")
    geo = Layout.from_config(cfg).geo
    cfg.train.batch_size, cfg.train.grad_accum, cfg.train.seq_len, cfg.train.resume = geo.batch_split, 1, 1, None


def largest_grids(cfg: Any, world: int) -> dict[str, Layout]:
    """Mode name -> its layout of `world` ranks with the largest grid that
    `cfg` accepts (the rest data-parallel replicas), for each registered
    mode with one (its first variant of that size): what must hold in every
    mode is tested on these."""
    found: dict[str, Layout] = {}
    for layout in layouts_of(world):  # smallest grids first, a mode's plain variant first
        if layout.mode in found and found[layout.mode].size >= layout.size:
            continue
        try:
            check_layout(cfg, layout)
        except ConfigError:
            continue
        found[layout.mode] = layout
    return found
