"""`data.order` and `data.mix` read from a config and checked: each bad
value one `ConfigError` line (exit 2) before any worker starts.

`data.mix` is a list whose entries are ``{path: P, weight: W}`` or the
compact ``P:W``; both parse from the command line as Hydra overrides::

    data.mix=[a.txt:0.7,data/corpus:0.3]
    'data.mix=[{path: a.txt, weight: 0.7}, {path: data/corpus, weight: 0.3}]'

Weights are read as the exact decimals written (0.7 is 7/10), so the
schedule of a mix (order.MixSchedule) is exact and short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from tpctl.errors import ConfigError

from .order import MAX_PERIOD, ORDERS, MixSchedule

EXAMPLE = "e.g. data.mix=[a.txt:0.7,data/corpus:0.3] or data.mix=[{path: a.txt, weight: 0.7}, ...]"


@dataclass(frozen=True)
class MixEntry:
    path: str
    weight: Fraction
    written: str  # the weight as given, for summaries and logs


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _weight(key: str, entry: Any, weight: Any) -> tuple[Fraction, str]:
    if isinstance(weight, bool) or not isinstance(weight, (int, float, str)):
        raise ConfigError(key, entry, f"the weight must be a positive number; {EXAMPLE}")
    try:
        exact = Fraction(str(weight).strip())
    except (ValueError, ZeroDivisionError):
        raise ConfigError(key, entry, f"the weight {weight!r} is not a number; {EXAMPLE}") from None
    if isinstance(weight, float) and not math.isfinite(weight) or exact <= 0:
        raise ConfigError(key, entry, f"the weight must be a positive number, not {weight!r}")
    return exact, str(weight).strip()


def _entry(i: int, entry: Any) -> MixEntry:
    key = f"data.mix[{i}]"
    if isinstance(entry, str):
        path, sep, weight = entry.rpartition(":")
        if not sep or not path:
            raise ConfigError(key, entry, f"expected PATH:WEIGHT; {EXAMPLE}")
        exact, written = _weight(key, entry, weight)
        return MixEntry(path, exact, written)
    if not isinstance(entry, dict):
        raise ConfigError(key, entry, f"expected {{path: P, weight: W}} or P:W; {EXAMPLE}")
    unknown = sorted(set(entry) - {"path", "weight"})
    if unknown:
        raise ConfigError(key, entry, f"unknown key {unknown[0]!r}: an entry has path and weight")
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(key, entry, f"an entry needs a path (a text file, a .bin or a prepared directory); {EXAMPLE}")
    if "weight" not in entry:
        raise ConfigError(key, entry, f"an entry needs a weight (a positive number); {EXAMPLE}")
    exact, written = _weight(key, entry, entry["weight"])
    return MixEntry(path, exact, written)


def mix_entries(data: Any) -> list[MixEntry]:
    """The entries of `data.mix` (none: no mix), checked for their form."""
    mix = _plain(data.get("mix"))
    if mix is None or mix == []:
        return []
    if not isinstance(mix, list):
        raise ConfigError("data.mix", mix, f"expected a list of corpora with weights; {EXAMPLE}")
    return [_entry(i, e) for i, e in enumerate(mix)]


def check_data_keys(cfg: Any) -> None:
    """data.order and data.mix: their values, and a mix against the other
    data keys and the files it names."""
    d = cfg.data
    order = d.get("order", "epoch")
    if order not in ORDERS:
        import difflib  # (config.messages' did_you_mean: config is a layer above data)

        close = difflib.get_close_matches(str(order), ORDERS, n=1)
        raise ConfigError("data.order", order, f"expected one of {', '.join(ORDERS)}"
                          + (f" (did you mean {close[0]!r}?)" if close else ""))
    entries = mix_entries(d)
    if entries:
        _check_mix(d, entries)


def _check_mix(d: Any, entries: list) -> None:
    mix = _plain(d.mix)
    if d.name != "text":
        raise ConfigError("data.mix", mix, f"a mix reads files: expected data.name=text (it is {d.name})")
    if d.path is not None:
        raise ConfigError("data.mix", mix, f"data.path={d.path} is set too: leave data.path unset with data.mix "
                          "(each entry names its corpus)")
    for i, e in enumerate(entries):
        p = Path(e.path).expanduser()
        if not p.exists():
            raise ConfigError(f"data.mix[{i}].path", e.path, "no such file")
        if p.is_dir() and not (p / "index.json").is_file():
            raise ConfigError(f"data.mix[{i}].path", e.path, "a directory without index.json: expected a UTF-8 text "
                              "file, a .bin file of token ids, or a directory written by `tpctl prepare-data`")
    try:
        MixSchedule([e.weight for e in entries])
    except ValueError as err:
        raise ConfigError("data.mix", mix, f"{err}: round the weights (e.g. to 3 decimals)") from None


def schedule_of(data: Any) -> MixSchedule:
    return MixSchedule([e.weight for e in mix_entries(data)])


__all__ = ["MixEntry", "mix_entries", "check_data_keys", "schedule_of", "MAX_PERIOD"]
