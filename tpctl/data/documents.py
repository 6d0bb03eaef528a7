"""`data.documents=true`: the documents of a prepared corpus kept apart in
training (no attention across a boundary, positions restarting at each
document; parallel/context/documents.py computes them from the ids).

`tpctl prepare-data` ends every document with the tokenizer's separator and
records it as `eos_id` in the corpus's index.json: that is what marks the
boundaries. A corpus without a record of them (the default corpus, a text
or .bin file, synthetic tokens) is refused, as is a model whose attention
cannot take the documents' mask, and a feature that would run the blocks
outside the forward that set the documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from tpctl.errors import ConfigError

from . import DataError
from .shards import read_index

KEY = "data.documents"


def enabled(cfg: Any) -> bool:
    return bool(cfg.data.get("documents", False))


def _corpora(cfg: Any) -> list[tuple[str, str]]:
    """(key, path) of every corpus the run reads."""
    from .mix import mix_entries

    entries = mix_entries(cfg.data)
    if entries:
        return [(f"data.mix[{i}].path", e.path) for i, e in enumerate(entries)]
    return [("data.path", cfg.data.path)]


def _eos_of(key: str, path: Optional[str]) -> int:
    """The separator of the prepared corpus at `path`, or ConfigError naming
    data.documents and why the corpus has no boundaries."""
    no = "needs a corpus prepared by `tpctl prepare-data` (its index.json records the documents' separator, eos_id)"
    if path is None:
        raise ConfigError(KEY, True, f"{no}; data.path is the default corpus, which has no document boundaries")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(KEY, True, f"{no}; {key}={path} is a token or text file, which has no document boundaries")
    try:
        eos = read_index(p).get("eos_id")
    except DataError as e:
        raise ConfigError(key, path, str(e)) from None
    if eos is None:
        raise ConfigError(KEY, True, f"{no}; {key}={path}'s index.json has no eos_id: prepare it again")
    return int(eos)


def separator(cfg: Any) -> Optional[int]:
    """The documents' separator id of the run's corpus (None: data.documents
    is off). The corpora of a mix must share it."""
    if not enabled(cfg):
        return None
    found = {key: _eos_of(key, path) for key, path in _corpora(cfg)}
    if len(set(found.values())) > 1:
        raise ConfigError(KEY, True, "the corpora of data.mix separate documents by different ids "
                          f"({', '.join(f'{k}: {v}' for k, v in found.items())}): prepare them with one tokenizer")
    return next(iter(found.values()))


# The Hugging Face families whose documents are proven kept apart as
# tpctl's GPT keeps them (tests/test_documents_hf.py): causal attention by
# torch's scaled_dot_product_attention, positions from a rotary module fed
# position ids (parallel/context/documents.py, install_hf). A family
# outside it may take positions from a learned table (GPT-2, OPT), bias
# its attention (ALiBi: Bloom, Falcon), mix tokens by a recurrence (Mamba,
# hybrids) or call attention otherwise.
HF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
ARCHS = ("gpt", *HF_ARCHS)


def _check_model(cfg: Any) -> None:
    """A model that keeps documents apart: tpctl's GPT, or a family of
    HF_ARCHS (a sliding window is cut into the documents' mask,
    parallel/context/documents.py, and into cp's chunk masks,
    context/attention.py)."""
    m = cfg.model
    arch = m.get("arch", "gpt")
    if arch == "gpt":
        return
    if m.get("pretrained"):
        from tpctl.models.hf import family_config

        arch = family_config(m).model_type
    if arch not in HF_ARCHS:
        raise ConfigError(KEY, True, f"model.arch={arch} is not a model whose attention and positions the documents "
                          "are proven to reach (causal scaled_dot_product_attention, positions from tpctl's GPT's "
                          "table or a rotary module; not a learned table of Hugging Face's, ALiBi, a recurrence): "
                          f"expected model.arch in {', '.join(ARCHS)}")


def check_documents(cfg: Any) -> None:
    """data.documents: a bool, a corpus that records its boundaries, and a
    run that can keep them exactly (one ConfigError line otherwise)."""
    value = cfg.data.get("documents", False)
    if not isinstance(value, bool):
        raise ConfigError(KEY, value, "expected true or false")
    if not value:
        return
    if cfg.data.name != "text":
        raise ConfigError(KEY, True, f"data.name={cfg.data.name} has no document boundaries: expected data.name=text "
                          "with a corpus prepared by `tpctl prepare-data`")
    _check_model(cfg)
    if cfg.train.get("activation_checkpointing", False):
        raise ConfigError(KEY, True, "train.activation_checkpointing=true recomputes blocks outside the forward "
                          "that holds the documents: expected train.activation_checkpointing=false")
    if str(cfg.train.get("compile", False)).lower() not in ("false", "0"):
        raise ConfigError(KEY, True, f"train.compile={cfg.train.compile}: the compiled forward would fix one "
                          "window's documents: expected train.compile=false")
    separator(cfg)
