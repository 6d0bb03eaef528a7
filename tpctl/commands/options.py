"""The one argument style of the commands that take a config: Hydra-style
`key=value` overrides for the config, plus the command's own `key=value`
options and `--flags`, told apart here (commands without a config use
argparse)."""

from __future__ import annotations

from typing import Any, Callable

from tpctl.errors import ConfigError

Parser = Callable[[str, str], Any]  # (key, text) -> value, or ConfigError


def parse_options(args: list[str], options: dict[str, tuple[Any, Parser]],
                  flags: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """(the command's own values, the config overrides left over).
    `options`: key -> (default, parser); `flags`: `--name` switches, whose
    values are stored under `name`."""
    values = {key: default for key, (default, _) in options.items()}
    values.update({flag.lstrip("-"): False for flag in flags})
    overrides = []
    for arg in args:
        if arg in flags:
            values[arg.lstrip("-")] = True
            continue
        key, eq, text = arg.partition("=")
        if eq and key in options:
            values[key] = options[key][1](key, text)
        else:
            overrides.append(arg)
    return values, overrides


def integer(minimum: int, expected: str) -> Parser:
    """A parser of integers >= minimum; `expected` says what is valid."""
    def parse(key: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(key, text, expected) from None
        if value < minimum:
            raise ConfigError(key, value, expected)
        return value
    return parse


def text(key: str, value: str) -> str:
    return value


def name_list(key: str, value: str) -> list[str]:
    """`[a,b,c]` or `a,b,c`."""
    return [v.strip() for v in value.strip("[]").split(",") if v.strip()]


def refused(why: str) -> Parser:
    """A key the command does not take (a config key that means something
    else here), refused with the reason."""
    def parse(key: str, value: str):
        raise ConfigError(key, value, why)
    return parse
