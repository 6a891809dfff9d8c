"""The `headway` command: every subcommand is listed and explained; user errors are one line."""

from __future__ import annotations

import pytest

from headway.cli import build_parser, main

SUBCOMMANDS = ("train", "export", "eval", "generate", "quickstart", "data")


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("command", [*SUBCOMMANDS, "data inspect"])
def test_every_flag_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([*command.split(), "--help"])
    out = capsys.readouterr().out
    assert "usage: headway" in out
    sub = parser._subparsers._group_actions[0].choices[command.split()[0]]  # type: ignore[union-attr]
    if " " in command:
        sub = sub._subparsers._group_actions[0].choices[command.split()[1]]  # type: ignore[union-attr]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{command} {action.option_strings} has no help"


def test_train_help_explains_every_config_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "train.lr" in out and "data.sources" in out and "target.name" in out


def test_config_error_is_one_line_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["train", "train.lrr=3e-4", "--print-config"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.count("\n") == 0
    assert "did you mean 'train.lr'" in err


def test_print_config_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "train.max_steps=77", "--print-config"]) == 0
    assert "max_steps: 77" in capsys.readouterr().out


def test_unbuilt_subcommand_says_which_issue(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quickstart"]) == 2
    assert "issue #" in capsys.readouterr().err
