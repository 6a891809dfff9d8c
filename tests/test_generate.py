"""The decoding loop: greedy output equals transformers' greedy decoding for every drafter, stops
and streaming behave, drafters observe the right hidden states, and sampling is lossless."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode.generate import Drafter, generate
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams, probs_from_logits
from headway.decode.tree import DraftTree
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.oracle import AdversarialDrafter, OracleDrafter
from tests.loop_sized import LoopSized
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_model

PROMPT = torch.tensor([1, 5, 17, 33, 8, 40, 41, 9])
NEW_TOKENS = 40
DEPTH = 4  # oracle depth: a fully accepted step commits DEPTH + 1 tokens


def hf_greedy(model: Any, prompt: Tensor, new_tokens: int, eos: int | None) -> list[int]:
    """transformers' own greedy decoding (the reference), generated ids only, cut after EOS."""
    ids = prompt[None]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=0,
        eos_token_id=eos,
    )
    tokens: list[int] = out[0, prompt.numel() :].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


DRAFTERS: dict[str, Callable[[list[int]], Drafter | None]] = {
    "none": lambda truth: None,
    "oracle-chain": lambda truth: OracleDrafter(truth, DEPTH),
    "oracle-tree": lambda truth: OracleDrafter(truth, DEPTH, width=3),
    "adversarial": lambda truth: AdversarialDrafter(TINY_VOCAB, 3, 2, truth),
    "prompt-lookup": lambda truth: PromptLookupDrafter(num_draft_tokens=5, max_nodes=12),
    "prompt-lookup-cost-sized": lambda truth: LoopSized(
        PromptLookupDrafter(num_draft_tokens=5, max_nodes=12),
        [0.010 + 0.001 * m for m in range(13)],
    ),
}


@pytest.mark.parametrize("drafter_name", list(DRAFTERS))
def test_greedy_output_equals_transformers(tiny_target: Any, drafter_name: str) -> None:
    truth = hf_greedy(tiny_target, PROMPT, NEW_TOKENS, eos=None)
    streamed: list[int] = []
    result = generate(
        tiny_target,
        PROMPT,
        drafter=DRAFTERS[drafter_name](truth),
        max_new_tokens=NEW_TOKENS,
        eos_token_ids=(),
        on_tokens=streamed.extend,
    )
    assert result.tokens == truth
    assert streamed == truth
    assert sum(result.accept_lengths) == NEW_TOKENS == len(result.tokens)
    assert result.num_forwards == len(result.accept_lengths)
    assert result.stop_reason == "max_new_tokens"
    assert result.accept_lengths[0] == 1  # the prefill forward commits the first token
    if drafter_name.startswith("oracle"):
        assert result.accept_lengths[1:-1] == [DEPTH + 1] * (len(result.accept_lengths) - 2)
        assert result.tau > DEPTH
    elif drafter_name in ("none", "adversarial"):
        assert set(result.accept_lengths) == {1}
        assert result.tau == 1.0
    else:
        assert max(result.accept_lengths) > 1  # the tiny models repeat themselves: lookups hit


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_equivalence_with_eager_attention(family: str) -> None:
    model = tiny_model(family, attn_implementation="eager")
    truth = hf_greedy(model, PROMPT, 24, eos=None)
    drafter = OracleDrafter(truth, DEPTH, width=2)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=24, eos_token_ids=())
    assert result.tokens == truth


def _eos_inside_a_draft(truth: list[int]) -> tuple[int, int]:
    """A token first seen at index k (k >= DEPTH + 2) that an oracle chain step proposes as a
    draft token rather than producing it as the bonus (bonus indices are multiples of DEPTH+1)."""
    for index, token in enumerate(truth):
        if index > DEPTH + 1 and index % (DEPTH + 1) and token != 0 and truth.index(token) == index:
            return token, index
    raise AssertionError(f"no usable EOS candidate in {truth}")


def test_eos_inside_an_accepted_draft_stops_right_after_it(tiny_target: Any) -> None:
    truth = hf_greedy(tiny_target, PROMPT, NEW_TOKENS, eos=None)
    eos, index = _eos_inside_a_draft(truth)
    result = generate(
        tiny_target,
        PROMPT,
        drafter=OracleDrafter(truth, DEPTH),
        max_new_tokens=NEW_TOKENS,
        eos_token_ids=[eos],
    )
    assert result.tokens == hf_greedy(tiny_target, PROMPT, NEW_TOKENS, eos=eos)
    assert result.tokens == truth[: index + 1]
    assert result.stop_reason == "eos"
    assert result.accept_lengths[-1] == index % (DEPTH + 1)  # the step was cut at the EOS


def test_max_new_tokens_truncates_an_overshooting_step() -> None:
    model = tiny_model("qwen2")
    truth = hf_greedy(model, PROMPT, 20, eos=None)
    limit = 1 + (DEPTH + 1) + 3
    result = generate(
        model, PROMPT, drafter=OracleDrafter(truth, DEPTH), max_new_tokens=limit, eos_token_ids=()
    )
    assert result.tokens == truth[:limit]
    assert result.accept_lengths == [1, DEPTH + 1, 3]
    assert result.stop_reason == "max_new_tokens"
    assert generate(model, PROMPT, drafter=None, max_new_tokens=0, eos_token_ids=()).tokens == []


def _first_match_end(tokens: list[int], stop: list[int]) -> int:
    return next(
        end for end in range(len(stop), len(tokens) + 1) if tokens[end - len(stop) : end] == stop
    )


@pytest.mark.parametrize("start", [5, 7])  # 5: the sequence spans two steps; 7: inside one
def test_stop_sequence_ends_generation_after_the_match(start: int) -> None:
    model = tiny_model("gpt2")
    truth = hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)
    stop = truth[start : start + 3]
    result = generate(
        model,
        PROMPT,
        drafter=OracleDrafter(truth, DEPTH),
        max_new_tokens=NEW_TOKENS,
        eos_token_ids=(),
        stop_sequences=[[95, 95, 95], stop],
    )
    assert result.tokens == truth[: _first_match_end(truth, stop)]
    assert result.stop_reason == "stop_sequence"
    assert sum(result.accept_lengths) == len(result.tokens)


@pytest.mark.parametrize("with_drafter", [False, True])
def test_context_limit_trims_drafts_and_stops(tiny_target: Any, with_drafter: bool) -> None:
    limit: int = tiny_target.config.max_position_embeddings
    prompt = torch.randint(3, TINY_VOCAB, (limit - 14,), generator=torch.Generator().manual_seed(0))
    truth = hf_greedy(tiny_target, prompt, 14, eos=None)
    drafter = OracleDrafter(truth, DEPTH, width=2) if with_drafter else None
    result = generate(tiny_target, prompt, drafter=drafter, max_new_tokens=50, eos_token_ids=())
    assert result.tokens == truth
    assert result.stop_reason == "context_limit"
    with pytest.raises(ValueError, match="context"):
        generate(
            tiny_target,
            torch.ones(limit, dtype=torch.long),
            drafter=None,
            max_new_tokens=1,
            eos_token_ids=(),
        )


class RecordingDrafter:
    """Wraps an oracle tree and records everything the loop tells it."""

    hidden_layers: tuple[int, ...] = (0, 1, -1)
    max_nodes = 64

    def __init__(self, inner: OracleDrafter) -> None:
        self.inner = inner
        self.tokens: list[Tensor] = []
        self.hidden: list[tuple[Tensor, ...]] = []
        self.sequences: list[Tensor] = []

    def begin(self, prompt_ids: Tensor) -> None:
        self.inner.begin(prompt_ids)

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        self.sequences.append(sequence.clone())
        return self.inner.propose(sequence, floor)

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        self.tokens.append(new_tokens.clone())
        self.hidden.append(hidden)


def test_drafter_observes_the_state_before_each_new_token(tiny_target: Any) -> None:
    truth = hf_greedy(tiny_target, PROMPT, 20, eos=None)
    drafter = RecordingDrafter(OracleDrafter(truth, 3, width=2))
    result = generate(tiny_target, PROMPT, drafter=drafter, max_new_tokens=20, eos_token_ids=())
    sequence = torch.cat([PROMPT, torch.tensor(result.tokens)])
    assert torch.equal(drafter.tokens[0], torch.cat([PROMPT[1:], sequence[PROMPT.numel() :][:1]]))
    assert torch.equal(torch.cat(drafter.tokens), sequence[1:])
    assert [t.numel() for t in drafter.tokens[1:]] == result.accept_lengths[1:]
    for proposed in drafter.sequences:  # propose sees every committed id, ending with the root
        assert torch.equal(proposed, sequence[: proposed.numel()])
    with torch.no_grad():
        plain = tiny_target(sequence[None], output_hidden_states=True).hidden_states
    for position, layer in enumerate(RecordingDrafter.hidden_layers):
        observed = torch.cat([hidden[position] for hidden in drafter.hidden])
        torch.testing.assert_close(observed, plain[layer][0, :-1], atol=1e-5, rtol=0)


def test_sampling_is_reproducible_and_typical_acceptance_runs() -> None:
    model = tiny_model("llama")
    truth = hf_greedy(model, PROMPT, 12, eos=None)
    hot = SamplingParams(temperature=1.0)

    def run(seed: int, acceptance: str = "lossless") -> list[int]:
        return generate(
            model,
            PROMPT,
            drafter=OracleDrafter(truth, 3, width=2),
            max_new_tokens=12,
            sampling=hot,
            eos_token_ids=(),
            generator=torch.Generator().manual_seed(seed),
            options=DecodeOptions(acceptance=acceptance),  # type: ignore[arg-type]
        ).tokens

    assert run(3) == run(3)
    assert run(3) != run(4)
    assert len(run(3, "typical")) == 12
    greedy_typical = generate(
        model,
        PROMPT,
        drafter=OracleDrafter(truth, 3),
        max_new_tokens=12,
        eos_token_ids=(),
        options=DecodeOptions(acceptance="typical"),
    )
    assert greedy_typical.tokens == truth  # temperature 0: typical falls back to greedy


# ---- sampling is lossless: the first two tokens follow the exact plain-sampling distribution ----

SAMPLES = 3000


def sharp_gpt2() -> Any:
    """Tiny GPT-2 with its (untied) LM head scaled x5: at temperature 1 the joint distribution of
    two tokens then has ~35 cells with expected counts >= 5, so a few thousand samples judge it."""
    model: Any = tiny_model("gpt2")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 5.0)
    return model


def exact_two_token_probs(model: Any, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """p(t1) ``[V]`` and p(t2 | t1) ``[V, V]`` by enumerating every first token (one batch)."""
    with torch.no_grad():
        first = model(PROMPT[None]).logits[0, -1]
        extended = torch.cat([PROMPT.expand(TINY_VOCAB, -1), torch.arange(TINY_VOCAB)[:, None]], 1)
        second = model(extended, attention_mask=torch.ones_like(extended)).logits[:, -1]
    return probs_from_logits(first, params), probs_from_logits(second, params)


def every_first_then_greedy(second: Tensor) -> Tensor:
    """``[V, P + 2]``: PROMPT, each first token t1, then the most likely second token after it
    (``second [V, V]`` from :func:`exact_two_token_probs`): what a drafter is fitted on so that
    the sampling tests' drafts are often accepted."""
    every_first = torch.arange(TINY_VOCAB)[:, None]
    return torch.cat([PROMPT.expand(TINY_VOCAB, -1), every_first, second.argmax(-1)[:, None]], 1)


class TableDrafter:
    """Drafts from a table of the target's next-token probabilities after the first token, mixed
    with uniform noise. ``random=True``: ``width`` siblings drawn from q without replacement;
    otherwise the top-``width`` of q as deterministic candidates. Each sibling gets a chain of
    ``depth - 1`` further tokens below it, drawn uniformly."""

    hidden_layers: tuple[int, ...] = ()
    max_nodes = 64

    def __init__(self, table: Tensor, *, width: int, depth: int, random: bool, seed: int) -> None:
        self.table, self.width, self.depth, self.random = table, width, depth, random
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_len = 0
        self.last_children: list[int] = []

    def begin(self, prompt_ids: Tensor) -> None:
        self.prompt_len = prompt_ids.numel()

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        return None

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        uniform = torch.full((TINY_VOCAB,), 1.0 / TINY_VOCAB)
        q = 0.6 * self.table[int(sequence[self.prompt_len])] + 0.4 * uniform
        if self.random:
            first = torch.multinomial(q, self.width, replacement=False, generator=self.generator)
        else:
            first = q.topk(self.width).indices
        self.last_children = first.tolist()
        tokens, parents = [], []
        for child in first.tolist():
            below = torch.randint(TINY_VOCAB, (self.depth - 1,), generator=self.generator)
            parent = -1
            for token in [child, *below.tolist()]:
                tokens.append(token)
                parents.append(parent)
                parent = len(tokens) - 1
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def chi_square(counts: Tensor, probs: Tensor) -> tuple[float, float]:
    """Pearson's statistic of ``counts`` against ``probs`` and its upper 1e-4 quantile under the
    null (Wilson-Hilferty approximation). Cells expecting fewer than 5 samples are pooled; the
    pool joins the smallest cell if it is itself too small."""
    expected = probs * counts.sum()
    frequent = expected >= 5
    observed, predicted = counts[frequent], expected[frequent]
    smallest = int(predicted.argmin())
    rest_observed, rest_expected = counts[~frequent].sum(), expected[~frequent].sum()
    if rest_expected >= 5:
        observed = torch.cat([observed, rest_observed[None]])
        predicted = torch.cat([predicted, rest_expected[None]])
    else:
        observed[smallest] += rest_observed
        predicted[smallest] += rest_expected
    statistic = float(((observed - predicted) ** 2 / predicted).sum())
    dof = observed.numel() - 1
    bound = dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3
    return statistic, bound


@pytest.mark.parametrize(
    ("params", "width", "depth", "random"),
    [
        (SamplingParams(temperature=1.0), 1, 3, True),  # chain drafted from q
        (SamplingParams(temperature=1.0), 3, 2, False),  # tree of deterministic candidates
        (SamplingParams(temperature=1.0, top_k=8, top_p=0.9), 3, 2, True),  # tree drafted from q
    ],
    ids=["chain-q", "tree-topk", "tree-q-topk-topp"],
)
def test_first_two_tokens_follow_plain_sampling(
    params: SamplingParams, width: int, depth: int, random: bool
) -> None:
    model = sharp_gpt2()
    first, second = exact_two_token_probs(model, params)
    exact = (first[:, None] * second).flatten()
    drafter = TableDrafter(second, width=width, depth=depth, random=random, seed=1)
    generator = torch.Generator().manual_seed(2)
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
        # A rejected candidate has zero residual mass, so t2 is a drafted child only if accepted.
        accepted += result.tokens[1] in drafter.last_children
    assert not bool(counts[exact == 0].any()), "sampled a pair the target gives probability 0"
    statistic, bound = chi_square(counts, exact)
    total_variation = 0.5 * float((counts / SAMPLES - exact).abs().sum())
    assert statistic < bound, (statistic, bound, total_variation)
    assert accepted > SAMPLES / 4  # the draft decided the second token often enough to matter


def test_the_sequence_buffer_grows_as_tokens_are_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The buffer starts small whatever max_new_tokens says (a cap, not an allocation) and
    doubles as tokens come; the output is unchanged."""
    import importlib

    loop = importlib.import_module("headway.decode.generate")  # the module, not the function
    model = tiny_model("llama")
    truth = hf_greedy(model, PROMPT, 40, eos=None)
    monkeypatch.setattr(loop, "INITIAL_ROOM", 2)
    drafter = OracleDrafter(truth, 4, width=2)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=40, eos_token_ids=())
    assert result.tokens == truth
    huge = generate(
        model,
        PROMPT,
        drafter=PromptLookupDrafter(),
        max_new_tokens=10**15,
        eos_token_ids=(),
        stop_check=lambda tokens: len(tokens) >= 5,
    )
    assert huge.tokens == truth[: len(huge.tokens)] and huge.stop_reason == "stop_sequence"
