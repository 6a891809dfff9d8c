"""Command-line values checked where they enter: argparse ``type=`` functions.

A bad value stops the command before anything loads, in one line naming the flag, the value and
what is accepted (``headway generate: error: argument --max-new-tokens: -3 is not an integer >=
1``), with exit status 2 — never a ``ValueError`` from deep inside a run.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block) and exit with 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer in ``[minimum, maximum]`` (no upper bound if ``maximum`` is None)."""
    accepted = (
        f"an integer >= {minimum}"
        if maximum is None
        else (f"an integer from {minimum} to {maximum}")
    )

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text} is not {accepted}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def number(
    minimum: float, maximum: float | None = None, *, above: bool = False
) -> Callable[[str], float]:
    """A finite number ``>= minimum`` (``> minimum`` if ``above``), at most ``maximum``."""
    lower = f"> {minimum:g}" if above else f">= {minimum:g}"
    accepted = f"a finite number {lower}" + (f" and <= {maximum:g}" if maximum is not None else "")

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}") from None
        low = value <= minimum if above else value < minimum
        if not math.isfinite(value) or low or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text} is not {accepted}")
        return value

    parse.__name__ = "float"
    return parse


def text(what: str) -> Callable[[str], str]:
    """A non-empty value that does not look like a flag (``--out --seed`` forgot a value), and
    holds no NUL byte (no path can; a shell never passes one, ``main(argv)`` from Python can)."""

    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{what} is empty")
        if "\x00" in value:
            raise argparse.ArgumentTypeError(f"{what} contains a NUL byte")
        return value

    parse.__name__ = "str"
    return parse


def layer_list(text: str) -> list[int]:
    """Comma-separated, distinct, non-negative layer indices (``2,15,27``); the upper bound (the
    target's depth) is checked once the target is loaded."""
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of layer indices (e.g. 2,15,27)"
        ) from None
    if any(layer < 0 for layer in layers) or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(
            f"{text} must list distinct layer indices >= 0 (0 = embeddings, L = the last layer)"
        )
    return layers


layer_list.__name__ = "layers"

POSITIVE = integer(1)
NON_NEGATIVE = integer(0)
SEED = integer(0, 2**63 - 1)
TEMPERATURE = number(0.0, 100.0)
TOP_P = number(0.0, 1.0, above=True)


def add_recipe_arguments(parser: argparse.ArgumentParser, *, what: str, example: str) -> None:
    """``--config RECIPE`` (required) and ``SECTION.KEY=VALUE`` overrides, read as ``headway
    train`` reads them; ``what`` says what the recipe is for, ``example`` names overrides."""
    parser.add_argument(
        "--config",
        required=True,
        type=text("--config"),
        help=f"the YAML recipe {what} (read as `headway train` reads it: unknown keys are refused)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="SECTION.KEY=VALUE",
        help=f"override a recipe value, as for `headway train` (e.g. {example})",
    )
