"""The timing helpers the benchmark and device scripts share (headway.decode.bench)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headway.decode import bench
from headway.decode.gemm import gemm_choice

CPU = torch.device("cpu")


def test_median_timed_warms_up_once_then_returns_the_median_and_the_last_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # calls of 3, 1 and 2 seconds
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    calls: list[int] = []

    def run() -> int:
        calls.append(len(calls))
        return len(calls)

    seconds, last = bench.median_timed(run, CPU, 3)
    assert (seconds, last, len(calls)) == (2.0, 4, 4)  # warm-up + 3 timed


def test_median_timed_without_warm_up_times_every_call() -> None:
    calls: list[int] = []

    def run() -> int:
        calls.append(1)
        return len(calls)

    seconds, last = bench.median_timed(run, CPU, 2, warm_up=False)
    assert (last, len(calls)) == (2, 2) and seconds >= 0.0


def test_a_random_model_has_the_configs_shape_and_the_same_weights_each_time(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.json"
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    shape |= {"num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 100}
    config.write_text(json.dumps(shape))
    first = bench.random_model(config, CPU, torch.float32)
    second = bench.random_model(config, CPU, torch.float32)
    assert first.config.model_type == "llama" and first.config.num_hidden_layers == 2
    assert not first.training and not any(p.requires_grad for p in first.parameters())
    assert all(
        torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True)
    )
    assert gemm_choice(first) == "stock"  # on a CPU: no route timed
    config.write_text(json.dumps({**shape, "model_type": "qwen2"}))
    assert type(bench.random_model(config, CPU, torch.float32)).__name__ == "Qwen2ForCausalLM"
