"""Trackers proven (issue #16, item 5): a short run with ``train.log_with=[tensorboard]`` writes
an event file that reads back with the loss, per-head accuracy, learning rate and tau_sim; one
with ``[wandb]`` in offline mode writes its run folder (with the same keys) in the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from headway.train.loop import train
from tests.test_packing import config, workspace  # noqa: F401  (module-scoped fixture)


def test_tensorboard_event_file_reads_back(workspace: Path, tmp_path: Path) -> None:  # noqa: F811
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    settings = config(
        workspace,
        "medusa1",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=4",
        "train.eval_every=2",
        "train.save_every=4",
        "train.warmup_steps=1",
        "train.batch_size=2",
        "train.log_with=[tensorboard]",
    )
    run_dir = train(settings)
    events = sorted(run_dir.rglob("events.out.tfevents.*"))
    assert events, sorted(str(p) for p in run_dir.rglob("*"))
    scalars: set[str] = set()
    for event_file in events:  # accelerate writes the hyper-parameters in a run of their own
        candidate = event_accumulator.EventAccumulator(str(event_file))
        candidate.Reload()
        if "loss" in candidate.Tags()["scalars"]:
            accumulator = candidate
        scalars |= set(candidate.Tags()["scalars"])
    for tag in ("loss", "lr", "head1/top1", "eval/loss", "eval/tau_sim"):
        assert tag in scalars, sorted(scalars)
    losses = accumulator.Scalars("loss")
    assert [event.step for event in losses] == [1, 2, 3, 4]
    assert all(event.value > 0 for event in losses)


def test_wandb_offline_writes_its_run_folder_in_the_run_directory(
    workspace: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    settings = config(
        workspace,
        "medusa1",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=2",
        "train.eval_every=2",
        "train.save_every=2",
        "train.warmup_steps=1",
        "train.batch_size=2",
        "train.log_with=[wandb]",
    )
    run_dir = train(settings)
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, sorted(str(p) for p in run_dir.rglob("*"))
    records = b"".join(path.read_bytes() for path in runs[0].glob("run-*.wandb"))
    for key in (b"loss", b"lr", b"head1/top1", b"eval/tau_sim"):  # the logged history
        assert key in records, key
    assert not (tmp_path / "wandb").exists()
