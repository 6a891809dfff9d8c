"""The `headway` command: every subcommand is listed and explained; user errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headway.cli import build_parser, main
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

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
    sub = parser._subparsers._group_actions[0].choices[command.split()[0]]  # type: ignore[union-attr, index]
    if " " in command:
        sub = sub._subparsers._group_actions[0].choices[command.split()[1]]
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


def test_train_export_generate_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole CLI path on a tiny target: train Medusa heads, export both layouts, decode
    with the heads, and get exactly the plain-decoding output."""
    target = tmp_path / "target"
    tiny_model("llama", vocab_size=400).save_pretrained(target)
    smollm2_tokenizer().save_pretrained(target)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"hi {i}"},
                {"role": "assistant", "content": "Hello! How can I help you today?"},
            ]
        }
        for i in range(12)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    run = tmp_path / "run"
    overrides = [
        f"target.name={target}",
        "target.device=cpu",
        f"data.sources={data}",
        "data.max_length=48",
        f"train.output_dir={run}",
        "train.max_steps=4",
        "train.warmup_steps=1",
        "train.batch_size=4",
        "medusa.num_heads=2",
    ]
    assert main(["train", *overrides]) == 0
    for layout in ("medusa", "medusa-vllm"):
        assert main(["export", str(run), "--format", layout, "--out", str(tmp_path / layout)]) == 0
    assert (tmp_path / "medusa" / "medusa_lm_head.safetensors").is_file()
    assert (tmp_path / "medusa-vllm" / "model.safetensors").is_file()
    capsys.readouterr()
    common = ["generate", "--target", str(target), "--device", "cpu", "--chat", "--json"]
    common += ["--max-new-tokens", "12", "hello there"]
    assert main([*common, "--heads", str(run)]) == 0
    with_heads = json.loads(capsys.readouterr().out)
    assert main([*common, "--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert with_heads["token_ids"] == plain["token_ids"]
    assert sum(with_heads["accept_lengths"]) == len(with_heads["token_ids"])
    for key in ("text", "tau", "tokens_per_s"):
        assert key in with_heads
    lookup = [*common, "--drafter", "prompt-lookup", "--draft-option", "min_ngram=1"]
    assert main([*lookup, "--draft-option", "max_nodes=2"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    for choice in ("stock", "transposed"):  # either product, the same output
        assert main([*common, "--heads", str(run), "--gemm", choice]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    for layout in ("medusa", "medusa-vllm"):  # every export decodes through the CLI, losslessly
        assert main([*common, "--heads", str(tmp_path / layout)]) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"], layout
    published = tmp_path / "published"  # reference heads as a .pt file, no config
    published.mkdir()
    tensors = load_file(str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))
    torch.save(tensors, published / "medusa_lm_head.pt")
    assert main([*common, "--heads", str(published)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    assert main([*common, "--heads", str(run), "--draft-option", "dpeth=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "dpeth" in err


def test_export_of_a_folder_without_heads_fails_cleanly(tmp_path: Path) -> None:
    status = main(["export", str(tmp_path), "--format", "eagle3-hf", "--out", str(tmp_path / "x")])
    assert status == 2


def test_cache_features_then_offline_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "target"
    tiny_model("qwen2", vocab_size=400).save_pretrained(target)
    smollm2_tokenizer().save_pretrained(target)
    rows = [{"text": f"The quick brown fox {i} jumps over the lazy dog."} for i in range(10)]
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    cache = tmp_path / "features"
    command = ["data", "cache-features", "--target", str(target), "--device", "cpu"]
    assert main([*command, "--data", str(data), "--out", str(cache)]) == 0
    assert "bytes/token" in capsys.readouterr().out
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"] and manifest["settings"]["layers"] == [2]
    overrides = [
        f"target.name={target}",
        "target.device=cpu",
        "data.features=offline",
        f"data.features_dir={cache}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.batch_size=4",
        "medusa.num_heads=1",
    ]
    assert main(["train", *overrides]) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_typical_acceptance_is_reachable_and_labelled_lossy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "target"
    tiny_model("llama", vocab_size=400).save_pretrained(target)
    smollm2_tokenizer().save_pretrained(target)
    common = ["generate", "--target", str(target), "--device", "cpu", "--max-new-tokens", "12"]
    common += ["--drafter", "prompt-lookup", "hello there hello there"]
    assert main([*common, "--json"]) == 0
    lossless = json.loads(capsys.readouterr().out)
    assert main([*common, "--json", "--acceptance", "typical"]) == 0
    typical = json.loads(capsys.readouterr().out)
    assert (lossless["acceptance"], typical["acceptance"]) == ("lossless", "typical")
    assert typical["token_ids"] == lossless["token_ids"]  # temperature 0: both are greedy
    assert main([*common, "--acceptance", "typical", "--temperature", "1.0"]) == 0
    assert "typical acceptance: LOSSY" in capsys.readouterr().err


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """For eval and features (``generate`` on an AMX CPU: tests/test_cpu_fallback.py)."""
    from headway.cli import common

    assert common.dtype_for("auto", "cpu") == "float32"
    assert common.dtype_for("float16", "cpu") == "float16"  # an explicit choice is kept
    monkeypatch.setattr(common, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, wanted in ((True, "bfloat16"), (False, "float32")):  # pre-Ampere: no bf16
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda emulated, s=supported: s)
        assert common.dtype_for("auto", "auto") == wanted
    args = build_parser().parse_args(["generate", "hi"])
    assert args.dtype == "auto"


def test_json_output_is_strict_json_when_no_draft_step_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "target"
    tiny_model("llama", vocab_size=400).save_pretrained(target)
    smollm2_tokenizer().save_pretrained(target)
    command = ["generate", "--target", str(target), "--device", "cpu", "--json"]
    assert main([*command, "--max-new-tokens", "1", "hello"]) == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    row = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert row["tau"] is None and len(row["token_ids"]) == 1


def test_env_prints_what_a_bug_report_needs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch import nn

    from headway.cli import env

    # the route is timed on small layers here; `headway env` itself times SmolLM2's shapes
    monkeypatch.setattr(env, "_smollm2_shaped", lambda dtype: [nn.Linear(64, 128, dtype=dtype)])
    assert main(["env"]) == 0
    printed = capsys.readouterr().out
    for name in ("headway", "torch", "transformers", "accelerate", "CPU", "AVX", "torch kernels"):
        assert name in printed, name
    for setting in ("auto regeneration dtype", "train.mixed_precision=auto", "--gemm auto"):
        assert setting in printed, setting


def test_chain_reaches_the_decode_options_and_zero_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--chain STEPS`` (default 1) is the decoder's ``DecodeOptions.chain``; 0 is refused by
    the parser in one line, not by a traceback from the options."""
    from headway.cli.common import decode_options

    cpu = torch.device("cpu")
    assert decode_options(build_parser().parse_args(["generate", "hi"]), cpu).chain == 1
    args = build_parser().parse_args(["eval", "--chain", "4"])
    assert decode_options(args, cpu).chain == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--chain", "0", "hi"])
    assert "--chain: 0 is not an integer >= 1" in capsys.readouterr().err
