"""The wording of a refusal: one line naming what is wrong and what would
be valid, shared by composition and validation."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

from omegaconf import DictConfig

from tpctl.errors import ConfigError


def check_choice(key: str, value: Any, valid: Iterable[str]) -> None:
    if value not in valid:
        raise ConfigError(key, value, f"expected one of {', '.join(valid)}" + did_you_mean(str(value), valid))


def check_at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(key, value, f"expected a value >= {low}")


def check_integer(key: str, value: Any) -> None:
    """An integer as written: an untyped mapping (a manifest, a plan's
    config) may hold a string, a float or a bool, which `<` and `%` would
    take for a number."""
    if type(value) is not int:
        raise ConfigError(key, value, "expected an integer")


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, [str(c) for c in candidates], n=2)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def valid_keys_hint(word: str, keys: Iterable[Any], prefix: str) -> str:
    keys = [str(k) for k in keys]
    where = f"under {prefix.rstrip('.')!r}" if prefix else "at the top level"
    return f"unknown key; valid keys {where}: {', '.join(keys)}" + did_you_mean(word, keys)


def expected_type(key: str, reference: DictConfig) -> str:
    from omegaconf import BooleanNode, FloatNode, IntegerNode, StringNode

    node = reference._get_node(key.split(".")[0])
    for part in key.split(".")[1:]:
        node = node._get_node(part) if isinstance(node, DictConfig) else None
    kinds = {IntegerNode: "an integer", FloatNode: "a number", BooleanNode: "true or false", StringNode: "a string"}
    for cls, what in kinds.items():
        if isinstance(node, cls):
            return f"expected {what}" + (" or null" if node._is_optional() else "")
    if isinstance(node, DictConfig):
        return f"expected a group of keys ({', '.join(str(k) for k in node.keys())}); set one with {key}.<name>=<value>"
    return "the value has the wrong type"


def one_line(error: BaseException | str) -> str:
    """Hydra's messages span lines (and end with the search path): keep the gist."""
    text = str(error).split("\nConfig search path")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(("full_key:", "object_type=", "reference_type="))]
    return "; ".join(lines)
