"""Hugging Face `transformers` causal LMs, any family.

`model=hf model.arch=<model_type>` builds the family `transformers`
registers as a causal LM under that model_type (`AutoModelForCausalLM`)
from tpctl's size keys (random weights, nothing downloaded);
`model.pretrained=DIR` takes the family and its config from a local
`save_pretrained` directory and its weights from the safetensors files
there (models/pretrained.py). Either way the model is built with its
parameters on the meta device: each rank makes (or reads) only its own
shards.

**Size keys onto a family's config.** Each tpctl key names a standard
`transformers` setting (`n_embd` is `hidden_size`, `n_layer`
`num_hidden_layers`, ...); a family that calls it otherwise says so in its
config class's `attribute_map` (GPT-2: `hidden_size` -> `n_embd`), which the
config's own constructor applies. A few settings have no standard name and
go by the names families use for them (the MLP width: `intermediate_size`,
`n_inner`, `ffn_dim`, `ffn_hidden_size`; key/value heads:
`num_key_value_heads`, `num_kv_heads`): the first one the family has is
set. Everything else keeps the family's default, and `model.config` passes
any of the family's own settings through (`+model.config.rope_theta=1e6`).

GPT-2's `Conv1D` is a Linear with its weight stored transposed; it is
replaced by an `nn.Linear` before anything else looks at the model, so every
mode sees plain Linears. `model.tpctl_transposed` names the parameters whose
stored layout is the transpose of the Linear's (reading a checkpoint, and
writing one back, transpose those).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from tpctl.errors import ConfigError
from tpctl.parallel.roles.probes import _probe_copy, linearize
from tpctl.schema import ARCHS
from tpctl.seeding import derive_seed

from .init import ParamInit, params_on_meta

# tpctl size key -> the transformers settings it means, the standard name
# first; the first one a family has (directly or through its
# attribute_map) is set.
SIZE_KEYS = {
    "vocab_size": ("vocab_size",),
    "n_embd": ("hidden_size",),
    "n_layer": ("num_hidden_layers",),
    "n_head": ("num_attention_heads",),
    "n_kv_head": ("num_key_value_heads", "num_kv_heads"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "block_size": ("max_position_embeddings",),
    "tie_embeddings": ("tie_word_embeddings",),
}


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # an optional dependency
        raise ImportError("model=hf needs the `transformers` package: pip install 'tpctl[hf]'") from e


def causal_lm_types() -> tuple[str, ...]:
    """Every model_type transformers builds as a causal LM."""
    _require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def check_arch(arch: str, ours: bool = True) -> None:
    """ConfigError unless `arch` is a model_type transformers builds as a
    causal LM (`ours`: tpctl's own architectures are named as valid too)."""
    import difflib

    types = causal_lm_types()
    if arch not in types:
        close = difflib.get_close_matches(arch, (*ARCHS, *types) if ours else types, n=2)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError("model.arch", arch, f"expected {', '.join(ARCHS) + ' or ' if ours else ''}a model_type "
                          f"transformers builds as a causal LM{hint}; the {len(types)} it builds: {', '.join(types)}")


def _settings(cls) -> set[str]:
    """The names a config class takes: its fields and its attribute_map's."""
    return {f.name for f in dataclasses.fields(cls)} | set(cls.attribute_map)


def _first(cls, names) -> Optional[str]:
    known = _settings(cls)
    return next((n for n in names if n in known), None)


def family_config(cfg: Any):
    """The transformers config of tpctl's model config `cfg`, as the family
    writes it (a pretrained directory's config.json unchanged but for
    `model.config`)."""
    _require_transformers()
    from transformers import AutoConfig

    if getattr(cfg, "pretrained", None):
        stored = AutoConfig.from_pretrained(cfg.pretrained, local_files_only=True)
        cls, kwargs = type(stored), stored.to_dict()
    else:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        check_arch(cfg.arch)
        cls = CONFIG_MAPPING[cfg.arch]
        kwargs = _size_settings(cls, cfg)
        stored = None
    passed = _plain(getattr(cfg, "config", None) or {})
    if stored is not None and not passed:
        return stored
    try:
        # Built anew, so that what the family derives (layer types from the
        # depth, rope parameters from a legacy rope_theta) follows.
        config = cls(**{**kwargs, **passed})
    except Exception as e:  # the family's own validation (strict types, head divisibility, its own rules)
        first = str(e).strip().splitlines()
        raise ConfigError("model", cfg.get("pretrained") or cfg.arch,
                          f"{cls.__name__} refuses these settings: {' '.join(line.strip() for line in first[:2])}") from None
    _check_required(config, cfg.get("pretrained") or cfg.arch)
    known = _settings(cls)
    for key, value in passed.items():
        # A key the family neither declares nor consumes (a legacy name it
        # converts) would only sit on the config unread: a typo.
        if key not in known and hasattr(config, key):
            raise ConfigError(f"model.config.{key}", value, f"not a setting of {cls.__name__}: expected one of "
                              f"{', '.join(sorted(known))}")
    return config


def _plain(settings) -> dict:
    """`model.config` as plain dicts and lists: transformers' typed config
    fields refuse OmegaConf's containers (`+model.config.layer_types=[...]`,
    a sub-config such as `vision_config={...}`: "expected a list, got
    ListConfig")."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(settings, resolve=True) if OmegaConf.is_config(settings) else dict(settings)


def _size_settings(cls, cfg: Any) -> dict:
    """Constructor settings of config class `cls` for tpctl's size keys."""
    inner = cfg.intermediate_size or cfg.mlp_ratio * cfg.n_embd
    wanted = {"vocab_size": cfg.vocab_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
              # Without n_kv_head every query head has its own key/value head.
              "n_kv_head": cfg.n_kv_head or cfg.n_head, "intermediate_size": inner, "block_size": cfg.block_size,
              "tie_embeddings": cfg.tie_embeddings}
    # Keys whose value the user chose: a family without the setting refuses them.
    explicit = {"n_kv_head": cfg.n_kv_head is not None, "intermediate_size": cfg.intermediate_size is not None}
    out = {}
    for key, value in wanted.items():
        name = _first(cls, SIZE_KEYS[key])
        if name is not None:
            out[name] = value
        elif explicit.get(key):
            raise ConfigError(f"model.{key}", value, f"{cls.__name__} has no setting for it (none of "
                              f"{', '.join(SIZE_KEYS[key])}): set the family's own with +model.config.KEY=VALUE")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if "head_dim" in fields:  # families that store it (Gemma's default is 256 whatever the width)
        out["head_dim"] = cfg.n_embd // cfg.n_head
    _head_parts(fields, cls, cfg, out)
    for name, f in fields.items():
        default = _default(f)
        # (BERT's families name theirs hidden_dropout_prob, attention_probs_dropout_prob)
        if isinstance(default, float) and not isinstance(default, bool) \
                and name.endswith(("dropout", "pdrop", "dropout_prob")):
            out[name] = float(cfg.dropout)
    if cfg.bias is not None:
        names = [n for n, f in fields.items() if isinstance(_default(f), bool) and (n == "bias" or n.endswith("_bias"))]
        if not names:
            raise ConfigError("model.bias", cfg.bias, f"{cls.__name__} has no bias setting (bias or *_bias): "
                              "expected null (the family's default), or the family's own with +model.config.KEY=VALUE")
        out.update({n: bool(cfg.bias) for n in names})
    # A special token id the vocabulary does not have (GPT-2's 50256 in a
    # byte tokenizer's 256) is dropped; one it has stays (a family may need
    # its padding id).
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        f = fields.get(name)
        default = _default(f) if f is not None else None
        ids = default if isinstance(default, (list, tuple)) else [default]
        if any(isinstance(i, int) and i >= cfg.vocab_size for i in ids) and "None" in str(f.type):
            out[name] = None
    return out


def _head_parts(fields: dict, cls, cfg: Any, out: dict) -> None:
    """Settings sized for the family's default heads that the size keys'
    smaller heads cannot hold, and choices left open that the forward needs
    made (written into `out`)."""
    head = cfg.n_embd // cfg.n_head
    rotary = _default(fields["rotary_dim"]) if "rotary_dim" in fields else None
    if isinstance(rotary, int) and rotary > head:
        # The rotary part of a head (GPT-J, CodeGen: 64 of a 256-wide head
        # by default) keeps its share of the head, in whole pairs: a part
        # wider than the head fails in the forward.
        family = cls()  # its default widths (attribute_map read through)
        default_head = family.hidden_size // family.num_attention_heads
        out["rotary_dim"] = min(head, max(2, 2 * round(rotary * head / default_head / 2)))
    languages = _default(fields["languages"]) if "languages" in fields else None
    if "default_language" in fields and _default(fields["default_language"]) is None and languages \
            and len(languages) == 1:
        # X-MOD's adapters: one language, so the input's is known (unset, its forward refuses every input).
        out["default_language"] = languages[0]


def _check_required(config, name: str) -> None:
    """ConfigError when a setting the family's forward needs is left None
    by its defaults (DeepSeek-V2's experts per token: its router's top-k)."""
    if getattr(config, "num_experts_per_tok", 0) is None and (getattr(config, "n_routed_experts", 0) or 0) > 0:
        raise ConfigError("model", name, f"{type(config).__name__} leaves num_experts_per_tok (its router's top-k) "
                          "unset: set it with +model.config.num_experts_per_tok=K")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def hf_config(cfg: Any):
    """The config tpctl builds the model with: the family's, with the
    key/value cache off (training, tracing and the start-up check run whole
    sequences; decoding passes its cache explicitly)."""
    config = family_config(cfg)
    config.use_cache = False
    return config


def build_hf(cfg: Any, seed: int, lazy: bool = False) -> nn.Module:
    """A transformers causal LM for `cfg`, parameters on the meta device
    with their source attached as `model.tpctl_init` (materialised unless
    lazy): the pretrained files if `cfg.pretrained`, else seeded init."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg)
    with params_on_meta():
        # fp32 whatever the stored dtype: the parameters are the optimizer's
        # master weights (precision=bf16 computes in bf16 under autocast).
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    linearize(model)
    if getattr(cfg, "pretrained", None):
        from .pretrained import SafetensorsSource

        model.tpctl_init = SafetensorsSource(model, Path(cfg.pretrained))
    else:
        model.tpctl_init = ParamInit(model, seed, _init_std(config), fallback=_family_init(model, seed))
    if not lazy:
        model.tpctl_init.materialize(model)
    return model


def _init_std(config) -> callable:
    """The transformers init: N(0, initializer_range) for weights; GPT-2
    scales the projections into the residual stream by 1/sqrt(2 n_layer)."""
    std = getattr(config, "initializer_range", 0.02)
    if config.model_type == "gpt2":
        scaled = std / math.sqrt(2 * config.n_layer)
        return lambda name: scaled if name.endswith("c_proj.weight") else std
    return lambda name: std


def _family_init(model: nn.Module, seed: int):
    """A parameter tpctl has no rule for (a mixture of experts' stacked
    weights, a learned scale) gets the family's own `_init_weights` of its
    module, run on a copy with the global generator seeded by (seed, name);
    where that leaves it unset, the value its constructor gave it (as
    `from_config` would keep it)."""
    def init(name: str, module: nn.Module, attr: str) -> torch.Tensor:
        # Its own parameters only, NaN until set: the submodules stay on meta.
        owner = _probe_copy(module, lambda _, shape: torch.full(shape, float("nan")))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, name))
            model._init_weights(owner)
        value = getattr(owner, attr).detach()
        if torch.isfinite(value).all():
            return value.clone()
        constructed = getattr(getattr(module, attr), "tpctl_constructed", None)
        if constructed is not None and torch.isfinite(constructed).all():
            return constructed.clone()
        raise ValueError(f"no initial value rule for {name} ({type(module).__name__}.{attr}): "
                         f"{type(model).__name__}._init_weights leaves it unset")
    return init


def save_hf(cfg: Any, tensors: dict[str, torch.Tensor], out_dir: Path, tokenizer: Optional[str] = None) -> Path:
    """Write full (unsharded) weights of a tpctl-trained Hugging Face model,
    keyed by its parameter names, as a directory `from_pretrained` loads:
    config.json (the family's, as the run built it), safetensors under the
    names the family stores (transformers' own save_pretrained reverses its
    load-time renames and conversions), Conv1D weights transposed back, a
    tied parameter once; and the run's tokenizer."""
    from transformers import AutoModelForCausalLM

    config = family_config(cfg)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if getattr(cfg, "pretrained", None):
        from .pretrained import SafetensorsSource

        SafetensorsSource(model, Path(cfg.pretrained))  # the stored buffers, as training had them
    transposed = {f"{name}.weight" for name, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    seen: dict[int, str] = {}
    tied = set()  # names of a parameter shared with an earlier name (the LM head's weight)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    buffers = {name for name, _ in model.named_buffers()}  # not trained: the model's own
    state = {name: (t.t() if name in transposed else t).contiguous() for name, t in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if set(missing) - tied - buffers or unexpected:
        raise ValueError(f"the weights do not match {type(model).__name__}: missing {sorted(set(missing) - tied - buffers)}, "
                         f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(out_dir)
    return out_dir
