"""The accelerate training loop on a tiny target: trains, evaluates, checkpoints, resumes exactly,
reads offline features, and runs as two processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headway.config import load_config
from headway.run_config import RunConfig
from headway.target import load_target
from headway.train import loop
from headway.train.curves import record_eval
from headway.train.data import build_dataset, pad_collate, pad_id_of
from headway.train.features import (
    CachedFeatureDataset,
    OnlineFeatures,
    cache_features,
    cached_hidden,
)
from headway.train.methods import build_method, feature_layers
from headway.train.packed_features import collate_cached
from tests.launching import accelerate_launch
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

REPLIES = ("It is four.", "Hello! How can I help you today?", "The quick brown fox.", "I am fine.")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama target folder (vocab 400, ChatML) and a 24-conversation data file."""
    root = tmp_path_factory.mktemp("train")
    tiny_model("llama", vocab_size=400).save_pretrained(root / "target")
    smollm2_tokenizer().save_pretrained(root / "target")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}: what is two plus two?"},
                {"role": "assistant", "content": REPLIES[i % len(REPLIES)] * (1 + i % 3)},
            ]
        }
        for i in range(24)
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    return root


def config_for(workspace: Path, run: str, *overrides: str) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            f"target.name={workspace / 'target'}",
            "target.device=cpu",
            f"data.sources={workspace / 'chat.jsonl'}",
            "data.max_length=64",
            "data.eval_fraction=0.2",
            f"train.output_dir={workspace / run}",
            "train.lr=1e-2",
            "train.warmup_steps=1",
            "train.max_steps=6",
            "train.batch_size=4",
            "train.eval_every=3",
            "train.save_every=3",
            "medusa.num_heads=2",
            *overrides,
        ],
    )


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def train_stopped_at_step_three(config: RunConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Train ``config`` until the checkpoint of step 3, then stop it there (mid-epoch)."""

    def stop_at_step_three(progress: loop.Progress) -> None:
        if progress.step == 3:
            raise KeyboardInterrupt  # the run is stopped right after a checkpoint

    monkeypatch.setattr(loop, "after_checkpoint", stop_at_step_three)
    with pytest.raises(KeyboardInterrupt):
        loop.train(config)
    monkeypatch.setattr(loop, "after_checkpoint", lambda progress: None)


def assert_same_weights(expected_run: Path, actual_run: Path) -> None:
    """The two runs saved bit-identical weights under the same names."""
    expected, actual = weights(expected_run), weights(actual_run)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)


def test_training_saves_heads_checkpoints_eval_and_summary(
    workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="headway.train.loop"):
        run_dir = loop.train(config_for(workspace, "basic", "train.max_steps=12"))
    # 24 samples, 5 held out (data.eval_fraction 0.2): what the steps take of the other 19
    assert "12 steps x 4 x 1 accumulated x 1 process = 48 samples: 2.53 passes over the 19 " in (
        caplog.text
    )
    assert (run_dir / "config.json").is_file() and weights(run_dir)
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == [
        "step-0000009",
        "step-0000012",
    ]  # only the last two are kept
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in evals] == [3, 6, 9, 12]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]  # it learns the repeated replies
    summary = json.loads((run_dir / "training_summary.json").read_text())
    assert summary["num_processes"] == 1 and summary["peak_memory_mb_per_process"][0] > 0


def test_eval_log_drops_the_rows_a_resumed_run_redoes(tmp_path: Path) -> None:
    log = tmp_path / "eval.jsonl"
    for step in (2, 4, 6):
        record_eval(log, {"step": step, "eval/loss": 1.0})
    record_eval(log, {"step": 4, "eval/loss": 0.5})  # resumed from the step-3 checkpoint
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(row["step"], row["eval/loss"]) for row in rows] == [(2, 1.0), (4, 0.5)]


@pytest.mark.parametrize(
    "method",
    [
        ["train.method=medusa1"],
        # EAGLE-1's feature noise draws from the global RNG in every step.
        ["train.method=eagle1", "eagle.feature_noise=0.2"],
    ],
    ids=["medusa1", "eagle1-noise"],
)
def test_resume_after_stop_reproduces_uninterrupted_weights(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, method: list[str]
) -> None:
    name = method[0].split("=")[1]
    uninterrupted = loop.train(config_for(workspace, f"full-{name}", *method))
    train_stopped_at_step_three(config_for(workspace, f"stopped-{name}", *method), monkeypatch)
    with pytest.raises(loop.TrainingError, match="--resume"):
        loop.train(config_for(workspace, f"stopped-{name}", *method))
    resumed = loop.train(config_for(workspace, f"stopped-{name}", *method), resume=True)
    assert_same_weights(uninterrupted, resumed)


def test_online_and_offline_features_give_the_same_loss(workspace: Path, tmp_path: Path) -> None:
    config = config_for(workspace, "unused")
    target = load_target(workspace / "target", device="cpu")
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    dataset = dataset.select_columns(["input_ids", "loss_mask"])
    method = build_method(config, target)
    layers = feature_layers(method)
    manifest = cache_features(
        target.model,
        dataset,
        tmp_path / "cache",
        layers=layers,
        dtype=torch.float32,
        batch_size=5,
        shard_samples=7,
        pad_token_id=pad_id_of(target.tokenizer),
    )
    assert manifest["complete"] and manifest["bytes_per_token"] > 32 * 4  # fp32 hidden of H=32
    cached = CachedFeatureDataset(tmp_path / "cache")
    rows = [dataset[i] for i in range(6)]
    pad_id = pad_id_of(target.tokenizer)
    online_batch = pad_collate(rows, pad_token_id=pad_id)
    offline_batch = collate_cached([cached[i] for i in range(6)], pad_token_id=pad_id)
    assert torch.equal(online_batch["input_ids"], offline_batch["input_ids"])
    online = method(online_batch, OnlineFeatures(target.model, layers)(online_batch))
    offline = method(offline_batch, cached_hidden(offline_batch, layers))
    torch.testing.assert_close(offline.loss, online.loss, rtol=1e-5, atol=1e-6)


def test_feature_cache_resumes_and_refuses_other_data(workspace: Path, tmp_path: Path) -> None:
    target = load_target(workspace / "target", device="cpu")
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    dataset = dataset.select_columns(["input_ids", "loss_mask"])
    first = cache_features(target.model, dataset, tmp_path / "c", layers=(2,), shard_samples=10)
    shards = sorted((tmp_path / "c").glob("shard-*"))
    assert len(shards) == 3
    shards[1].unlink()  # as if killed while writing the second shard
    second = cache_features(target.model, dataset, tmp_path / "c", layers=(2,), shard_samples=10)
    assert second["bytes"] == first["bytes"]
    fresh = tmp_path / "fresh"
    cache_features(target.model, dataset, fresh, layers=(2,), shard_samples=10)
    for shard in shards:  # the resumed cache is byte-identical to an uninterrupted one
        assert shard.read_bytes() == (fresh / shard.name).read_bytes()
    from headway.errors import DataError

    with pytest.raises(DataError, match="other data"):
        cache_features(target.model, dataset.select(range(5)), tmp_path / "c", layers=(2,))


def test_two_processes_train_one_model(workspace: Path, tmp_path: Path) -> None:
    config = config_for(workspace, "ddp")
    recipe = tmp_path / "ddp.yaml"
    import yaml

    from headway.config import to_dict

    recipe.write_text(yaml.safe_dump(to_dict(config)), encoding="utf-8")
    accelerate_launch(["-m", "headway.train", "--config", str(recipe)], processes=2)
    summary = json.loads((workspace / "ddp" / "training_summary.json").read_text())
    assert summary["num_processes"] == 2
    first, second = summary["param_checksum_per_process"]
    assert first == second  # both processes hold the same trained weights: one model
