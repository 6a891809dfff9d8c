"""EAGLE-3 training through the real loop: the eval loss falls, and offline features give the
online run's draft vocabulary and loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headway.config import load_config
from headway.decode.generate import generate
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.errors import ConfigError
from headway.heads.vocab import choose_vocab, token_counts
from headway.run_config import RunConfig
from headway.target import load_target
from headway.train import loop
from headway.train.data import build_dataset, pad_collate
from headway.train.features import (
    CachedFeatureDataset,
    OnlineFeatures,
    cache_features,
    cached_hidden,
)
from headway.train.method_eagle3 import Eagle3
from headway.train.methods import build_method
from headway.train.packed_features import collate_cached
from tests.drafting import heads_drafter as load_drafter
from tests.test_eagle3 import TAPS, TREE, tiny4
from tests.test_generate import hf_greedy
from tests.tokenizers_fixture import smollm2_tokenizer

REPLIES = ("It is four.", "Hello! How can I help you today?", "The quick brown fox.", "I am fine.")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 4-layer Llama target folder (vocab 400, ChatML) and a 24-conversation data file.
    Its LM head is scaled x30: the random target's own distributions are then peaked, so a
    drafter that learns them can bring the soft cross-entropy well below log(draft vocab)."""
    root = tmp_path_factory.mktemp("eagle3")
    target = tiny4("llama", vocab_size=400)
    target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach() * 30.0)
    target.save_pretrained(root / "target")
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


def test_training_through_the_loop_lowers_the_eval_loss(workspace: Path) -> None:
    config = load_config(
        RunConfig,
        None,
        [
            f"target.name={workspace / 'target'}",
            "target.device=cpu",
            f"data.sources={workspace / 'chat.jsonl'}",
            "data.max_length=64",
            "data.eval_fraction=0.2",
            "train.method=eagle3",
            f"train.output_dir={workspace / 'run'}",
            "train.lr=1e-2",
            "train.warmup_steps=2",
            "train.max_steps=24",
            "train.batch_size=4",
            "train.eval_every=4",
            "train.save_every=24",
            "eagle3.draft_vocab_size=256",
            "eagle3.ttt_steps=3",
        ],
    )
    run_dir = loop.train(config)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    assert last["eval/loss"] < 0.8 * first["eval/loss"]
    assert last["eval/depth1/top1"] > first["eval/depth1/top1"] + 0.2
    assert last["eval/depth3/top1"] > first["eval/depth3/top1"]  # deeper steps learn too
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["method"] == "eagle3"
    assert saved["head_config"]["feature_layers"] == list(TAPS)
    assert saved["head_config"]["draft_vocab_size"] == 256
    target = load_target(workspace / "target", device="cpu")
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    counts = token_counts(zip(dataset["input_ids"], dataset["loss_mask"], strict=True), 400)
    weights = load_file(str(run_dir / "model.safetensors"))
    assert weights["d2t"].tolist() == choose_vocab(counts, 256).d2t.tolist()  # most frequent
    assert bool(weights["t2d"][torch.nonzero(counts.trained)[:, 0]].all())  # all trained tokens
    drafter = load_drafter(run_dir, target.model, **TREE)
    assert isinstance(drafter, Eagle3Drafter) and drafter.hidden_layers == TAPS
    prompt = torch.tensor(dataset[0]["input_ids"][:12])
    truth = hf_greedy(target.model, prompt, 16, eos=None)
    result = generate(target.model, prompt, drafter=drafter, max_new_tokens=16, eos_token_ids=())
    assert result.tokens == truth


def test_offline_features_give_the_online_vocabulary_and_loss(
    workspace: Path, tmp_path: Path
) -> None:
    overrides = [
        f"target.name={workspace / 'target'}",
        f"data.sources={workspace / 'chat.jsonl'}",
        "data.max_length=64",
        "train.method=eagle3",
        "eagle3.draft_vocab_size=64",
    ]
    target = load_target(workspace / "target", device="cpu")
    torch.manual_seed(0)
    online = build_method(load_config(RunConfig, None, overrides), target)
    assert isinstance(online, Eagle3)
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    dataset = dataset.select_columns(["input_ids", "loss_mask"])
    cache_features(
        target.model,
        dataset,
        tmp_path / "cache",
        layers=online.feature_layers,
        dtype=torch.float32,
        shard_samples=10,
    )
    offline_config = [
        *overrides,
        "data.features=offline",
        f"data.features_dir={tmp_path / 'cache'}",
    ]
    torch.manual_seed(0)
    offline = build_method(load_config(RunConfig, None, offline_config), target)
    assert isinstance(offline, Eagle3)
    assert torch.equal(offline.draft.d2t, online.draft.d2t)
    batch = pad_collate([dataset[i] for i in range(5)], pad_token_id=0)
    cached = CachedFeatureDataset(tmp_path / "cache")
    offline_batch = collate_cached([cached[i] for i in range(5)], pad_token_id=0)
    layers = online.feature_layers
    with torch.no_grad():
        from_online = online(batch, OnlineFeatures(target.model, layers)(batch))
        from_offline = offline(offline_batch, cached_hidden(offline_batch, layers))
    torch.testing.assert_close(from_offline.loss, from_online.loss, rtol=1e-5, atol=1e-6)
    cache_features(target.model, dataset, tmp_path / "last", layers=(4,), shard_samples=30)
    last_only = [*overrides, "data.features=offline", f"data.features_dir={tmp_path / 'last'}"]
    with pytest.raises(ConfigError, match="--layers 1,2,3,4"):
        build_method(load_config(RunConfig, None, last_only), target)


# ------------------------------------------------------------------------------ the drafter
