"""Hugging Face `transformers` causal LMs: GPT-2 and Llama.

`model=hf model.arch=gpt2|llama` builds `GPT2LMHeadModel` /
`LlamaForCausalLM` from the size keys of the model config (random weights,
nothing downloaded); `model.pretrained=DIR` takes the architecture from a
local `save_pretrained` directory and its weights from the safetensors files
there. Either way the model is built with its parameters on the meta device:
each rank makes (or reads) only its own shards.

GPT-2's `Conv1D` is a Linear with its weight stored transposed; it is
replaced by an `nn.Linear` before anything else looks at the model, so every
mode sees plain Linears. `model.tpctl_transposed` names the parameters whose
stored layout is the transpose of the Linear's (reading a checkpoint, and
writing one back, transpose those).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from tpctl.parallel.layers import linearize
from tpctl.schema import HF_ARCHS

from .init import ParamInit, params_on_meta



def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # an optional dependency
        raise ImportError("model=hf needs the `transformers` package: pip install 'tpctl[hf]'") from e


def hf_config(cfg: Any):
    """The transformers config for tpctl's model config `cfg`."""
    _require_transformers()
    if getattr(cfg, "pretrained", None):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.pretrained, local_files_only=True)
        config.use_cache = False
        return config
    inner = getattr(cfg, "intermediate_size", None) or cfg.mlp_ratio * cfg.n_embd
    # No special token ids: the vocabulary may be a byte tokenizer's 256.
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, use_cache=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if cfg.arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head, n_positions=cfg.block_size,
                          n_inner=inner, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                          **common)
    if cfg.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=cfg.n_embd, intermediate_size=inner, num_hidden_layers=cfg.n_layer,
                           num_attention_heads=cfg.n_head, num_key_value_heads=getattr(cfg, "n_kv_head", None) or cfg.n_head,
                           max_position_embeddings=cfg.block_size, attention_bias=cfg.bias, mlp_bias=cfg.bias,
                           attention_dropout=cfg.dropout, **common)
    raise ValueError(f"unknown Hugging Face arch {cfg.arch!r}; expected one of {', '.join(HF_ARCHS)}")


def build_hf(cfg: Any, seed: int, lazy: bool = False) -> nn.Module:
    """A transformers causal LM for `cfg`, parameters on the meta device
    with their source attached as `model.tpctl_init` (materialised unless
    lazy): the pretrained files if `cfg.pretrained`, else seeded init."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    linearize(model)
    if getattr(cfg, "pretrained", None):
        from .pretrained import SafetensorsSource

        model.tpctl_init = SafetensorsSource(model, Path(cfg.pretrained))
    else:
        model.tpctl_init = ParamInit(model, seed, _init_std(config))
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




def save_hf(cfg: Any, tensors: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """Write full (unsharded) weights of a tpctl-trained Hugging Face model,
    keyed by its parameter names, as a directory `from_pretrained` loads:
    config.json and safetensors, Conv1D weights transposed back."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    transposed = {f"{name}.weight" for name, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    seen: dict[int, str] = {}
    tied = set()  # names of a parameter shared with an earlier name (the LM head's weight)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    state = {name: (t.t() if name in transposed else t).contiguous() for name, t in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if set(missing) - tied or unexpected:
        raise ValueError(f"the weights do not match {type(model).__name__}: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

