"""`headway quickstart --tiny` end to end, resuming, and the pieces of its drafter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.decode.tree import chain
from headway.drafters.confident_drafter import ConfidentMedusaDrafter
from headway.drafters.draft_vocab import narrow_medusa
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.merged import MergedDrafter, tree_paths
from headway.drafters.oracle import OracleDrafter
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.quickstart.calibrate import choose_threshold
from headway.quickstart.plan import TINY_PLAN
from headway.quickstart.shipped_stage import NONE_SHIPPED


def test_tiny_quickstart_runs_every_stage_then_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "qs"
    assert main(["quickstart", "--tiny", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    stages = ("target", "data", "train", "export", "eval", "shipped")
    for number, stage in enumerate(stages, 1):
        assert f"[{number}/6] {stage}" in printed
    assert "speedup" in printed and "tau" in printed
    assert f"  shipped   {NONE_SHIPPED}" in printed  # the tiny target has no shipped drafter
    summary = json.loads((out / "quickstart.json").read_text())
    assert [stage["name"] for stage in summary["stages"]] == [
        "target",
        "data",
        "train",
        "export",
        "eval",
        "shipped",
    ]
    assert not any(stage["skipped"] for stage in summary["stages"])
    assert summary["figures"]["identical_fraction"] == 1.0
    assert (out / "export-medusa-vllm" / "model.safetensors").is_file()
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["drafter"]["export"] == str(out / "export-medusa-vllm")
    assert report["num_prompts"] == 3
    # The heads trained over the plan's draft vocabulary, exported with vLLM's token_map.
    assert report["drafter"]["draft_vocab_size"] == TINY_PLAN.draft_vocab_size
    engine = json.loads((out / "export-medusa-vllm" / "config.json").read_text())
    assert engine["truncated_vocab_size"] == TINY_PLAN.draft_vocab_size < engine["vocab_size"]
    # Rerunning resumes: every stage after the target is reported as already done.
    assert main(["quickstart", "--tiny", "--out", str(out)]) == 0
    again = json.loads((out / "quickstart.json").read_text())
    # The tiny target has no shipped drafter: stage 6 says so each time (nothing to resume).
    assert again["stages"][5]["summary"] == NONE_SHIPPED
    assert [stage["skipped"] for stage in again["stages"]] == [False, True, True, True, True, False]
    assert "already done" in capsys.readouterr().out


def test_interrupted_training_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    assert main(["quickstart", "--tiny", "--out", str(out)]) == 0
    for name in ("model.safetensors", "training_summary.json", "config.json"):
        (out / "run" / name).unlink()  # as if killed after the last checkpoint
    first_report = (out / "eval" / "report.json").stat().st_mtime_ns
    assert main(["quickstart", "--tiny", "--out", str(out)]) == 0
    summary = json.loads((out / "quickstart.json").read_text())
    skipped = [stage["skipped"] for stage in summary["stages"]]
    assert skipped == [False, True, False, False, False, False]  # target ... eval, shipped
    assert "resumed" in summary["stages"][2]["summary"]
    assert (out / "run" / "model.safetensors").is_file()
    # the stages after a rerun one ran again on its output, not from their old results
    assert (out / "eval" / "report.json").stat().st_mtime_ns > first_report


def test_the_shipped_drafter_is_measured_beside_the_quickstarts_own(tmp_path: Path) -> None:
    """Stage 6 finds the drafter shipped for the target by its fingerprint, evaluates it on the
    same prompts, prints its figures and records them; a rerun reports it as done."""
    from headway.quickstart.pipeline import run_quickstart

    out = tmp_path / "qs"
    run_quickstart(out, tiny=True, echo=lambda line: None, shipped_dir=tmp_path / "none")
    shipped = tmp_path / "drafters"
    shutil.copytree(out / "export-medusa-vllm", shipped / "tiny-medusa")  # as if shipped
    printed: list[str] = []
    result = run_quickstart(out, tiny=True, echo=printed.append, shipped_dir=shipped)
    line = next(line for line in printed if line.startswith("[6/6] shipped:"))
    assert "drafters/tiny-medusa, cost-sized: tau" in line and "identical outputs 100%" in line
    report = json.loads((out / "eval-shipped" / "report.json").read_text())
    assert report["drafter"]["heads"] == str(shipped / "tiny-medusa")
    assert report["decode"]["sizing"] == "cost"
    assert report["num_prompts"] == 3 and report["identical_fraction"] == 1.0
    assert result.figures["shipped"]["tau"] == report["tau"]
    again = run_quickstart(out, tiny=True, echo=lambda line: None, shipped_dir=shipped)
    assert (
        again.stages[5].skipped
        and again.stages[5].summary == line.split(": ", 1)[1].rsplit(" (", 1)[0]
    )


def test_choose_threshold_on_a_hand_made_example() -> None:
    confidence = torch.tensor([0.9, 0.8, 0.3, 0.2])
    correct = torch.tensor([True, True, False, False])
    # Drafting at >= 0.3 is right 2/3 of the time, at >= 0.2 half of the time.
    gate = choose_threshold(confidence, correct, break_even=0.6, min_drafts=1)
    assert gate.threshold == pytest.approx(0.3)
    assert gate.drafted_fraction == pytest.approx(3 / 4)
    assert gate.accuracy == pytest.approx(2 / 3)
    assert choose_threshold(confidence, correct, break_even=0.6, min_drafts=4).threshold is None
    assert choose_threshold(confidence, ~correct, break_even=0.6, min_drafts=1).threshold is None


def test_merged_drafter_unions_paths_and_credits_the_proposer() -> None:
    lookup = OracleDrafter([5, 6, 7], depth=3)
    other = OracleDrafter([9, 8], depth=2)
    merged = MergedDrafter([lookup, other], max_nodes=8)
    merged.begin(torch.tensor([1, 2]))
    merged.observe(torch.tensor([2, 5]), ())  # prefill: no proposal to credit
    tree = merged.propose(torch.tensor([1, 2]))
    assert sorted(tree_paths(tree)) == [[5, 6, 7], [9, 8]]
    merged.observe(torch.tensor([9, 8, 4]), ())  # accepted 9, 8 + bonus 4
    assert merged.accepted_by_source == [0, 2]
    assert tree_paths(chain([])) == []


def test_confident_medusa_drafts_only_above_the_threshold() -> None:
    config = MedusaConfig(num_heads=2, num_layers=1, hidden_size=4, vocab_size=6)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for head in heads.heads:
            head.lm_head.weight.zero_()  # type: ignore[union-attr, operator]
        heads.heads[0].lm_head.weight[3, 0] = 10.0  # type: ignore[union-attr, operator]
    hidden = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    sure = ConfidentMedusaDrafter(heads, hidden_layer=0, threshold=0.9, max_depth=2)
    sure.begin(torch.tensor([1]))
    assert sure.propose(torch.tensor([1])).size == 0  # nothing observed yet
    sure.observe(torch.tensor([1]), (hidden,))
    # head 1 puts ~1.0 on token 3; head 2 is uniform (1/6), so the chain stops after one token
    assert sure.propose(torch.tensor([1])).tokens.tolist() == [3]
    config, state, vocab = narrow_medusa(config, heads.state_dict(), torch.tensor([2, 4]))
    narrowed = MedusaHeads(config)
    narrowed.load_state_dict(state)
    restricted = ConfidentMedusaDrafter(
        narrowed, hidden_layer=0, threshold=0.9, max_depth=1, vocab=vocab
    )
    restricted.observe(torch.tensor([1]), (hidden,))
    assert restricted.propose(torch.tensor([1])).size == 0  # token 3 is outside the vocabulary
    lookup = PromptLookupDrafter()
    assert MergedDrafter([lookup, sure], max_nodes=4).hidden_layers == (0,)


def test_a_folder_with_other_files_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from headway.errors import HeadwayError
    from headway.quickstart.pipeline import run_quickstart

    (tmp_path / "README.md").write_text("a project, not a quickstart folder\n")
    with pytest.raises(HeadwayError, match=r"holds files a quickstart did not write \(README.md\)"):
        run_quickstart(tmp_path, tiny=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]
