"""The EAGLE-3 drafter: greedy output equal to transformers', draft ids mapped to target ids,
the drafts training fed it, KV rollback equal to a fresh drafter, sampling that keeps the
target's distribution (the model and its training: tests/test_eagle3.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode.generate import generate
from headway.decode.sampling import SamplingParams
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.merged import FirstDrafter
from headway.heads.eagle import TargetHead
from headway.heads.vocab import DraftVocab
from tests.test_eagle3 import (
    CHAIN,
    NEW_TOKENS,
    PROMPT,
    TAPS,
    TREE,
    fit_method,
    hidden_states,
    random_draft,
    target_and_truth,
    tiny4,
    trained,
)
from tests.test_eagle_drafter import Recorder
from tests.test_generate import chi_square, every_first_then_greedy, exact_two_token_probs
from tests.tiny import TINY_FAMILIES, TINY_VOCAB


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_output_equals_transformers(family: str, kind: str, shape: str) -> None:
    model, truth = target_and_truth(family)
    settings = CHAIN if shape == "chain" else TREE
    draft = random_draft(model) if kind == "random" else trained(family)
    drafter = Eagle3Drafter(draft, TargetHead.of(model), **settings)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    if kind == "trained":  # drafts line up with what training taught: most steps accept a lot
        assert result.tau > 2.5, result.accept_lengths


def fed(drafter: Eagle3Drafter, model: Any, sequence: Tensor) -> Eagle3Drafter:
    """``drafter`` after begin + one observe of every pair of ``sequence`` (true features)."""
    states = hidden_states(model, sequence[None])
    drafter.begin(sequence[:1])
    drafter.observe(sequence[1:], tuple(states[layer][0, :-1] for layer in TAPS))
    return drafter


def test_draft_ids_are_mapped_to_target_ids() -> None:
    """A vocabulary of target ids 60..91 only: every proposed token is one of them, and the
    proposals are the draft head's top-k shifted by d2t."""
    model, truth = target_and_truth("llama")
    vocab = DraftVocab.from_target_ids(range(60, 92), TINY_VOCAB)
    drafter = Eagle3Drafter(random_draft(model, vocab), TargetHead.of(model), **TREE)
    sequence = torch.cat([PROMPT, torch.tensor(truth[:4])])
    tree = fed(drafter, model, sequence).propose(sequence)
    assert tree.size == TREE["total_tokens"] - 1
    assert all(60 <= token < 92 for token in tree.tokens.tolist())
    with torch.no_grad():
        root_logits = drafter.draft3.logits(drafter._root_feature)  # type: ignore[arg-type]
    best_draft_ids = root_logits.topk(TREE["top_k"]).indices
    first_level = tree.tokens[tree.parents == -1].tolist()
    assert set(first_level) <= set((best_draft_ids + 60).tolist())


def test_the_drafter_reads_what_training_fed_and_drafts_its_argmax() -> None:
    """After observing a sequence, the root state is TTT step 0 at the last committed row (same
    feature layers, same order, same fc), and the chain drafter proposes the argmax chain of a
    from-scratch causal decode that feeds each drafted token and state back in."""
    model, truth = target_and_truth("gpt2")
    draft, head = trained("gpt2"), TargetHead.of(model)
    sequence = torch.cat([PROMPT, torch.tensor(truth[:6])])
    drafter = fed(Eagle3Drafter(draft, head, **CHAIN), model, sequence)
    states = hidden_states(model, sequence[None])
    with torch.no_grad():
        features = draft.fuse(torch.cat([states[layer] for layer in TAPS], dim=-1))[0, :-1]
        tokens = sequence[1:]  # committed pairs (g_t, x_{t+1}), t < n - 1
        state = draft(features[None], head.embed_tokens(tokens, torch.float32)[None])[0, -1]
        torch.testing.assert_close(drafter._root_feature, state, atol=1e-5, rtol=1e-5)
        chain = []
        for _ in range(CHAIN["depth"]):
            chain.append(int(draft.vocab.to_target(draft.logits(state).argmax())))
            features = torch.cat([features, state[None]])
            tokens = torch.cat([tokens, torch.tensor(chain[-1:])])
            embedded = head.embed_tokens(tokens, torch.float32)[None]
            state = draft(features[None], embedded)[0, -1]
    assert drafter.propose(sequence).tokens.tolist() == chain


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kv_rollback_gives_the_drafts_of_a_fresh_drafter(family: str) -> None:
    model, _ = target_and_truth(family)
    recorder = Recorder(Eagle3Drafter(trained(family), TargetHead.of(model), **TREE))
    generate(model, PROMPT, drafter=recorder, max_new_tokens=20, eos_token_ids=())
    assert len(recorder.proposals) > 3
    fresh = Eagle3Drafter(trained(family), TargetHead.of(model), **TREE)
    for sequence, tree in recorder.proposals:
        again = fed(fresh, model, sequence).propose(sequence)
        assert again.tokens.tolist() == tree.tokens.tolist()
        assert again.parents.tolist() == tree.parents.tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_behind_prompt_lookup_it_drafts_as_a_fresh_drafter_would(family: str) -> None:
    """Behind prompt lookup (``FirstDrafter``, as ``scripts/compare.py --fallback`` runs it) the
    drafter proposes only on the steps prompt lookup has nothing for, yet observes every step:
    each of its proposals equals a fresh drafter's on the same sequence, and the output stays
    the target's greedy one."""
    model, truth = target_and_truth(family)
    recorder = Recorder(Eagle3Drafter(trained(family), TargetHead.of(model), **TREE))
    drafter = FirstDrafter([PromptLookupDrafter(), recorder], self_sized=1)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    assert 0 < len(recorder.proposals) < result.num_forwards - 1  # prompt lookup took some steps
    fresh = Eagle3Drafter(trained(family), TargetHead.of(model), **TREE)
    for sequence, tree in recorder.proposals:
        again = fed(fresh, model, sequence).propose(sequence)
        assert again.tokens.tolist() == tree.tokens.tolist()
        assert again.parents.tolist() == tree.parents.tolist()


SAMPLES = 1500


def test_sampling_follows_the_target_distribution() -> None:
    """The first two sampled tokens follow the target's exact two-token distribution, with a
    drafter trained on (PROMPT, t1, greedy t2) for every t1 so that drafts are often accepted."""
    model = tiny4("gpt2")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 5.0)
    params = SamplingParams(temperature=1.0)
    first, second = exact_two_token_probs(model, params)
    extended = every_first_then_greedy(second)
    draft = fit_method(model, extended, steps=120, size=TINY_VOCAB).draft
    drafter = Recorder(Eagle3Drafter(draft, TargetHead.of(model), top_k=3, depth=2, total_tokens=7))
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(TINY_VOCAB * TINY_VOCAB)
    accepted = 0
    for _ in range(SAMPLES):
        result = generate(
            model,
            PROMPT,
            drafter=drafter,
            max_new_tokens=2,
            sampling=params,
            eos_token_ids=(),
            generator=generator,
        )
        counts[result.tokens[0] * TINY_VOCAB + result.tokens[1]] += 1
        tree = drafter.proposals[-1][1]
        accepted += result.tokens[1] in tree.tokens[tree.parents == -1].tolist()
    exact = (first[:, None] * second).flatten()
    assert not bool(counts[exact == 0].any())
    statistic, bound = chi_square(counts, exact)
    assert statistic < bound, (statistic, bound)
    assert accepted > SAMPLES / 3


def test_one_token_follows_the_reference_formula() -> None:
    """With one pair, attention is the value of that pair, so the layer must equal
    ``g + o(v([norm_in(e); norm_h(g)]))`` then ``+ mlp(norm_post(.))`` (reference
    ``LlamaDecoderLayeremb``: embedding first, residual = the un-normed fused feature)."""
    draft = random_draft(tiny4("llama"))
    for module in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm, draft.norm):
        torch.nn.init.uniform_(module.weight, 0.5, 1.5)  # distinguishable norms
    layer = draft.midlayer
    generator = torch.Generator().manual_seed(9)
    fused, embedding = (
        torch.randn(1, 1, 32, generator=generator),
        torch.randn(1, 1, 32, generator=generator),
    )
    with torch.no_grad():
        joint = torch.cat([layer.input_layernorm(embedding), layer.hidden_norm(fused)], dim=-1)
        values = layer.self_attn.v_proj(joint).view(1, 2, 8).repeat_interleave(2, dim=1)
        hidden = fused + layer.self_attn.o_proj(values.reshape(1, 1, 32))
        expected = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        torch.testing.assert_close(draft(fused, embedding), expected, atol=1e-6, rtol=1e-5)
        logits = draft.lm_head(draft.norm(expected))
        torch.testing.assert_close(draft.logits(expected), logits)


@pytest.mark.parametrize("method", ["eagle3", "eagle1"])
def test_a_bfloat16_draft_model_over_a_float32_target_keeps_the_output(
    method: str, tmp_path: Any
) -> None:
    """``EagleSpec(dtype="bfloat16")`` casts the draft model (not the target, nor EAGLE-3's
    integer vocabulary maps); greedy output stays transformers' own."""
    from headway.drafters.build import build_drafter
    from headway.drafters.eagle_drafter import EagleDrafter
    from headway.drafters.specs import EagleSpec
    from headway.target import Target
    from tests.test_formats import random_run

    model, truth = target_and_truth("llama")
    run = random_run(tmp_path / "run", method, model)
    target = Target(model=model, tokenizer=None, source="tiny")  # type: ignore[arg-type]
    drafter = build_drafter(EagleSpec(heads=str(run), dtype="bfloat16", **TREE), target)
    assert isinstance(drafter, EagleDrafter)
    assert drafter.model.fc.weight.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight.dtype == torch.float32
    if isinstance(drafter, Eagle3Drafter):
        assert drafter.draft3.vocab.d2t.dtype == torch.long
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    plain = build_drafter(EagleSpec(heads=str(run), **TREE), target)
    assert isinstance(plain, EagleDrafter)
    assert plain.model.fc.weight.dtype == torch.float32  # the default: the target's dtype
