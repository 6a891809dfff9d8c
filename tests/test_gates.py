"""Per-position acceptance gates: vLLM's per-position rate on hand-made traces (against a
transcription of vLLM's own counting), the gates file and its check, ``headway eval
--write-gates`` on a tiny target, and (slow) the shipped EAGLE-3 drafter held to its gates in
float32 on a CPU, its outputs equal to the target's greedy ones."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from headway.cli import main
from headway.drafters.shipped import SHIPPED_DIR
from headway.errors import ConfigError, HeadwayError
from headway.eval.acceptance import acceptance_stats, per_position_acceptance
from headway.eval.gates import (
    GATE_RATIO,
    GATES_NAME,
    AcceptanceGates,
    GateRun,
    check_gates,
    gate_prompts,
    gates_from_report,
    load_gated,
    measure_gates,
    read_gates,
    write_gates,
)
from tests.test_eval import _prompt_file, _tiny_target

# Two generations (prefill first): draft steps [3, 1, 2, 4, 1], accepted [2, 0, 1, 3, 0].
TRACES = [[1, 3, 1, 2], [1, 4, 1]]
SHIPPED = SHIPPED_DIR / "smollm2-135m-eagle3"


def vllm_per_position(accepted: Sequence[int], drafted: Sequence[int], k: int) -> list[float]:
    """vLLM's counting transcribed (``SpecDecodingStats.observe_draft``, then
    ``num_accepted_tokens_per_pos / num_drafts``): only steps that drafted are drafts."""
    per_pos, drafts = [0] * k, 0
    for tokens, draft in zip(accepted, drafted, strict=True):
        if draft == 0:
            continue
        drafts += 1
        for position in range(tokens):
            per_pos[position] += 1
    return [count / drafts for count in per_pos] if drafts else []


def test_per_position_acceptance_on_hand_made_traces() -> None:
    # Every step a draft: P(accepted >= i) over the five steps, up to the deepest accepted.
    assert per_position_acceptance(TRACES) == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    # Chains of depth 4; the last step proposed nothing, so it is not a draft.
    proposed = [[4, 4, 4], [4, 0]]
    assert per_position_acceptance(TRACES, proposed) == pytest.approx([3 / 4, 2 / 4, 1 / 4, 0.0])
    assert per_position_acceptance(TRACES, positions=5) == pytest.approx([0.6, 0.4, 0.2, 0, 0])
    assert per_position_acceptance([[1, 1, 1]], [[0, 0]]) == []  # nothing ever drafted
    assert per_position_acceptance([[1]]) == []
    with pytest.raises(ValueError, match="proposed depths"):
        per_position_acceptance(TRACES, [[4, 4], [4, 0]])


def test_per_position_acceptance_follows_vllms_counting() -> None:
    """Random chains of depth 4 (some steps drafting nothing): the rates equal vLLM's counting,
    are non-increasing, and sum to the mean accepted drafted tokens per draft."""
    rng = random.Random(0)
    for _ in range(50):
        drafted = [rng.choice([0, 4, 4, 4]) for _ in range(rng.randint(1, 30))]
        accepted = [rng.randint(0, depth) for depth in drafted]
        trace = [1] + [tokens + 1 for tokens in accepted]
        rates = per_position_acceptance([trace], [drafted])
        assert rates == pytest.approx(vllm_per_position(accepted, drafted, max(drafted)))
        assert all(a >= b for a, b in itertools.pairwise(rates))
        drafts = [tokens for tokens, depth in zip(accepted, drafted, strict=True) if depth]
        if drafts:
            assert sum(rates) == pytest.approx(sum(drafts) / len(drafts))


def test_acceptance_stats_carry_the_per_position_rates() -> None:
    stats = acceptance_stats(TRACES, [[4, 4, 4], [4, 0]])
    assert stats.per_position_acceptance == pytest.approx([3 / 4, 2 / 4, 1 / 4, 0.0])
    assert stats.to_dict()["per_position_acceptance"] == stats.per_position_acceptance


def _gates(**changes: Any) -> AcceptanceGates:
    values: dict[str, Any] = {
        "command": "headway eval ...",
        "target": "smollm2-135m",
        "dtype": "float32",
        "prompt_set": "mt-bench",
        "prompt_ids": ("mt-bench/81", "mt-bench/91"),
        "max_new_tokens": 16,
        "drafter": {"name": "eagle", "top_k": 1, "depth": 4, "total_tokens": 5},
        "decode": {"sizing": "drafter", "acceptance": "lossless", "verify": "eager"},
        "gemm": "stock",
        "per_position_acceptance": (0.5, 0.25, 0.1, 0.0),
        "gate_ratio": GATE_RATIO,
        "tau": 1.85,
        "draft_steps": 20,
        "measured": {"created": "2026-11-26T00:00:00+00:00"},
    }
    return AcceptanceGates(**(values | changes))


def test_gates_check_each_position_against_ratio_times_recorded() -> None:
    gates = _gates()
    assert gates.thresholds == pytest.approx([0.45, 0.225, 0.09, 0.0])
    check = check_gates(gates, [0.46, 0.23, 0.09, 0.0])
    assert check.passed and "BELOW" not in check.table()
    check = check_gates(gates, [0.46, 0.2])  # positions 3 and 4 never reached: 0.0
    assert check.measured == (0.46, 0.2, 0.0, 0.0)
    assert check.failed_positions == [2, 3]
    table = check.table().splitlines()
    assert table[2].split() == ["2", "0.200", "0.250", "0.225", "BELOW", "GATE"]


def test_gates_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    gates = _gates()
    path = write_gates(gates, tmp_path / GATES_NAME)
    assert read_gates(path) == gates
    data = json.loads(path.read_text())
    assert data["schema"] == "headway.gates/1" and "tests/test_gates.py" in data["about"]
    path.write_text(json.dumps(data | {"schema": "other"}))
    with pytest.raises(ConfigError, match="schema"):
        read_gates(path)
    path.write_text(json.dumps(data | {"extra": 1}))
    with pytest.raises(ConfigError, match="unknown keys \\['extra'\\]"):
        read_gates(path)
    with pytest.raises(ConfigError, match="gate_ratio"):
        _gates(gate_ratio=1.5)


def _report(**changes: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "settings": {"temperature": 0.0, "max_new_tokens": 16},
        "decode": {
            "sizing": "drafter",
            "acceptance": "lossless",
            "verify": "eager",
            "gemm": "stock",
        },
        "target": {"name": "smollm2-135m", "dtype": "float32"},
        "identical_fraction": 1.0,
        "per_position_acceptance": [0.5, 0.25],
        "prompt_set": "mt-bench",
        "per_prompt": [{"id": "mt-bench/81"}],
        "tau": 1.75,
        "draft_steps": 8,
        "created": "now",
        "headway_version": "0",
        "machine": {},
    }
    return report | changes


def test_only_reproducible_lossless_runs_make_gates() -> None:
    from headway.drafters.specs import EagleSpec, PromptLookupSpec

    spec, options = PromptLookupSpec(min_ngram=1), {"min_ngram": 1}
    gates = gates_from_report(_report(), spec, options=options, command="c")
    assert gates.drafter == {"name": "prompt-lookup", "min_ngram": 1}
    assert gates.prompt_ids == ("mt-bench/81",)
    bad: dict[str, dict[str, Any]] = {
        "greedy": {"settings": {"temperature": 0.7, "max_new_tokens": 16}},
        "sizing drafter": {"decode": {"sizing": "cost", "acceptance": "lossless"}},
        "float32": {"target": {"name": "t", "dtype": "bfloat16"}},
        "differed": {"identical_fraction": 0.5},
        "proposed nothing": {"per_position_acceptance": []},
    }
    for message, change in bad.items():
        with pytest.raises(HeadwayError, match=message):
            gates_from_report(_report(**change), spec, options={}, command="c")
    timed = EagleSpec(heads="somewhere", top_k=1, total_tokens="auto", dtype="target")
    with pytest.raises(HeadwayError, match="total_tokens"):  # chosen by timing the machine
        gates_from_report(_report(), timed, options={}, command="c")
    int8_where_faster = EagleSpec(heads="somewhere", top_k=1, total_tokens=5)  # dtype=auto
    with pytest.raises(HeadwayError, match="dtype"):
        gates_from_report(_report(), int8_where_faster, options={}, command="c")


def test_eagle_gates_that_name_no_dtype_decode_in_the_targets() -> None:
    """Gates written before the draft dtype defaulted to ``auto`` (int8 where timed faster)
    were measured in the target's dtype, and are checked so; a recorded dtype is kept."""
    from headway.drafters.specs import EagleSpec
    from headway.eval.gates import gate_spec

    old = read_gates(SHIPPED / GATES_NAME)
    drafter = {k: v for k, v in old.drafter.items() if k != "dtype"}
    for recorded, expected in ((drafter, "target"), ({**drafter, "dtype": "int8"}, "int8")):
        spec = gate_spec(dataclasses.replace(old, drafter=recorded), SHIPPED)
        assert isinstance(spec, EagleSpec) and spec.dtype == expected


def test_eval_writes_gates_that_decoding_again_reproduces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gates ``headway eval --write-gates`` writes are what :func:`measure_gates` measures
    when it decodes their prompts again (the path the slow gate test takes)."""
    target, prompts, path = _tiny_target(tmp_path), _prompt_file(tmp_path), tmp_path / GATES_NAME
    command = ["eval", "--target", str(target), "--device", "cpu", "--dtype", "float32"]
    command += ["--drafter", "prompt-lookup", "--prompts", str(prompts), "--sizing", "drafter"]
    command += ["--max-new-tokens", "24", "--gemm", "stock", "--out", str(tmp_path / "out")]
    command += ["--draft-option", "min_ngram=1"]
    assert main([*command, "--write-gates", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "per-position acceptance" in printed and f"gates written to {path}" in printed
    gates = read_gates(path)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert list(gates.per_position_acceptance) == report["per_position_acceptance"]
    assert gates.prompt_ids == tuple(row["id"] for row in report["per_prompt"])
    assert "--write-gates" in gates.command and "min_ngram=1" in gates.command
    assert [p.id for p in gate_prompts(gates)] == list(gates.prompt_ids)
    again = measure_gates(gates, *load_gated(gates))
    assert again.per_position_acceptance == pytest.approx(gates.per_position_acceptance)
    assert check_gates(gates, again.per_position_acceptance).passed
    # Settings whose acceptance does not reproduce are refused before anything is decoded.
    assert main([*command, "--sizing", "cost", "--write-gates", str(path)]) == 2
    assert "--sizing drafter" in capsys.readouterr().err
    assert main([*command, "--prompts", "mt-bench-turns", "--write-gates", str(path)]) == 2
    assert "use --prompts mt-bench" in capsys.readouterr().err


# --- slow: the shipped drafter against its own gates ----------------------------------------


@pytest.fixture(scope="module")
def shipped_run() -> Iterator[tuple[AcceptanceGates, GateRun, Any]]:
    """The shipped drafter's gate prompts decoded as its gates say, on one CPU thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gates = read_gates(SHIPPED / GATES_NAME)
        target, drafter = load_gated(gates, SHIPPED)
        yield gates, measure_gates(gates, target, drafter), target
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_shipped_drafter_keeps_its_per_position_acceptance(
    shipped_run: tuple[AcceptanceGates, GateRun, Any],
) -> None:
    gates, run, _ = shipped_run
    assert gates.dtype == "float32" and gates.prompt_set == "mt-bench"
    assert gates.drafter["top_k"] == 1 and gates.drafter["depth"] == 4  # a chain of 4
    depths = {depth for steps in run.proposed_depths for depth in steps}
    assert max(depths) == len(gates.per_position_acceptance) == 4, depths
    check = check_gates(gates, run.per_position_acceptance)
    assert check.passed, (
        f"{SHIPPED.name}: per-position acceptance below {gates.gate_ratio} x the rate recorded "
        f"when it was shipped ({SHIPPED / GATES_NAME}; regenerate with: {gates.command}):\n"
        + check.table()
    )


@pytest.mark.slow
def test_shipped_drafter_outputs_are_the_targets_greedy_outputs(
    shipped_run: tuple[AcceptanceGates, GateRun, Any],
) -> None:
    """Each generated token is the target's argmax after the prompt and the tokens before it,
    which is greedy decoding, checked in one teacher-forced forward per prompt (token-by-token
    ``model.generate`` equality is ``test_shipped.py``'s)."""
    from headway.api import prompt_ids

    gates, run, target = shipped_run
    for prompt, tokens in zip(gate_prompts(gates), run.tokens, strict=True):
        ids = prompt_ids(target, prompt.text, chat=prompt.chat)
        sequence = torch.cat([ids, torch.tensor(tokens, dtype=torch.long)])[None]
        with torch.inference_mode():
            logits = target.model(sequence).logits[0, ids.numel() - 1 : -1]
        assert logits.argmax(-1).tolist() == tokens, prompt.id
