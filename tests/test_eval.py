"""`headway eval`: acceptance counting on hand-made traces, the report files on a tiny target, and
`--heads-only` on a tiny trained run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from headway.cli import main
from headway.decode.options import DecodeOptions
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.oracle import OracleDrafter
from headway.eval.acceptance import acceptance_stats, draft_steps
from headway.eval.plots import PLOT_NAMES
from headway.eval.run import evaluate
from headway.eval.speed import EvalSettings, RecordingDrafter
from headway.evalsets import EvalPrompt
from headway.target import Target
from headway.train.heads_accuracy import weighted_means
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

# Two generations (prefill first): draft steps [3, 1, 2, 4, 1], accepted depths [2, 0, 1, 3, 0].
TRACES = [[1, 3, 1, 2], [1, 4, 1]]


def test_tau_and_depth_acceptance_on_a_hand_made_trace() -> None:
    stats = acceptance_stats(TRACES)
    assert stats.draft_steps == 5
    assert stats.tau == pytest.approx(11 / 5)
    assert stats.histogram == {1: 2, 2: 1, 3: 1, 4: 1}
    assert stats.acceptance_by_depth == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert stats.conditional_acceptance_by_depth == pytest.approx([3 / 5, 2 / 3, 1 / 2])
    assert sum(stats.acceptance_by_depth) == pytest.approx(stats.tau - 1)


def test_proposed_depths_give_the_drafted_fraction() -> None:
    stats = acceptance_stats(TRACES, [[3, 3, 0], [4, 1]])
    # depths proposed: [3, 3, 0, 4, 1] -> reached depth 1: 4/5, 2: 3/5, 3: 3/5, 4: 1/5
    assert stats.drafted_by_depth == pytest.approx([4 / 5, 3 / 5, 3 / 5, 1 / 5])
    with pytest.raises(ValueError, match="proposed depths"):
        acceptance_stats(TRACES, [[3, 3], [4, 1]])


def test_plain_decoding_and_bad_traces() -> None:
    plain = acceptance_stats([[1, 1, 1, 1]])
    assert plain.tau == 1.0 and plain.acceptance_by_depth == [] and plain.histogram == {1: 3}
    nothing = acceptance_stats([[1]])
    assert math.isnan(nothing.tau) and nothing.to_dict()["tau"] is None
    with pytest.raises(ValueError, match=">= 1"):
        draft_steps([1, 0, 2])


def test_weighted_means_weight_by_each_heads_token_count() -> None:
    batches = [
        {"head1/top1": 1.0, "head1/tokens": 3.0, "head2/top1": 0.0, "head2/tokens": 1.0},
        {"head1/top1": 0.0, "head1/tokens": 1.0, "head2/top1": 1.0, "head2/tokens": 3.0},
        {"depth1/top1": 0.5, "tokens": 4.0},
    ]
    means = weighted_means(batches)
    assert means["head1/top1"] == pytest.approx(3 / 4)
    assert means["head2/top1"] == pytest.approx(3 / 4)
    assert means["head1/tokens"] == 4.0 and means["tokens"] == 4.0
    assert means["depth1/top1"] == pytest.approx(0.5)


def _tiny_target(tmp_path: Path) -> Path:
    folder = tmp_path / "target"
    tiny_model("llama", vocab_size=400).save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def _prompt_file(tmp_path: Path) -> Path:
    rows = [
        {"prompt": "hello there", "category": "chat"},
        {"prompt": "Tell me a joke about cats.", "category": "writing"},
        {"prompt": "what is two plus two?", "category": "math"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


REPORT_KEYS = (
    "tau",
    "acceptance_by_depth",
    "conditional_acceptance_by_depth",
    "per_position_acceptance",
    "accept_length_histogram",
    "tokens_per_s",
    "speedup",
    "identical_fraction",
    "per_category",
    "per_prompt",
    "overhead_fraction",
    "timing",
    "machine",
    "settings",
)


def test_eval_cli_writes_the_report_plots_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, prompts, out = _tiny_target(tmp_path), _prompt_file(tmp_path), tmp_path / "out"
    command = ["eval", "--target", str(target), "--device", "cpu", "--drafter", "prompt-lookup"]
    command += ["--prompts", str(prompts), "--max-new-tokens", "24", "--out", str(out)]
    assert main(command) == 0
    assert "speedup" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    for key in REPORT_KEYS:
        assert key in report, key
    assert report["num_prompts"] == 3 and report["drafter"]["name"] == "prompt-lookup"
    assert report["identical_fraction"] == 1.0
    assert set(report["per_category"]) == {"chat", "math", "writing"}
    assert report["per_turn"] is None  # first turns only
    assert report["tokens_per_s"]["drafter"] > 0 and report["tokens_per_s"]["plain"] > 0
    assert report["speedup"] == pytest.approx(
        report["tokens_per_s"]["drafter"] / report["tokens_per_s"]["plain"]
    )
    steps = [p["tokens"] for p in report["per_prompt"]]
    assert steps == [p["plain_tokens"] for p in report["per_prompt"]]
    assert sum(report["accept_length_histogram"].values()) == report["draft_steps"]
    assert 0 <= report["overhead_fraction"] < 1
    for name in PLOT_NAMES:
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "| speedup |" in (out / "summary.md").read_text()


def test_oracle_drafter_is_identical_and_counted_exactly(tmp_path: Path) -> None:
    """A chain oracle of depth 2 accepts everything. 20 new tokens = the prefill's 1, six steps
    of 3 (2 accepted + bonus), and a last step whose 1-token draft is accepted but cut by
    max_new_tokens to 1 token. Output equals `model.generate` token for token."""
    from headway.target import load_target

    target = load_target(_tiny_target(tmp_path), device="cpu")
    prompt = EvalPrompt("p0", "chat", "hello there")
    continuation = _greedy(target, prompt.text, 20)
    assert len(continuation) == 20  # no EOS in this tiny model's continuation
    report = evaluate(
        target,
        OracleDrafter(continuation, depth=2),
        [prompt],
        EvalSettings(max_new_tokens=20),
        tmp_path / "o",
        drafter_info={"name": "oracle"},
        prompt_set="inline",
        progress=False,
    )
    assert report["identical_fraction"] == 1.0
    assert report["per_prompt"][0]["tokens"] == 20
    assert report["draft_steps"] == 7
    assert report["accept_length_histogram"] == {"1": 1, "3": 6}
    assert report["tau"] == pytest.approx(19 / 7)
    assert report["acceptance_by_depth"] == pytest.approx([6 / 7, 6 / 7])
    assert report["conditional_acceptance_by_depth"] == pytest.approx([6 / 7, 1.0])
    assert report["drafted_by_depth"] == pytest.approx([1.0, 6 / 7])
    # vLLM's per-position rate: all 7 steps drafted; the last one's accepted token was cut.
    assert report["per_position_acceptance"] == pytest.approx([6 / 7, 6 / 7])
    assert report["verify_ms_by_block_size"] is None  # the drafter sized its own trees


def test_a_cost_sized_run_reports_the_verify_costs_it_sized_by(tmp_path: Path) -> None:
    from headway.target import load_target

    target = load_target(_tiny_target(tmp_path), device="cpu")
    prompt = EvalPrompt("p0", "chat", "hello there")
    drafter = OracleDrafter(_greedy(target, prompt.text, 12), depth=3)
    report = evaluate(
        target,
        drafter,
        [prompt],
        EvalSettings(max_new_tokens=12),
        tmp_path / "c",
        drafter_info={"name": "oracle"},
        prompt_set="inline",
        options=DecodeOptions(sizing="cost"),
        progress=False,
    )
    costs = report["verify_ms_by_block_size"]
    assert len(costs) == drafter.max_nodes + 1 and all(ms > 0 for ms in costs)
    assert report["decode"]["sizing"] == "cost"
    assert report["decode"]["gemm"] == "auto"  # nothing applied: auto, decided on first use
    assert report["decode"]["gemm_route"] in ("stock", "transposed", "packed")
    summary = (tmp_path / "c" / "summary.md").read_text()
    assert f"1: {costs[0]:.1f}, 2: {costs[1]:.1f}" in summary


def _greedy(target: Target, text: str, new: int) -> list[int]:
    from headway.api import prompt_ids

    ids = prompt_ids(target, text, chat=True)[None]
    with torch.inference_mode():
        out = target.model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False
        )
    return [int(t) for t in out[0, ids.shape[1] :]]


def test_recording_drafter_keeps_proposed_depths() -> None:
    inner = OracleDrafter([5, 6, 7, 8], depth=3)
    recording = RecordingDrafter(inner)
    recording.begin(torch.tensor([1, 2]))
    recording.propose(torch.tensor([1, 2]))
    recording.propose(torch.tensor([1, 2, 5, 6, 7]))
    assert recording.proposed_depths() == [3, 1]


def test_the_recording_drafter_hands_the_sampling_noise_on() -> None:
    """Evaluated sampled, an EAGLE drafter drafts coupled as it decodes (the eval's wrapper
    forwards the coupling; without it the figures were the uncoupled drafter's)."""
    from headway.decode.keyed_noise import Coupling

    seen: list[Any] = []

    class Coupled:
        hidden_layers: tuple[int, ...] = ()
        max_nodes = 4

        def couple(self, coupling: Any) -> None:
            seen.append(coupling)

    recording = RecordingDrafter(Coupled())  # type: ignore[arg-type]
    recording.couple(Coupling(seed=3, temperature=1.0))
    recording.couple(None)
    assert seen == [Coupling(seed=3, temperature=1.0), None]
    RecordingDrafter(PromptLookupDrafter()).couple(None)  # a drafter without it: nothing


def test_sampling_against_headway_checks_the_text_and_against_hf_does_not(
    tmp_path: Path,
) -> None:
    """Sampled, headway's plain decoding draws what the drafter's does with one seed (keyed
    noise): the report holds them identical; HF's sampling draws other numbers: no figure."""
    target, prompts, out = _tiny_target(tmp_path), _prompt_file(tmp_path), tmp_path / "out"
    command = ["eval", "--target", str(target), "--device", "cpu", "--drafter", "prompt-lookup"]
    command += ["--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "12"]
    command += ["--temperature", "0.8", "--out", str(out)]
    assert main([*command, "--baseline", "headway"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["identical_fraction"] == 1.0 and report["settings"]["baseline"] == "headway"
    assert all(prompt["identical"] for prompt in report["per_prompt"])
    assert main([*command, "--baseline", "hf"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["identical_fraction"] is None


def test_typical_acceptance_is_recorded_and_headlined_lossy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, prompts, out = _tiny_target(tmp_path), _prompt_file(tmp_path), tmp_path / "out"
    command = ["eval", "--target", str(target), "--device", "cpu", "--drafter", "prompt-lookup"]
    command += ["--prompts", str(prompts), "--num-prompts", "1", "--max-new-tokens", "8"]
    command += ["--temperature", "0.8", "--acceptance", "typical", "--out", str(out)]
    assert main(command) == 0
    assert "typical acceptance: LOSSY" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["decode"]["acceptance"] == "typical"
    assert main([*command[:-1], str(tmp_path / "lossless"), "--acceptance", "lossless"]) == 0
    assert "LOSSY" not in capsys.readouterr().out


def test_heads_only_scores_a_tiny_trained_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = _tiny_target(tmp_path)
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
        "data.eval_fraction=0.25",
        f"train.output_dir={run}",
        "train.max_steps=3",
        "train.warmup_steps=1",
        "train.batch_size=4",
        "medusa.num_heads=2",
    ]
    assert main(["train", *overrides]) == 0
    capsys.readouterr()
    out = tmp_path / "heads-eval"
    assert main(["eval", "--heads", str(run), "--heads-only", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "head1" in printed and "head2" in printed
    report = json.loads((out / "heads_report.json").read_text())
    assert report["samples"] == 3  # 12 samples, a quarter held out
    groups = report["groups"]
    for head in ("head1", "head2"):
        assert 0.0 <= groups[head]["top1"] <= groups[head]["top5"] <= 1.0
        assert groups[head]["tokens"] > 0
    # The same held-out rows and weights as training's own evaluation at its last step (one
    # batch on both sides, so its per-batch mean equals the token-weighted mean here).
    logged = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    for name in ("head1/top1", "head1/ce", "head2/top5"):
        assert report["metrics"][name] == pytest.approx(logged[f"eval/{name}"], abs=1e-5)


def test_bad_settings_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["eval", "--drafter", "prompt-lookup", "--max-new-tokens", "0"]
    with pytest.raises(SystemExit) as stop:  # refused by the parser, before anything loads
        main([*command, "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert "max-new-tokens" in capsys.readouterr().err
    assert main(["eval", "--drafter", "prompt-lookup", "--heads-only"]) == 2
    assert "--heads-only needs --heads" in capsys.readouterr().err
