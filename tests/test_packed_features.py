"""Offline features packed into blocks (``data.features=offline`` with ``data.pack=true``): the
blocks are the online packed blocks, column for column, and every method's loss on them equals
its loss with the target run online on the same blocks."""

from __future__ import annotations

from collections.abc import Sized
from pathlib import Path

import pytest
import torch

from headway.errors import DataError
from headway.target import load_target
from headway.train.batching import pack, pad_collate, plan_blocks
from headway.train.data import build_dataset, pad_id_of
from headway.train.features import (
    CachedFeatureDataset,
    OnlineFeatures,
    cache_features,
    cached_hidden,
)
from headway.train.loop_data import training_data
from headway.train.methods import build_method, feature_layers
from headway.train.packed_features import PackedFeatureDataset
from tests.test_packing import config, workspace  # noqa: F401  (the fixture)


def test_blocks_are_planned_as_pack_plans_them() -> None:
    assert plan_blocks([3, 2, 4, 1, 5], 5) == [[0, 1], [2, 3], [4]]
    assert plan_blocks([], 5) == []
    with pytest.raises(ValueError, match="sample 1 has 6 tokens"):
        plan_blocks([2, 6], 5)


@pytest.mark.parametrize("method", ["medusa1", "eagle1", "eagle3"])
def test_offline_packed_blocks_equal_online_packed_blocks(
    workspace: Path,  # noqa: F811
    tmp_path: Path,
    method: str,
) -> None:
    target = load_target(workspace / "target", device="cpu")
    pad_id = pad_id_of(target.tokenizer)
    torch.manual_seed(0)
    online = build_method(config(workspace, method), target).eval()
    layers = feature_layers(online)
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=128)
    dataset = dataset.select_columns(["input_ids", "loss_mask"])
    cache_features(target.model, dataset, tmp_path, layers=layers, dtype=torch.float32,
                   shard_samples=7, target_argmax=method == "eagle3")  # fmt: skip
    overrides = ["data.features=offline", f"data.features_dir={tmp_path}", "data.pack=true"]
    offline_config = config(workspace, method, *overrides, "data.max_length=256")
    train_set, eval_set, collate = training_data(offline_config, target)
    assert isinstance(train_set, Sized) and isinstance(eval_set, Sized)
    blocks = PackedFeatureDataset(CachedFeatureDataset(tmp_path), 256, pad_id)
    assert len(train_set) + len(eval_set) == len(blocks) < len(dataset) / 2  # really packed

    expected = pack(dataset, block_length=256, pad_token_id=pad_id)
    assert len(expected) == len(blocks)
    got = collate([blocks[i] for i in range(len(blocks))])
    want = pad_collate([expected[i] for i in range(len(expected))], pad_token_id=pad_id)
    for column, values in want.items():
        assert torch.equal(got[column], values), column
    assert ("target_argmax" in got) == (method == "eagle3")  # EAGLE-3's loss reads it below
    with torch.no_grad():
        from_online = online(want, OnlineFeatures(target.model, layers)(want))
        from_offline = online(got, cached_hidden(got, layers))
    torch.testing.assert_close(from_offline.loss, from_online.loss, rtol=1e-5, atol=1e-6)
    trained = {key: value for key, value in from_online.metrics.items() if key.endswith("tokens")}
    assert trained and all(from_offline.metrics[key] == value for key, value in trained.items())


def test_a_sample_longer_than_a_block_is_a_one_line_error(
    workspace: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    target = load_target(workspace / "target", device="cpu")
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=128)
    cache_features(target.model, dataset.select_columns(["input_ids", "loss_mask"]), tmp_path,
                   layers=(4,), dtype=torch.float32)  # fmt: skip
    longest = max(len(ids) for ids in dataset["input_ids"])
    with pytest.raises(DataError, match=rf"raise data\.max_length to {longest}"):
        PackedFeatureDataset(CachedFeatureDataset(tmp_path), longest - 1, 0)


def test_a_feature_cache_stores_the_targets_argmax(
    workspace: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Where the LM head's input is cached, each sample carries the target's own argmax (what
    EAGLE-3 then reads instead of running the head over the whole vocabulary); without the LM
    head's input, or not asked for (the other methods' caches above), not."""
    target = load_target(workspace / "target", device="cpu")
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=128)
    dataset = dataset.select_columns(["input_ids", "loss_mask"])
    depth = int(target.model.config.num_hidden_layers)
    cache_features(target.model, dataset, tmp_path / "final", layers=(1, depth),
                   dtype=torch.float32, target_argmax=True)  # fmt: skip
    cache_features(target.model, dataset, tmp_path / "inner", layers=(1,),
                   dtype=torch.float32, target_argmax=True)  # fmt: skip
    cached, inner = (
        CachedFeatureDataset(tmp_path / "final"),
        CachedFeatureDataset(tmp_path / "inner"),
    )
    assert "target_argmax" not in inner[0]
    for index in (0, len(dataset) - 1):
        ids = torch.tensor(dataset[index]["input_ids"])[None]
        with torch.no_grad():
            want = target.model(ids).logits[0].argmax(-1)
        assert torch.equal(cached[index]["target_argmax"].long(), want)
