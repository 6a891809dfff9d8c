"""headway on a CPU without AVX-512: oneDNN's bf16 reorder raises there, and nothing may crash.

Two ways of being such a CPU on an AVX-512 machine: in process, the reorder op raises the same
RuntimeError an AVX2-only CPU raises (:func:`no_bf16_packing`); in a subprocess, the AVX2 profile
(:data:`headway.hardware.AVX2_PROFILE`) limits torch, oneDNN and MKL to AVX2, where the real op
raises for real. Each path a user runs in bf16 goes through the stock route with the stock
route's output.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from headway.cli import build_parser
from headway.decode import packed
from headway.decode.batch_decode import decode_batch
from headway.decode.gemm import GemmChoice, apply_gemm
from headway.decode.generate import generate
from headway.drafters.lookup import PromptLookupDrafter
from headway.hardware import AVX2_PROFILE, CpuFeatures, mixed_precision, native_dtype
from tests.tiny import tiny_model

AVX2_ERROR = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
    "avx512vl and avx512dq"
)
PROMPT = [1, 7, 23, 45, 12, 9, 60, 7, 23, 45, 12]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_bf16_packing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """oneDNN's reorder raises for bf16 weights, as on an AVX2-only CPU."""
    original = packed.reorder_weight

    def refuse(weight: torch.Tensor, rows: int) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(AVX2_ERROR)
        return original(weight, rows)

    monkeypatch.setattr(packed, "reorder_weight", refuse)
    packed._probe_packing.cache_clear()
    yield
    packed._probe_packing.cache_clear()


def test_a_reorder_that_raises_turns_the_packed_route_off_once_with_a_reason(
    no_bf16_packing: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="headway.decode.packed"):
        assert not packed.packing_available(torch.bfloat16)
        assert not packed.packing_available(torch.bfloat16)  # probed once
    reasons = [r.getMessage() for r in caplog.records if r.name == "headway.decode.packed"]
    # the reason: torch's own report, or (where torch reports support) the reorder's error
    assert len(reasons) == 1 and "bfloat16" in reasons[0]
    assert "avx512bw" in reasons[0] or "no kernels for them" in reasons[0]
    assert packed.packing_available(torch.float32) == packed._probe_packing.__wrapped__(
        torch.float32
    )  # fp32 is probed on its own


def test_auto_never_packs_bf16_there_and_packed_is_refused_in_one_line(
    no_bf16_packing: None,
) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 256)).to(torch.bfloat16)
    assert apply_gemm(model, "auto") == "stock"  # transposed is fp32 only
    with pytest.raises(ValueError, match="cannot multiply bfloat16 weights") as refused:
        apply_gemm(model, "packed")
    assert "\n" not in str(refused.value) and "headway env" in str(refused.value)


def test_torchs_own_report_keeps_the_reorder_from_being_tried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never(weight: torch.Tensor, rows: int) -> torch.Tensor:
        raise AssertionError("the reorder ran although torch reported no bf16 kernels")

    monkeypatch.setattr(packed, "onednn_supports", lambda dtype: False)
    monkeypatch.setattr(packed, "reorder_weight", never)
    packed._probe_packing.cache_clear()
    try:
        assert not packed.packing_available(torch.bfloat16)
    finally:
        packed._probe_packing.cache_clear()


def _decoded(model: Any, gemm: GemmChoice) -> list[int]:
    apply_gemm(model, gemm)
    result = generate(
        model,
        PROMPT,
        drafter=PromptLookupDrafter(min_ngram=1),
        max_new_tokens=16,
        eos_token_ids=(),
    )
    return result.tokens


def _regenerated(model: Any, gemm: GemmChoice) -> list[list[int]]:
    """What regeneration's batch engine answers to four prompts, three rows at a time."""
    apply_gemm(model, gemm)
    prompts = [torch.tensor(PROMPT[index:]) for index in range(4)]
    drafters = [PromptLookupDrafter() for _ in prompts]
    results = decode_batch(model, prompts, drafters, max_new_tokens=8, max_batch=3)
    return [result.tokens for result in results]


def test_bf16_decoding_and_regeneration_take_the_stock_route_with_its_output(
    no_bf16_packing: None,
) -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    assert _decoded(model, "auto") == _decoded(model, "stock")
    assert _regenerated(model, "auto") == _regenerated(model, "stock")


def test_a_bf16_eagle_draft_model_over_a_float32_target_keeps_the_output(
    no_bf16_packing: None, tmp_path: Path
) -> None:
    from headway.drafters.build import build_drafter
    from headway.drafters.specs import EagleSpec
    from headway.target import Target
    from tests.test_eagle3 import tiny4
    from tests.test_formats import random_run

    model = tiny4("llama")  # EAGLE-3 fuses three distinct layers
    truth = generate(model, PROMPT, drafter=None, max_new_tokens=12, eos_token_ids=()).tokens
    target = Target(model=model, tokenizer=None, source="tiny")  # type: ignore[arg-type]
    for method in ("eagle1", "eagle3"):
        run = random_run(tmp_path / method, method, model)
        spec = EagleSpec(heads=str(run), dtype="bfloat16", total_tokens=6, depth=3, top_k=2)
        drafter = build_drafter(spec, target)
        result = generate(model, PROMPT, drafter=drafter, max_new_tokens=12, eos_token_ids=())
        assert result.tokens == truth, method


def test_auto_dtypes_follow_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from headway import hardware

    avx2 = CpuFeatures("x", "x86_64", "AVX2", True, False, False, False, False)
    amx = CpuFeatures("x", "x86_64", "AVX512", True, True, True, True, True)
    limited = CpuFeatures("x", "x86_64", "AVX2", True, True, True, True, True)
    for cpu, native in ((avx2, False), (amx, True), (limited, False)):
        monkeypatch.setattr(hardware, "cpu_features", lambda cpu=cpu: cpu)
        assert cpu.native_bf16 == native
        assert native_dtype("cpu") == ("bfloat16" if native else "float32")
        assert mixed_precision("auto", "cpu") == ("bf16" if native else "no")
        assert mixed_precision("bf16", "cpu") == "bf16"  # asked for: kept (with a warning)
        assert mixed_precision("fp16", "cpu") == "no"
        assert cpu.describe().count("\n") == 0


def test_generate_decodes_in_bf16_where_it_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """``headway generate --dtype auto``: bf16 where AMX or AVX-512 BF16 runs it (faster than
    fp32 on both, measured), fp32 on AVX2 and on an AMX CPU whose kernels are limited to AVX2;
    ``eval`` and feature caching stay fp32 on every CPU (exact greedy output)."""
    from headway import hardware
    from headway.cli import common

    avx512_bf16 = CpuFeatures("x", "x86_64", "AVX512", True, True, True, False, True)
    amx = CpuFeatures("x", "x86_64", "AVX512", True, True, True, True, True)
    limited = CpuFeatures("x", "x86_64", "AVX2", True, True, True, True, True)
    avx2 = CpuFeatures("x", "x86_64", "AVX2", True, False, False, False, False)
    for cpu, wanted in ((amx, "bfloat16"), (avx512_bf16, "bfloat16"), (limited, "float32")):
        monkeypatch.setattr(hardware, "cpu_features", lambda cpu=cpu: cpu)
        assert common.dtype_for("auto", "cpu", "generate") == wanted
        assert common.dtype_for("auto", "cpu", "decode") == "float32"
        assert common.dtype_for("float32", "cpu", "generate") == "float32"  # asked for: kept
    monkeypatch.setattr(hardware, "cpu_features", lambda: avx2)
    assert hardware.native_dtype("cpu") == "float32"
    assert hardware.native_dtype("meta") == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, wanted in ((True, "bfloat16"), (False, "float32")):  # pre-Ampere: no bf16
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda emulated, s=supported: s)
        assert hardware.native_dtype("cuda") == wanted
    assert build_parser().parse_args(["generate", "hi"]).dtype_use == "generate"
    assert build_parser().parse_args(["eval"]).dtype_use == "decode"


SCRIPT = """
import json, sys
from pathlib import Path
from headway.cli import main
from headway.decode.packed import packing_available
from headway.hardware import cpu_features
import torch
from tests.test_formats import random_run
from tests.test_eagle3 import tiny4

target, chat, out = sys.argv[1:4]
report = {"native_bf16": cpu_features().native_bf16,
          "bf16_packing": packing_available(torch.bfloat16)}
common = ["generate", "--target", target, "--device", "cpu", "--json", "--max-new-tokens", "10",
          "--drafter", "prompt-lookup", "--draft-option", "min_ngram=1", "hello hello hello"]
for gemm in ("auto", "stock"):
    main([*common, "--dtype", "bfloat16", "--gemm", gemm])
report["packed_exit"] = main([*common, "--dtype", "bfloat16", "--gemm", "packed"])
run = random_run(Path(out) / "eagle3", "eagle3", tiny4("llama", vocab_size=400))
eagle = ["generate", "--target", target, "--device", "cpu", "--json", "--max-new-tokens", "10",
         "hello hello hello"]
main([*eagle, "--heads", str(run), "--draft-option", "dtype=bfloat16", "--force"])
main([*eagle, "--drafter", "none"])
regenerate = ["data", "regenerate", "--target", target, "--mix", chat + ":3",
    "--max-new-tokens", "6", "--batch-size", "2", "--shard-size", "3"]
report["regenerate_exits"] = [main([*regenerate, "--out", out + "/auto"]),
    main([*regenerate, "--dtype", "bfloat16", "--out", out + "/bf16"])]
report["quickstart_exit"] = main(["quickstart", "--tiny", "--out", out + "/quickstart"])
print("REPORT " + json.dumps(report))
"""


def test_the_cli_runs_in_bf16_under_the_avx2_profile(tmp_path: Path) -> None:
    """A subprocess limited to AVX2 kernels, where oneDNN's bf16 reorder raises for real:
    ``generate --dtype bfloat16`` (auto == stock, packed refused in one line), a bf16 EAGLE-3
    draft model, ``data regenerate`` (auto dtype, and bf16 as the crash report ran it) and
    ``quickstart --tiny`` all finish."""
    from tests.test_eagle3 import tiny4
    from tests.tokenizers_fixture import smollm2_tokenizer

    target = tmp_path / "target"
    tiny4("llama", vocab_size=400).save_pretrained(target)
    smollm2_tokenizer().save_pretrained(target)
    chat = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "?"},
            ]
        }
        for i in range(3)
    ]
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    env = {**os.environ, **AVX2_PROFILE, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(target), str(chat), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    report = json.loads(next(line for line in lines if line.startswith("REPORT "))[7:])
    assert report == {
        "native_bf16": False,
        "bf16_packing": False,
        "packed_exit": 2,
        "regenerate_exits": [0, 0],
        "quickstart_exit": 0,
    }, result.stderr[-3000:]
    outputs = [json.loads(line) for line in lines if line.startswith("{")]
    auto, stock, eagle, plain = (output["token_ids"] for output in outputs)
    assert auto == stock and eagle == plain
    refusals = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(refusals) == 1 and "cannot multiply bfloat16 weights" in refusals[0]
    assert "Traceback" not in result.stderr
