"""Command-line values are checked at the boundary (issue #17): any value given to a numeric
flag either runs or stops with one line naming the flag, exit status 2 — never a traceback.

The hypothesis test walks the real parser, so a flag added later is covered as soon as it has a
type; commands run against a target folder that does not exist, so a value that passes the
parser fails fast at load (also one line) instead of starting real work.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headway.cli import build_parser, main
from headway.cli.values import (
    NON_NEGATIVE,
    POSITIVE,
    SEED,
    TEMPERATURE,
    TOP_P,
    integer,
    number,
    text,
)

# Commands whose every run here must end fast: (argv prefix, arguments that make it fail at load).
COMMANDS: dict[tuple[str, ...], list[str]] = {
    ("data", "regenerate"): ["--out", "{tmp}/out", "--target", "{tmp}/no-such-model"],
    ("data", "inspect"): ["--target", "{tmp}/no-such-model"],
    ("data", "cache-features"): ["--out", "{tmp}/out", "--target", "{tmp}/no-such-model"],
    ("generate",): ["--target", "{tmp}/no-such-model", "hello"],
    ("export",): ["{tmp}/no-such-run", "--format", "eagle3-hf", "--out", "{tmp}/x"],
    ("eval",): [
        "--target",
        "{tmp}/no-such-model",
        "--drafter",
        "prompt-lookup",
        "--out",
        "{tmp}/e",
    ],
}

WEIRD = st.sampled_from(
    [
        "-3",
        "0",
        "1",
        "-1",
        "nan",
        "inf",
        "-inf",
        "1e309",
        "",
        " ",
        "--seed",
        "3.5",
        "0x10",
        "99999999999999999999999",
        "1_000",
        "½",
        "None",
    ]
) | st.text(max_size=6)


def typed_flags(command: tuple[str, ...]) -> list[str]:
    """The flags of `command` that take a value checked by a ``type=`` function."""
    parser: argparse.ArgumentParser = build_parser()
    for name in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return [
        action.option_strings[-1]
        for action in parser._actions
        if action.option_strings and action.type is not None and action.nargs is None
    ]


def test_every_numeric_flag_of_these_commands_is_typed() -> None:
    for command in COMMANDS:
        assert len(typed_flags(command)) >= (1 if command == ("export",) else 2), command
    assert "--threads" in typed_flags(("quickstart",))


def test_malformed_command_lines_of_the_review_are_one_line_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The two command lines that ended in tracebacks (issue #17), and their kin."""
    for argv in (
        ["generate", "--max-new-tokens", "-3", "hi"],
        ["generate", "--temperature", "-1", "hi"],
        ["generate", "--top-p", "nan", "hi"],
        ["eval", "--drafter", "prompt-lookup", "--num-prompts", "0"],
        ["quickstart", "--threads", "-2"],
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error: argument" in err[0], (argv, err)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_value_runs_or_fails_in_one_line(
    data: st.DataObject, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = data.draw(st.sampled_from(sorted(COMMANDS)))
    flag = data.draw(st.sampled_from(typed_flags(command)))
    value = data.draw(WEIRD)
    base = [arg.format(tmp=tmp_path) for arg in COMMANDS[command]]
    try:
        status = main([*command, *base, flag, value])
    except SystemExit as stop:  # argparse refused the value
        status = stop.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, (command, flag, value)
    assert len(err) == 1 and err[0].startswith("headway"), err


@pytest.mark.parametrize(
    ("parse", "good", "bad"),
    [
        (POSITIVE, {"1": 1, " 7 ": 7}, ["0", "-3", "1.5", "x", ""]),
        (NON_NEGATIVE, {"0": 0}, ["-1"]),
        (SEED, {"0": 0}, ["-1", str(2**63)]),
        (integer(2, 8), {"2": 2, "8": 8}, ["1", "9"]),
        (TEMPERATURE, {"0": 0.0, "0.7": 0.7}, ["-1", "nan", "inf", "1e309", "101"]),
        (TOP_P, {"1": 1.0, "0.5": 0.5}, ["0", "1.01", "nan"]),
        (number(0, above=True), {"1e-9": 1e-9}, ["0", "-inf"]),
    ],
)
def test_value_types(parse: object, good: dict[str, object], bad: list[str]) -> None:
    for value, expected in good.items():
        assert parse(value) == expected  # type: ignore[operator]
    for value in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(value)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "distinct layer indices >= 0"),
        ("2,2", "distinct layer indices >= 0"),
        ("a,b", "not a comma-separated list of layer indices"),
    ],
)
def test_cache_features_layers_are_checked_before_loading_anything(
    value: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from headway.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["data", "cache-features", "--out", str(tmp_path / "f"), "--layers", value])
    assert caught.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error
    assert not (tmp_path / "f").exists()


MALFORMED = [
    "generate --max-new-tokens -3 hi",
    "generate --temperature -1 hi",
    "generate --temperature nan hi",
    "generate --top-p 2 hi",
    "generate --draft-length 0 hi",
    "generate --sizing sideways hi",
    "generate --stop= hi",
    "generate --target {tmp}/no/such/folder hi",
    "generate --device cuda:x hi",
    "eval --num-prompts 0 --drafter prompt-lookup",
    "eval --max-new-tokens -1 --drafter prompt-lookup",
    "eval --drafter prompt-lookup --out=",
    "export {tmp}/no-such-run --format eagle3-hf --out {tmp}/x",
    "export {tmp}/run --format nope --out {tmp}/x",
    "export {tmp}/run --format eagle3-hf --out=",
    "export {tmp}/run --format medusa2-target --dtype bfloat16 --out {tmp}/x",
    "train --config {tmp}/no-such.yaml",
    "train train.lr=-1",
    "train train.max_stepz=3",
    "data regenerate --mix sharegpt:-5 --out {tmp}/r",
    "data regenerate --mix nothing:5 --out {tmp}/r",
    "data cache-features --out {tmp}/f --layers -1",
    "data cache-features --out {tmp}/f --layers x",
    "quickstart --out=",
    "quickstart --threads -2",
]


@pytest.mark.parametrize("line", MALFORMED)
def test_malformed_command_lines_are_one_line_errors(
    line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Command lines a user could type by mistake: each stops with exit status 2 and one line
    on stderr naming what is wrong, before any model is loaded."""
    argv = line.format(tmp=tmp_path).split()
    try:
        status = main(argv)
    except SystemExit as stop:
        status = stop.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, argv
    assert len(err) == 1 and err[0].startswith("headway") and "Traceback" not in err[0], err


def test_text_values_refuse_empty_and_nul() -> None:
    parse = text("--out")
    assert parse("runs/x") == "runs/x"
    for bad, message in (("  ", "--out is empty"), ("a\x00b", "--out contains a NUL byte")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(bad)
