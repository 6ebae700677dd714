"""argparse types and actions shared by the scripts' flags."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any


def path_flag(text: str) -> str:
    """A path flag's ``type``: ``~`` expanded (the shell leaves ``--x=~/a`` and quoted paths
    alone), an empty value refused (``--resume "$CKPT"`` with CKPT unset)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a path")
    return os.path.expanduser(text)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except ``None`` ones: their help says what happens instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help or "" if action.default is None else super()._get_help_string(action)


class BoolFlag(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x``, and ``--x False`` as the classic template's users typed it."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs, self.metavar = "?", "BOOL"

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string.startswith("--no-") or values is None:
            return super().__call__(parser, namespace, values, option_string)
        if str(values).lower() not in ("true", "false", "1", "0", "yes", "no"):
            parser.error(f"{option_string} takes no value or one of true/false, not {values!r}")
        setattr(namespace, self.dest, str(values).lower() in ("true", "1", "yes"))


def number(kind: type, low: float, high: float = math.inf, *,
           above: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for ``low <= x <= high`` (``above``: ``low < x``), naming the range."""
    bounds = f"{'above' if above else 'at least'} {low}" + (
        f" and at most {high}" if high < math.inf else "")

    def parse(text: str) -> float:
        value = kind(text)
        if not (math.isfinite(value) and (low < value <= high if above else low <= value <= high)):
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return parse


positive_int = number(int, 1)  # predict.py, plot_results.py
