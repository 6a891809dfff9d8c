"""``data.pack: true`` is real (issue #13, item 3): the loop trains packed blocks (positions
restarting per sample, attention inside each sample), and for every method the loss of packed
samples equals the loss of the same samples padded."""

from __future__ import annotations

import json
from collections.abc import Sized
from pathlib import Path

import pytest
import torch

from headway.config import load_config
from headway.run_config import RunConfig
from headway.target import Target, load_target
from headway.train.batching import pack, pad_collate
from headway.train.data import build_dataset, pad_id_of
from headway.train.features import OnlineFeatures
from headway.train.loop_data import training_data
from headway.train.methods import build_method, feature_layers
from tests.test_eagle3 import tiny4
from tests.tokenizers_fixture import smollm2_tokenizer

ANSWERS = ("It is four.", "Hello! How can I help?", "The quick brown fox.", "Fine, thanks.")
METHODS = {
    "medusa1": ["medusa.num_heads=3"],
    "medusa2": ["medusa.num_heads=2", "medusa.lora_r=4", "medusa.lora_alpha=8"],
    "eagle1": [],
    "eagle3": ["eagle3.draft_vocab_size=64", "eagle3.ttt_steps=3"],
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 4-layer Llama (vocab 400, ChatML) and 24 conversations of varied length. Its LM
    head is scaled x30 so its distributions are peaked: a loss computed on the wrong hidden
    states (attention across samples, wrong positions) then moves visibly."""
    root = tmp_path_factory.mktemp("packing")
    target = tiny4("llama", vocab_size=400)
    target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach() * 30.0)
    target.save_pretrained(root / "target")
    smollm2_tokenizer().save_pretrained(root / "target")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}: " + "what is two plus two? " * (i % 3)},
                {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)] * (1 + (i * 7) % 11)},
            ]
        }
        for i in range(24)
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    return root


def config(workspace: Path, method: str, *overrides: str) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            f"target.name={workspace / 'target'}",
            f"data.sources={workspace / 'chat.jsonl'}",
            "data.max_length=128",
            f"train.method={method}",
            *METHODS[method],
            *overrides,
        ],
    )


def test_loop_trains_packed_blocks_when_asked(workspace: Path) -> None:
    """Fails if data.pack is silently ignored: more trained tokens per row, little padding."""
    target = load_target(workspace / "target", device="cpu")
    seen = {}
    for packed in (False, True):
        train_set, _, collate = training_data(
            config(workspace, "medusa1", f"data.pack={packed}", "data.max_length=512"), target
        )
        assert isinstance(train_set, Sized)
        batch = collate([train_set[i] for i in range(len(train_set))])
        fours = [collate([train_set[i] for i in range(j, min(j + 4, len(train_set)))])
                 for j in range(0, len(train_set), 4)]  # fmt: skip
        slots = sum(b["attention_mask"].numel() for b in fours)
        seen[packed] = {
            "rows": batch["input_ids"].shape[0],
            "trained_per_row": float(batch["loss_mask"].sum()) / batch["input_ids"].shape[0],
            "padding": 1 - sum(float(b["attention_mask"].sum()) for b in fours) / slots,
            "packed": "document_ids" in batch,
        }
    assert seen[True]["packed"] and not seen[False]["packed"]
    assert seen[True]["rows"] < seen[False]["rows"] / 2
    assert seen[True]["trained_per_row"] > 2 * seen[False]["trained_per_row"]
    assert seen[True]["padding"] < seen[False]["padding"]


@pytest.mark.parametrize("method", list(METHODS))
def test_packed_loss_equals_padded_loss(workspace: Path, method: str) -> None:
    target: Target = load_target(workspace / "target", device="cpu")
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=128)
    samples = [dataset[i] for i in range(6)]
    pad_id = pad_id_of(target.tokenizer)
    padded = pad_collate(samples, pad_token_id=pad_id)
    blocks = pack(samples, block_length=256, pad_token_id=pad_id)
    packed = pad_collate([blocks[i] for i in range(len(blocks))], pad_token_id=pad_id)
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]  # really packed
    torch.manual_seed(0)
    loss_fn = build_method(config(workspace, method), target).eval()
    features = OnlineFeatures(target.model, feature_layers(loss_fn))
    with torch.no_grad():
        from_padded = loss_fn(padded, features(padded))
        from_packed = loss_fn(packed, features(packed))
    torch.testing.assert_close(from_packed.loss, from_padded.loss, rtol=2e-6, atol=1e-6)
    for key, value in from_padded.metrics.items():
        if key.endswith("tokens"):  # the same positions are trained
            assert from_packed.metrics[key] == value, key


def test_medusa_loss_never_trains_a_label_from_the_next_sample() -> None:
    """Text samples train every token, so a label past a sample's end would be counted: the
    fast loss must equal the reference loop, and both must skip those labels."""
    from headway.train.losses import medusa_loss, medusa_loss_reference

    torch.manual_seed(0)
    logits = torch.randn(2, 1, 10, 7)
    ids = torch.randint(0, 7, (1, 10))
    loss_mask = torch.ones(1, 10, dtype=torch.long)
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    fast = medusa_loss(logits, ids, loss_mask, document_ids=documents)
    slow = medusa_loss_reference(logits, ids, loss_mask, document_ids=documents)
    torch.testing.assert_close(fast.loss, slow.loss)
    # head 1 (label 2 ahead): positions 0-1 and 4-7 -> 6 labels; head 2 (3 ahead): 0, 4-6 -> 4.
    assert (fast.metrics["head1/tokens"], fast.metrics["head2/tokens"]) == (6.0, 4.0)
    assert slow.metrics == pytest.approx(fast.metrics)


def test_online_features_under_bf16_autocast_are_close_and_fp32(workspace: Path) -> None:
    """train.mixed_precision=bf16 covers the target's forward: fp32 features, bf16 rounding."""
    target = load_target(workspace / "target", device="cpu")
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    batch = pad_collate([dataset[i] for i in range(3)], pad_token_id=pad_id_of(target.tokenizer))
    exact = OnlineFeatures(target.model, (2, 4))(batch)
    fast = OnlineFeatures(target.model, (2, 4), autocast=torch.bfloat16)(batch)
    plain = target.model(**{k: batch[k] for k in ("input_ids", "attention_mask")},
                         output_hidden_states=True).hidden_states  # fmt: skip
    for layer in (2, 4):
        torch.testing.assert_close(exact[layer], plain[layer])  # one LM-head row changes nothing
        assert fast[layer].dtype == torch.float32
        torch.testing.assert_close(fast[layer], exact[layer], rtol=0.05, atol=0.05)
        assert not torch.equal(fast[layer], exact[layer])  # it really ran in bf16
