"""The EAGLE-1 draft model, its loss and its training method.

The loss is checked on hand-made features whose right answer is known (row t must be compared with
feature t + 1), the fast loss against its slow reference, and the method through the real
training loop on a tiny target (the held-out loss must go down)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.config import load_config
from headway.errors import ConfigError
from headway.heads.eagle import EagleConfig, EagleModel, TargetHead, additive_mask
from headway.run_config import EagleSection, RunConfig
from headway.target import load_target
from headway.train import loop
from headway.train.data import build_dataset, pad_collate, pad_id_of
from headway.train.features import (
    CachedFeatureDataset,
    OnlineFeatures,
    cache_features,
    cached_hidden,
)
from headway.train.losses_eagle import eagle_loss, eagle_loss_reference, eagle_rows
from headway.train.method_eagle import Eagle1, add_uniform_noise
from headway.train.methods import build_method
from headway.train.packed_features import collate_cached
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

REFERENCE_NAMES = [
    "fc.bias",
    "fc.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.v_proj.weight",
]


def causal(length: int) -> Tensor:
    return additive_mask(torch.ones(length, length, dtype=torch.bool).tril(), torch.float32)[
        None, None
    ]


# ------------------------------------------------------------------------------ draft model


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_forward_shapes_and_loss_on_every_family(family: str) -> None:
    model: Any = tiny_model(family)
    config = EagleConfig.from_target(model)
    assert (config.hidden_size, config.vocab_size) == (32, TINY_VOCAB)
    draft = EagleModel(config)
    assert sorted(draft.state_dict()) == REFERENCE_NAMES  # no embed_tokens, lm_head, input norm
    assert isinstance(draft.layers[0].input_layernorm, torch.nn.Identity)
    ids = torch.randint(3, TINY_VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = model(ids, output_hidden_states=True).hidden_states[2]
    head = TargetHead.of(model)
    predicted = draft(
        features,
        head.embed_tokens(ids, torch.float32),
        position_ids=torch.arange(7)[None],
        attention_mask=causal(7),
    )
    assert predicted.shape == (2, 7, 32)
    output = eagle_loss(predicted, features, torch.ones(2, 7), lm_head=head.logits)
    assert output.loss.ndim == 0 and torch.isfinite(output.loss)
    assert output.metrics["tokens"] == 2 * 5  # rows 0..4 draft x2..x6
    some = torch.tensor([5, 0, TINY_VOCAB - 1, 7])  # a head over some columns: those columns
    torch.testing.assert_close(head.logits(features, some), head.logits(features)[..., some])


def test_forward_is_causal_and_a_cache_gives_the_same_rows() -> None:
    torch.manual_seed(0)
    draft = EagleModel(EagleConfig(32, 64, 4, 2, 8, TINY_VOCAB))
    features, embeddings = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    positions = torch.arange(6)[None]
    full = draft(features, embeddings, position_ids=positions, attention_mask=causal(6))
    changed = features.clone()
    changed[0, 4:] += 1.0
    other = draft(changed, embeddings, position_ids=positions, attention_mask=causal(6))
    torch.testing.assert_close(other[0, :4], full[0, :4])  # later pairs never leak backwards
    assert not torch.allclose(other[0, 4:], full[0, 4:])
    cache = draft.new_cache()  # the default mask is causal over the cache and the new rows
    first = draft(features[:, :4], embeddings[:, :4], cache=cache)
    rest = draft(features[:, 4:], embeddings[:, 4:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(draft(features, embeddings), full)


def test_a_padding_mask_keeps_padded_rows_out() -> None:
    torch.manual_seed(0)
    draft = EagleModel(EagleConfig(32, 64, 4, 2, 8, TINY_VOCAB))
    features, embeddings = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    features[1, 4:] = 100.0  # padding garbage must not leak into the real rows
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    both = draft(features, embeddings, attention_mask=padding)
    alone = draft(features[1:, :4], embeddings[1:, :4])
    torch.testing.assert_close(both[1, :4], alone[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(both[0], draft(features[:1], embeddings[:1])[0])
    assert torch.isfinite(both).all()
    with pytest.raises(ValueError, match="empty cache"):
        cache = draft.new_cache()
        draft(features, embeddings, cache=cache)
        draft(features, embeddings, attention_mask=padding, cache=cache)


def test_config_round_trip_and_validation() -> None:
    config = EagleConfig.from_target(tiny_model("gpt2"), fc_bias=False)
    assert config.intermediate_size == 4 * 32 and config.num_key_value_heads == 4
    assert EagleConfig.from_dict(config.to_dict()) == config
    assert "fc.bias" not in EagleModel(config).state_dict()
    with pytest.raises(ValueError, match="unknown keys"):
        EagleConfig.from_dict({**config.to_dict(), "typo": 1})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        EagleConfig(32, 64, 4, 3, 8, TINY_VOCAB)


# ------------------------------------------------------------------------------ the loss

HIDDEN, VOCAB = 8, 12


def sharp_head(scale: float = 50.0) -> Any:
    """A fixed LM head ``[V, H]``: large logits, so the target distribution is almost one-hot."""
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3)) * scale
    return lambda features: features @ weight.T


def hand_made(batch: int = 2, length: int = 7) -> Tensor:
    return torch.randn(batch, length, HIDDEN, generator=torch.Generator().manual_seed(1))


def perfect(features: Tensor) -> Tensor:
    """Row t = f_{t+1} (the last row repeats f_{T-1}; it is never used)."""
    return torch.cat([features[:, 1:], features[:, -1:]], dim=1)


def test_perfect_prediction_gives_zero_loss_and_a_shift_gives_a_large_one() -> None:
    features, mask = hand_made(), torch.ones(2, 7)
    head = sharp_head()
    right = eagle_loss(perfect(features), features, mask, lm_head=head)
    assert right.metrics["feature_loss"] == 0.0 and right.metrics["feature_l1"] == 0.0
    assert right.loss.item() == pytest.approx(0.0, abs=1e-4)  # CE = target entropy ~ 0
    assert right.metrics["depth1/top1"] == 1.0
    unshifted = eagle_loss(features, features, mask, lm_head=head)  # predicts f_t, not f_{t+1}
    two_ahead = eagle_loss(torch.roll(features, -2, dims=1), features, mask, lm_head=head)
    for wrong in (unshifted, two_ahead):
        assert wrong.loss.item() > 10.0
        assert wrong.metrics["feature_loss"] > 0.3
        assert wrong.metrics["depth1/top1"] < 0.5


def test_soft_cross_entropy_is_the_target_entropy_at_a_perfect_prediction() -> None:
    features, mask = hand_made(), torch.ones(2, 7)
    head = sharp_head(scale=0.5)  # a soft head: the entropy is far from 0
    output = eagle_loss(perfect(features), features, mask, lm_head=head, ce_weight=0.1)
    p = torch.softmax(head(features[:, 1:]), -1)
    entropy = -(p * p.log()).sum(-1)[:, :5].mean()  # rows 0..4 (offset 2)
    assert output.metrics["ce"] == pytest.approx(float(entropy), rel=1e-5)
    assert output.loss.item() == pytest.approx(0.1 * float(entropy), rel=1e-5)


def test_trained_rows_follow_the_mask_offset() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    assert eagle_rows(mask, 2).tolist() == [[True, True, True, False, False]]  # drafted token
    assert eagle_rows(mask, 1).tolist() == [[False, True, True, True, False]]
    assert eagle_rows(mask, 0).tolist() == [[False, False, True, True, True]]  # the reference's
    features = hand_made(1, 6)
    predicted = perfect(features)
    predicted[0, 3] += 5.0  # row 3 drafts x5, which is not a trained token: it must not count
    assert eagle_loss(predicted, features, mask, lm_head=sharp_head()).metrics["feature_loss"] == 0
    predicted[0, 2] += 5.0  # row 2 drafts x4, a trained token
    assert eagle_loss(predicted, features, mask, lm_head=sharp_head()).metrics["feature_loss"] > 0
    with pytest.raises(ValueError, match="mask_offset"):
        eagle_loss(predicted, features, mask, lm_head=sharp_head(), mask_offset=3)


@pytest.mark.parametrize("mask_offset", [0, 1, 2])
@pytest.mark.parametrize("length", [1, 2, 9])
def test_fast_loss_equals_the_reference(mask_offset: int, length: int) -> None:
    generator = torch.Generator().manual_seed(length)
    features = torch.randn(3, length, HIDDEN, generator=generator)
    predicted = features + 0.7 * torch.randn(3, length, HIDDEN, generator=generator)
    predicted.requires_grad_(True)
    mask = torch.randint(0, 2, (3, length), generator=generator)
    head = sharp_head(scale=1.0)
    fast = eagle_loss(predicted, features, mask, lm_head=head, mask_offset=mask_offset)
    slow = eagle_loss_reference(predicted, features, mask, lm_head=head, mask_offset=mask_offset)
    torch.testing.assert_close(fast.loss, slow.loss, rtol=1e-5, atol=1e-6)
    assert fast.metrics.keys() == slow.metrics.keys()
    for name, value in fast.metrics.items():
        assert value == pytest.approx(slow.metrics[name], rel=1e-5, abs=1e-6), name
    fast.loss.backward()  # also with no trained row: the graph exists, the gradient is 0
    assert predicted.grad is not None


def test_noise_is_uniform_bounded_and_zero_amplitude_is_identity() -> None:
    torch.manual_seed(0)
    features = torch.zeros(4, 50, 32)
    noisy = add_uniform_noise(features, 0.1)
    assert float(noisy.abs().max()) <= 0.1 and float(noisy.abs().max()) > 0.09
    assert abs(float(noisy.mean())) < 0.005 and float(noisy.std()) == pytest.approx(
        0.1 / 3**0.5, rel=0.05
    )
    assert add_uniform_noise(features, 0.0) is features


# ------------------------------------------------------------------------------ the method

REPLIES = ("It is four.", "Hello! How can I help you today?", "The quick brown fox.", "I am fine.")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama target folder (vocab 400, ChatML) and a 24-conversation data file."""
    root = tmp_path_factory.mktemp("eagle")
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
            "train.method=eagle1",
            f"train.output_dir={workspace / run}",
            "train.lr=1e-2",
            "train.warmup_steps=2",
            "train.max_steps=24",
            "train.batch_size=4",
            "train.eval_every=4",
            "train.save_every=24",
            *overrides,
        ],
    )


def test_eagle_section_is_validated() -> None:
    assert EagleSection().ce_loss_weight == 0.1 and EagleSection().fc_bias is True
    config = load_config(RunConfig, None, ["eagle.fc_bias=false", "eagle.feature_noise=0"])
    assert config.eagle.fc_bias is False and config.eagle.feature_noise == 0.0
    for override, message in [
        ("eagle.feature_noise=-1", "feature_noise"),
        ("eagle.ce_loss_weight=-0.1", "must be >= 0"),
        ("eagle.fc_biass=true", "did you mean 'eagle.fc_bias'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(RunConfig, None, [override])
    with pytest.raises(ConfigError, match="both 0"):
        EagleSection(feature_loss_weight=0, ce_loss_weight=0)


def test_method_trains_only_the_draft_and_reads_online_or_offline_features(
    workspace: Path, tmp_path: Path
) -> None:
    config = config_for(workspace, "unused")
    target = load_target(workspace / "target", device="cpu")
    method = build_method(config, target)
    assert isinstance(method, Eagle1)
    target_params = {id(p) for p in target.model.parameters()}
    assert not target_params & {id(p) for p in method.parameters()}  # embed / lm_head borrowed
    head_config, state = method.export()
    assert sorted(state) == REFERENCE_NAMES and head_config["vocab_size"] == 400
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    dataset = dataset.select_columns(["input_ids", "loss_mask"])
    layers = tuple(method.feature_layers)
    cache_features(target.model, dataset, tmp_path / "cache", layers=layers, dtype=torch.float32,
                   pad_token_id=pad_id_of(target.tokenizer))  # fmt: skip
    cached = CachedFeatureDataset(tmp_path / "cache")
    pad_id = pad_id_of(target.tokenizer)
    online_batch = pad_collate([dataset[i] for i in range(5)], pad_token_id=pad_id)
    offline_batch = collate_cached([cached[i] for i in range(5)], pad_token_id=pad_id)
    method.eval()  # no feature noise: both sources must give the same loss
    online = method(online_batch, OnlineFeatures(target.model, layers)(online_batch))
    offline = method(offline_batch, cached_hidden(offline_batch, layers))
    torch.testing.assert_close(offline.loss, online.loss, rtol=1e-5, atol=1e-6)
    method.train()
    torch.manual_seed(0)
    noisy = method(online_batch, OnlineFeatures(target.model, layers)(online_batch))
    assert noisy.loss.item() != pytest.approx(online.loss.item(), rel=1e-6)


def test_method_pairs_each_feature_with_the_next_token(workspace: Path) -> None:
    """The method's loss is the loss of the draft model run on (f_t, embedding of x_{t+1}) at
    position t, the pairing the drafter uses at inference (tests/test_eagle_drafter.py)."""
    target = load_target(workspace / "target", device="cpu")
    method = build_method(config_for(workspace, "unused"), target).eval()
    assert isinstance(method, Eagle1)
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    batch = pad_collate([dataset[3]], pad_token_id=pad_id_of(target.tokenizer))
    layer = method.feature_layers[0]
    features = OnlineFeatures(target.model, (layer,))(batch)[layer]
    ids, length = batch["input_ids"], batch["input_ids"].shape[1]
    head = TargetHead.of(target.model)
    next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # row T-1 has no x_T: never used
    with torch.no_grad():
        predicted = method.draft(
            features,
            head.embed_tokens(next_ids, torch.float32),
            position_ids=torch.arange(length)[None],
            attention_mask=causal(length),
        )
        expected = eagle_loss(predicted, features, batch["loss_mask"], lm_head=head.logits)
        actual = method(batch, {layer: features})
    assert actual.metrics["tokens"] == expected.metrics["tokens"] > 0
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-5, atol=1e-6)


def test_a_packed_block_gives_the_loss_of_its_samples_padded(workspace: Path) -> None:
    """Two samples packed into one block (document mask, restarting positions) score exactly like
    the same two samples in a right-padded batch."""
    config = config_for(workspace, "unused")
    target = load_target(workspace / "target", device="cpu")
    method = build_method(config, target).eval()
    assert isinstance(method, Eagle1)
    dataset, _ = build_dataset(target.tokenizer, workspace / "chat.jsonl", max_length=64)
    rows = [dataset[i] for i in (0, 1)]
    padded = pad_collate(rows, pad_token_id=pad_id_of(target.tokenizer))
    layer = method.feature_layers[0]
    hidden = OnlineFeatures(target.model, (layer,))(padded)[layer]
    lengths = [len(row["input_ids"]) for row in rows]
    packed = {
        "input_ids": torch.cat([padded["input_ids"][i, :n] for i, n in enumerate(lengths)])[None],
        "loss_mask": torch.cat([padded["loss_mask"][i, :n] for i, n in enumerate(lengths)])[None],
        "attention_mask": torch.ones(1, sum(lengths), dtype=torch.long),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
    }
    packed_hidden = torch.cat([hidden[i, :n] for i, n in enumerate(lengths)])[None]
    together = method(packed, {layer: packed_hidden})
    apart = method(padded, {layer: hidden})
    assert together.metrics["tokens"] == apart.metrics["tokens"] > 0
    torch.testing.assert_close(together.loss, apart.loss, rtol=1e-5, atol=1e-6)


def test_training_through_the_loop_lowers_the_eval_loss(workspace: Path) -> None:
    run_dir = loop.train(config_for(workspace, "eagle-run"))
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in evals] == [4, 8, 12, 16, 20, 24]
    first, last = evals[0], evals[-1]
    assert last["eval/loss"] < 0.9 * first["eval/loss"]
    assert last["eval/feature_l1"] < 0.75 * first["eval/feature_l1"]
    assert last["eval/depth1/top1"] > first["eval/depth1/top1"] + 0.3  # drafts the target's argmax
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["method"] == "eagle1" and saved["head_config"]["fc_bias"] is True
