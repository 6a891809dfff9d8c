"""Acceptance while training (issue #13, item 5): tau_sim from a hand-made accuracy table, and a
short run that logs it at every eval with the trained tokens and draws the learning curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headway.train.curves import CURVE_FILE, simulated_tau, write_learning_curve
from headway.train.loop import train
from tests.test_packing import config, workspace  # noqa: F401  (the module-scoped fixture)


def test_tau_sim_of_a_hand_made_table() -> None:
    medusa = {"head1/top1": 0.5, "head2/top1": 0.4, "head3/top1": 0.25, "head1/top5": 0.9}
    assert simulated_tau(medusa) == pytest.approx(1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.25)
    prefixed = {f"eval/{name}": value for name, value in medusa.items()}
    assert simulated_tau(prefixed) == simulated_tau(medusa)
    # EAGLE-3: accuracies count rows inside the draft vocabulary; scale by its coverage.
    eagle3 = {"eval/depth1/top1": 0.8, "eval/depth2/top1": 0.5, "eval/in_vocab": 0.5}
    assert simulated_tau(eagle3) == pytest.approx(1 + 0.4 + 0.4 * 0.25)
    assert simulated_tau({"head1/top1": 0.5, "head3/top1": 0.9}) == pytest.approx(1.5)  # gap
    assert simulated_tau({"loss": 1.0}) is None


@pytest.mark.parametrize("method", ["medusa1", "eagle3"])
def test_training_logs_tau_sim_and_draws_the_learning_curve(
    workspace: Path,  # noqa: F811
    tmp_path: Path,
    method: str,
) -> None:
    settings = config(
        workspace,
        method,
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=4",
        "train.eval_every=2",
        "train.save_every=4",
        "train.batch_size=2",
        "train.warmup_steps=1",
        "data.pack=true",
        "data.eval_fraction=0.2",
    )
    run_dir = train(settings)
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 4]
    assert 0 < rows[0]["trained_tokens"] < rows[1]["trained_tokens"]
    for row in rows:
        assert row["eval/tau_sim"] == pytest.approx(simulated_tau(row))
        assert row["eval/tau_sim"] >= 1.0
    assert (run_dir / CURVE_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_curve_without_points(tmp_path: Path) -> None:
    log = tmp_path / "eval.jsonl"
    log.write_text(json.dumps({"step": 1, "eval/loss": 2.0}) + "\n")
    assert write_learning_curve(log, tmp_path / CURVE_FILE) is None
    assert not (tmp_path / CURVE_FILE).exists()
