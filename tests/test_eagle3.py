"""EAGLE-3: the draft model on every tiny family, training-time test against a slow per-row
recompute, the loss against its slow reference and on hand-made states whose right answer is
known (training through the real loop: tests/test_eagle3_training.py; decoding:
tests/test_eagle3_decode.py).
Targets have 4 layers so that three distinct feature layers exist."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from headway.config import load_config
from headway.decode.grouped_attention import PACKED
from headway.errors import ConfigError, TargetError
from headway.heads.eagle3 import Eagle3Config, Eagle3Model, default_feature_layers
from headway.heads.vocab import DraftVocab, choose_vocab, token_counts
from headway.run_config import RunConfig
from headway.target import Target
from headway.train.batching import document_attention_mask
from headway.train.losses_eagle import eagle3_loss, eagle3_loss_reference
from headway.train.method_eagle3 import Eagle3, ttt_attention_mask, ttt_unroll, ttt_unroll_reference
from tests.test_generate import hf_greedy
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_config

PROMPT = torch.tensor([1, 5, 17, 33, 8, 40, 41, 9])
NEW_TOKENS = 32
TAPS = (1, 2, 3)  # default_feature_layers(4)
CHAIN: dict[str, Any] = {"top_k": 1, "depth": 4, "total_tokens": 5}
TREE: dict[str, Any] = {"top_k": 4, "depth": 4, "total_tokens": 12}
ENGINE_NAMES = sorted(
    [
        "fc.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    ]
)


def tiny4(family: str, *, seed: int = 0, vocab_size: int = TINY_VOCAB) -> Any:
    """A tiny random 4-layer target of ``family`` (tests/tiny.py's config, two more layers)."""
    config = tiny_config(family, vocab_size=vocab_size)
    config.num_hidden_layers = 4
    if getattr(config, "layer_types", None) is not None:  # Qwen2 lists one type per layer
        config.layer_types = [config.layer_types[0]] * 4
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def hidden_states(model: Any, ids: Tensor) -> tuple[Tensor, ...]:
    with torch.no_grad():
        return tuple(model(ids, output_hidden_states=True).hidden_states)


def method_for(model: Any, vocab: DraftVocab, *overrides: str) -> Eagle3:
    config = load_config(RunConfig, None, [f"eagle3.draft_vocab_size={vocab.size}", *overrides])
    return Eagle3(config, Target(model, None, "tiny"), vocab=vocab)  # type: ignore[arg-type]


def fit_method(model: Any, sequences: Tensor, *, steps: int = 150, size: int = 64) -> Eagle3:
    """Briefly train an EAGLE-3 method on ``sequences`` ``[B, T]`` (every token trained)."""
    torch.manual_seed(0)
    vocab = choose_vocab(
        token_counts([(s, torch.ones_like(s)) for s in sequences], TINY_VOCAB), size
    )
    method = method_for(model, vocab, "eagle3.ttt_steps=3")
    batch = {
        "input_ids": sequences,
        "attention_mask": torch.ones_like(sequences),
        "loss_mask": torch.ones_like(sequences),
    }
    states = hidden_states(model, sequences)
    hidden = {layer: states[layer] for layer in method.feature_layers}
    optimizer = torch.optim.Adam(method.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = method(batch, hidden).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return method.eval()


@cache
def target_and_truth(family: str) -> tuple[Any, list[int]]:
    model = tiny4(family)
    return model, hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)


@cache
def trained(family: str) -> Eagle3Model:
    model, truth = target_and_truth(family)
    return fit_method(model, torch.cat([PROMPT, torch.tensor(truth)])[None]).draft


def random_draft(
    model: Any, vocab: DraftVocab | None = None, seed: int = 1, attention: str = "sdpa"
) -> Eagle3Model:
    torch.manual_seed(seed)
    vocab = vocab or DraftVocab.identity(64, TINY_VOCAB)
    config = Eagle3Config.from_target(model, draft_vocab_size=vocab.size)
    draft = Eagle3Model(config, attn_implementation=attention)
    draft.set_vocab(vocab)
    return draft.eval()


# ------------------------------------------------------------------------------ draft model


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_forward_shapes_and_loss_on_every_family(family: str) -> None:
    model = tiny4(family)
    method = method_for(model, DraftVocab.from_target_ids(range(10, 74), TINY_VOCAB))
    config = method.head_config
    assert config.feature_layers == TAPS and method.feature_layers == (*TAPS, 4)
    assert (config.hidden_size, config.vocab_size, config.draft_vocab_size) == (32, 96, 64)
    shapes = {k: tuple(v.shape) for k, v in method.draft.state_dict().items()}
    assert sorted(shapes) == ENGINE_NAMES
    assert method.draft.llama_config._attn_implementation == PACKED  # training attention
    assert shapes["fc.weight"] == (32, 96) and shapes["lm_head.weight"] == (64, 32)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (32, 64)  # 4 heads x 8, input 2H
    assert shapes["midlayer.self_attn.k_proj.weight"][1] == 64
    assert shapes["d2t"] == (64,) and shapes["t2d"] == (96,)
    ids = torch.randint(3, TINY_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    states = hidden_states(model, ids)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": ids >= 0}
    output = method(batch, {layer: states[layer] for layer in method.feature_layers})
    assert output.loss.ndim == 0 and torch.isfinite(output.loss)
    assert output.metrics["depth1/tokens"] + output.metrics["depth7/tokens"] > 0
    output.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in method.draft.parameters())
    rows = model.get_output_embeddings().weight.detach()[10:74]  # the head starts from the
    assert torch.equal(method_for(model, method.draft.vocab).draft.lm_head.weight, rows)  # target's
    random_head = method_for(model, method.draft.vocab, "eagle3.lm_head_init=random")
    assert not torch.equal(random_head.draft.lm_head.weight, rows)


def test_feature_layers_and_config_validation() -> None:
    assert default_feature_layers(30) == (2, 15, 27)  # SmolLM2: the reference's 2, L//2, L-3
    assert default_feature_layers(7) == (2, 3, 4) and default_feature_layers(4) == TAPS
    with pytest.raises(TargetError, match="at least 4 layers"):
        default_feature_layers(3)
    config = Eagle3Config.from_target(tiny4("gpt2"), draft_vocab_size=500)
    assert config.draft_vocab_size == TINY_VOCAB  # capped at the target vocabulary
    assert config.intermediate_size == 4 * 32  # GPT-2's MLP width
    assert Eagle3Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for bad in [(3, 2, 1), (0, 1, 2), (1, 1, 2), (1, 2)]:
        with pytest.raises(ValueError, match="feature_layers"):
            Eagle3Config.from_dict({**config.to_dict(), "feature_layers": list(bad)})
    with pytest.raises(TargetError, match="inputs of the target's layers"):
        Eagle3Config.from_target(tiny4("llama"), draft_vocab_size=8, feature_layers=(1, 2, 4))
    with pytest.raises(ValueError, match="unknown keys"):
        Eagle3Config.from_dict({**config.to_dict(), "typo": 1})
    with pytest.raises(ConfigError, match="three increasing"):
        load_config(RunConfig, None, ["eagle3.feature_layers=1,2"])


# ------------------------------------------------------------------------------ training-time test


def test_ttt_mask_is_the_documented_pattern() -> None:
    visible = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    mask = ttt_attention_mask(visible, 2, torch.float32)[0, 0] == 0
    expected = [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    assert mask.int().tolist() == expected
    assert ttt_attention_mask(visible, 0, torch.float32).shape == (1, 1, 3, 3)


def test_ttt_unroll_equals_decoding_every_row_from_scratch() -> None:
    draft = random_draft(tiny4("llama"))
    generator = torch.Generator().manual_seed(3)
    fused, embeddings = (
        torch.randn(1, 9, 32, generator=generator),
        torch.randn(1, 9, 32, generator=generator),
    )
    visible = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        fast = ttt_unroll(
            draft, fused, embeddings, positions=torch.arange(9)[None], visible=visible, steps=4
        )
        slow = ttt_unroll_reference(draft, fused, embeddings, 4)
    for step, (got, want) in enumerate(zip(fast, slow, strict=True)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=f"step {step}")
    assert not torch.allclose(fast[1], fast[0])  # the steps really differ


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_ttt_rows_of_a_batch_equal_each_sample_alone(layout: str) -> None:
    """Padding and packed samples never leak into a row whose inputs lie inside its sample."""
    draft = random_draft(tiny4("qwen2"))
    generator = torch.Generator().manual_seed(4)
    fused, embeddings = (
        torch.randn(2, 9, 32, generator=generator),
        torch.randn(2, 9, 32, generator=generator),
    )
    if layout == "padded":
        documents = torch.tensor([[0] * 9, [0] * 6 + [-1] * 3])
        positions = torch.arange(9)[None]
        samples = [(0, 0, 9), (1, 0, 6)]  # (batch row, start, length)
    else:
        documents = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3], list(range(9))])
        samples = [(0, 0, 5), (0, 5, 4), (1, 0, 9)]
    visible = document_attention_mask(documents)
    with torch.no_grad():
        fast = ttt_unroll(draft, fused, embeddings, positions=positions, visible=visible, steps=3)
        for row, start, length in samples:
            part = slice(start, start + length)
            alone = ttt_unroll_reference(
                draft, fused[row : row + 1, part], embeddings[row : row + 1, part], 3
            )
            for step in range(3):
                inside = length - step - 1  # rows whose tokens x_{t+1 .. t+step+1} are inside
                torch.testing.assert_close(
                    fast[step][row, start : start + inside],
                    alone[step][0, :inside],
                    atol=2e-6,
                    rtol=1e-5,
                )


@pytest.mark.parametrize(
    ("chunk", "attention"), [(2, "sdpa"), (3, "sdpa"), (128, "sdpa"), (3, PACKED)]
)
def test_ttt_unroll_of_kept_rows_equals_the_full_unroll(chunk: int, attention: str) -> None:
    """Steps >= 1 on the kept rows only (in chunks, batch rows keeping different counts) give
    those rows the full unroll's states and gradients; rows left out are zeros. The packed
    attention training uses (grouped heads read once) gives the stock sdpa's full unroll."""
    draft = random_draft(tiny4("llama"))
    kept_draft = random_draft(tiny4("llama"), attention=attention)  # the same weights (seed)
    heads = kept_draft.llama_config
    assert int(heads.num_key_value_heads or 0) < int(heads.num_attention_heads)  # grouped
    generator = torch.Generator().manual_seed(5)
    fused = torch.randn(2, 9, 32, generator=generator, requires_grad=True)
    embeddings = torch.randn(2, 9, 32, generator=generator)
    documents = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3], list(range(9))])
    visible = document_attention_mask(documents)
    rows = torch.zeros(2, 9, dtype=torch.bool)
    rows[0, [1, 2, 6]] = True  # 3 rows, one of them in the second sample
    rows[1, 3:8] = True  # 5 rows
    weights = torch.randn(4, 2, 9, 32, generator=generator) * rows[None, ..., None]

    def unroll(kept: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        draft.zero_grad()
        fused.grad = None
        states = ttt_unroll(
            draft,
            fused,
            embeddings,
            positions=positions,
            visible=visible,
            steps=4,
            rows=kept,
            chunk=chunk,
        )
        loss = sum((s * w).sum() for s, w in zip(states, weights, strict=True))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        assert fused.grad is not None
        grads = [fused.grad.clone()] + [
            p.grad.clone() for p in draft.parameters() if p.grad is not None
        ]
        return states, grads

    full, full_grads = unroll(None)
    draft = kept_draft
    kept, kept_grads = unroll(rows)
    torch.testing.assert_close(kept[0], full[0])
    for step in range(1, 4):
        torch.testing.assert_close(kept[step][rows], full[step][rows], atol=2e-6, rtol=1e-5)
        assert not kept[step][~rows].any()
    assert len(kept_grads) == len(full_grads) > 2
    for got, want in zip(kept_grads, full_grads, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    none_kept, _ = unroll(torch.zeros(2, 9, dtype=torch.bool))
    assert all(not states.any() for states in none_kept[1:])


# ------------------------------------------------------------------------------ the loss

HIDDEN, VOCAB = 8, 12


def sharp_head(scale: float = 50.0) -> Any:
    """A fixed target LM head ``[V, H]``; large logits make its distribution almost one-hot."""
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3)) * scale
    return lambda features: features @ weight.T


def shifted(features: Tensor, offset: int) -> Tensor:
    """Row t = ``features[:, t + offset]`` (zeros past the end)."""
    pad = features.new_zeros(features.shape[0], offset, features.shape[2])
    return torch.cat([features[:, offset:], pad], dim=1)


def test_a_perfect_drafter_scores_the_entropy_and_an_off_by_one_scores_high() -> None:
    """Step j at row t must be scored against the target's distribution at t + j + 1."""
    features = torch.randn(2, 10, HIDDEN, generator=torch.Generator().manual_seed(1))
    head, full = sharp_head(), torch.arange(VOCAB)
    draft_head = head  # draft states are target features, so the draft head is the target's

    def loss(offset: int, target_ids: Tensor = full) -> Any:
        states = [shifted(features, step + offset) for step in range(4)]
        mask = torch.ones(2, 10)
        return eagle3_loss(
            states,
            features,
            mask,
            draft_logits=lambda s: draft_head(s)[:, target_ids],
            target_logits=head,
            target_ids=target_ids,
        )

    right = loss(1)
    assert right.loss.item() == pytest.approx(0.0, abs=1e-3)  # entropy of a sharp head ~ 0
    for step in range(4):
        assert right.metrics[f"depth{step + 1}/top1"] == 1.0
        assert right.metrics[f"depth{step + 1}/tokens"] == 2 * (10 - step - 2)
    for wrong in (loss(0), loss(2)):
        assert wrong.loss.item() > 10.0 and wrong.metrics["depth1/top1"] < 0.5
    subset = torch.tensor([0, 2, 3, 5, 7, 11])  # rows whose target argmax is not drafted drop out
    partial = loss(1, subset)
    argmax = head(features[:, 1:9]).argmax(-1)
    assert partial.metrics["depth1/tokens"] == int(torch.isin(argmax, subset).sum())
    assert partial.metrics["in_vocab"] == pytest.approx(
        float(torch.isin(argmax, subset).float().mean())
    )
    assert partial.loss.item() == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("packed", [False, True])
def test_fast_loss_and_gradients_equal_the_reference(packed: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    target = torch.randn(3, 11, HIDDEN, generator=generator)
    states = [torch.randn(3, 11, HIDDEN, generator=generator, requires_grad=True) for _ in range(5)]
    mask = torch.randint(0, 2, (3, 11), generator=generator)
    documents = torch.tensor([[0] * 4 + [1] * 7, [0] * 11, [0] * 6 + [-1] * 5]) if packed else None
    target_ids = torch.tensor([1, 2, 4, 5, 6, 8, 9, 10])
    draft_weight = torch.randn(8, HIDDEN, generator=generator)
    settings: dict[str, Any] = {
        "draft_logits": lambda s: s @ draft_weight.T,
        "target_logits": sharp_head(scale=1.0),
        "target_ids": target_ids,
        "decay": 0.7,
        "document_ids": documents,
    }
    fast = eagle3_loss(states, target, mask, **settings)
    slow = eagle3_loss_reference(states, target, mask, **settings)
    torch.testing.assert_close(fast.loss, slow.loss, rtol=1e-5, atol=1e-6)
    assert fast.metrics.keys() == slow.metrics.keys()
    for name, value in fast.metrics.items():
        assert value == pytest.approx(slow.metrics[name], rel=1e-5, abs=1e-6), name
    assert fast.metrics["depth1/tokens"] > 0
    fast_grads = torch.autograd.grad(fast.loss, states, allow_unused=True, materialize_grads=True)
    slow_grads = torch.autograd.grad(slow.loss, states, allow_unused=True, materialize_grads=True)
    for got, want in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ the loop
