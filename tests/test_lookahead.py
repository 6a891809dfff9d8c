"""Lookahead in batched generation: prompt lookup drafts per row, one forward verifies every
chain; greedy output stays ``generate``'s on each prompt alone (fp32, sliding windows too), and
sampled tokens keep the target's distribution (chi-square)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from headway.decode.sampling import SamplingParams, probs_from_logits
from headway.drafters.lookup import NgramIndex
from headway.generation.batched_generation import ContinuousBatcher
from headway.generation.lookahead import accept_chains
from tests.families import FAMILIES, family_config, family_model
from tests.test_batched_generation import eos_that_ends_some, reference
from tests.tiny import tiny_model

NEW = 40


def test_ngram_index_proposes_what_followed_the_longest_earlier_suffix() -> None:
    index = NgramIndex(min_ngram=1, max_ngram=3)
    index.extend([1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4])
    # suffix (2, 3, 4) last occurred at the start, followed by 9, 3, 4, 7
    assert index.follow(4) == [9, 3, 4, 7]
    index.extend([5])
    assert index.follow(3) == []  # 5 never occurred before
    index.extend([6, 2, 3])
    assert index.follow(2) == [4, 5]  # (2, 3) last followed at index 9: 4, then 5
    assert index.follow(0) == []
    assert NgramIndex(min_ngram=1, max_ngram=2).follow(3) == []
    with pytest.raises(ValueError, match="max_ngram"):
        NgramIndex(min_ngram=1, max_ngram=0)


def test_greedy_chains_keep_the_matching_drafts_then_the_target_token() -> None:
    logits = torch.full((3, 4, 10), -5.0)
    best = [[4, 5, 6, 7], [1, 2, 3, 3], [8, 8, 8, 8]]
    for row, tokens in enumerate(best):
        for position, token in enumerate(tokens):
            logits[row, position, token] = 5.0
    drafts = [[4, 5, 6], [1, 9], []]
    accepted = accept_chains(logits, drafts, SamplingParams())
    assert accepted.kept == [3, 1, 0]
    assert accepted.tokens == [[4, 5, 6, 7], [1, 2], [8]]


def test_sampled_chains_keep_the_target_distribution() -> None:
    """The first token is drawn as p0 whatever the draft; after a kept draft the second is
    drawn as p1 (20,000 identical rows; chi-square at the 0.999 quantile)."""
    rows, vocab = 20_000, 5
    logits = torch.tensor([[1.5, 1.0, 0.2, -0.5, -3.0], [0.1, -1.0, 2.0, 0.5, 0.0]])
    rule = SamplingParams(temperature=0.9)
    keys = torch.randint(0, 2**32, (rows, 2), generator=torch.Generator().manual_seed(0))
    accepted = accept_chains(logits[None].repeat(rows, 1, 1), [[1]] * rows, rule, keys)
    probs = probs_from_logits(logits, rule).double()

    def chi_square(tokens: list[int], expected: torch.Tensor) -> float:
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        want = expected * len(tokens)
        return float(((counts - want) ** 2 / want).sum())

    first = [tokens[0] for tokens in accepted.tokens]
    assert chi_square(first, probs[0]) < 18.47  # 4 degrees of freedom
    second = [tokens[1] for tokens in accepted.tokens if len(tokens) == 2]
    assert abs(len(second) / rows - float(probs[0, 1])) < 0.02  # kept with probability p0(1)
    assert chi_square(second, probs[1]) < 18.47


def answers(
    model: Any, prompts: dict[str, list[int]], eos: list[int], **options: Any
) -> tuple[dict[str, list[int]], ContinuousBatcher]:
    batcher = ContinuousBatcher(
        model, slots=4, max_new_tokens=NEW, eos_token_ids=eos, pad_token_id=0, **options
    )
    for index, (key, prompt) in enumerate(prompts.items()):
        batcher.submit(key, prompt, seed=index)
    found = {str(c.key): c.tokens for c in batcher.completions()}
    return found, batcher


def test_a_sampled_answer_is_its_seeds_with_or_without_lookahead_in_any_slots() -> None:
    """Sampled (temperature 0.5, drafts kept often), each prompt's answer is what its seed
    draws: the same with lookahead 0 and 3, through 1, 3 or 8 slots (rows beside it, refills);
    another seed, another answer."""
    model = tiny_model("llama")
    head = model.lm_head.weight.detach() * 8.0  # sharper: sampled answers fall into loops too
    model.lm_head.weight = torch.nn.Parameter(head)
    rng = random.Random(5)
    prompts = {f"p{i}": [rng.randrange(3, 96) for _ in range(rng.randint(2, 12))] for i in range(8)}
    rule = SamplingParams(temperature=0.5)
    runs = []
    for lookahead, slots in [(0, 8), (3, 8), (3, 1), (0, 3)]:
        batcher = ContinuousBatcher(
            model, slots=slots, max_new_tokens=NEW, eos_token_ids=[0], pad_token_id=0,
            rule=rule, lookahead=lookahead,
        )  # fmt: skip
        for index, (key, prompt) in enumerate(prompts.items()):
            batcher.submit(key, prompt, seed=100 + index)
        runs.append({str(c.key): c.tokens for c in batcher.completions()})
        if lookahead:
            assert batcher.tokens_per_row_step > 1.0  # drafts were kept
    assert all(run == runs[0] for run in runs[1:])
    greedy = {key: reference(model, prompt, NEW, [0]) for key, prompt in prompts.items()}
    assert runs[0] != greedy
    other, _ = answers(model, prompts, [0], rule=rule)  # seeds 0..7
    assert other != runs[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("lookahead", [1, 4])
def test_greedy_with_lookahead_equals_generate(family: str, lookahead: int) -> None:
    """Tiny random models fall into loops within 40 tokens, which prompt lookup drafts."""
    model = tiny_model(family)
    rng = random.Random(3)
    prompts = {f"p{i}": [rng.randrange(3, 96) for _ in range(rng.randint(2, 12))] for i in range(8)}
    eos = eos_that_ends_some(model, list(prompts.values()))
    found, batcher = answers(model, prompts, eos, lookahead=lookahead, prefill_tokens=40)
    kept = 0
    for key, prompt in prompts.items():
        assert found[key] == reference(model, prompt, NEW, eos), key
        kept += len(found[key]) + (len(found[key]) < NEW) - 1  # + its EOS, - the prefill's token
    assert batcher.tokens_per_row_step > 1.0  # drafts were kept, not only tried
    # it counts what rows kept: never drafts accepted past an EOS or the length cap
    assert batcher.tokens_per_row_step * batcher.row_steps == pytest.approx(kept)


def test_tokens_per_row_step_counts_no_draft_accepted_past_an_eos() -> None:
    """A prompt that ends in the model's own loop, and an EOS inside the loop: prompt lookup
    drafts the loop past the EOS and the target agrees, but the row keeps only up to its EOS."""
    model = tiny_model("llama")
    rng = random.Random(3)
    checked = 0
    for _ in range(20):
        prompt = [rng.randrange(3, 96) for _ in range(6)]
        looped = prompt + reference(model, prompt, 40, [0])
        after = reference(model, looped, 6, [0])
        if len(after) < 2:
            continue
        batcher = ContinuousBatcher(
            model, slots=1, max_new_tokens=20, eos_token_ids=[after[1]], pad_token_id=0, lookahead=4
        )
        batcher.submit("row", looped)
        (completion,) = list(batcher.completions())
        assert completion.tokens == after[:1] and completion.finish_reason == "eos"
        assert batcher.tokens_per_row_step * batcher.row_steps == 1  # the EOS, nothing past it
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_past_a_sliding_window_equals_generate(family: str) -> None:
    """A 6-token window and 40 new tokens: every row attends past its window."""
    config = family_config(family, layers=2)
    config.sliding_window = 6
    torch.manual_seed(0)
    model = type(family_model(family))(config).eval()
    prompts = {f"p{i}": [3 + i, 7, 9, 3 + i, 7, 11 + i, 4][: 3 + i] for i in range(5)}
    for lookahead in (0, 3):
        found, _ = answers(model, prompts, [2], lookahead=lookahead)
        for key, prompt in prompts.items():
            assert found[key] == reference(model, prompt, NEW, [2]), (family, lookahead, key)


def test_regeneration_looks_ahead_by_default_only_for_greedy_answers() -> None:
    from headway.errors import DataError
    from headway.train.answering import GREEDY_LOOKAHEAD, RegenerateOptions

    assert RegenerateOptions().resolved_lookahead == GREEDY_LOOKAHEAD == 3
    assert RegenerateOptions(temperature=0.7).resolved_lookahead == 0
    assert RegenerateOptions(temperature=0.7, lookahead=2).resolved_lookahead == 2
    assert RegenerateOptions(lookahead=0).resolved_lookahead == 0
    with pytest.raises(DataError, match="lookahead"):
        RegenerateOptions(lookahead=-1)


def test_sampling_through_the_batcher_with_lookahead_keeps_the_target_distribution() -> None:
    """3,000 sampled answers of 3 tokens to a prompt ending in a loop that prompt lookup drafts
    from: the
    second and third tokens follow the target's own marginals (computed exactly), chi-square
    at the 0.999 quantile over the tokens expected at least 10 times (the rest pooled)."""
    model = tiny_model("qwen2")
    start = [94, 63, 72, 73, 63]
    prompt = start + reference(model, start, 16, [0])  # greedy falls into a loop here
    rule = SamplingParams(temperature=0.3)
    batcher = ContinuousBatcher(
        model,
        slots=64,
        max_new_tokens=3,
        eos_token_ids=[model.config.vocab_size],  # never drawn: every answer has 3 tokens
        pad_token_id=0,
        rule=rule,
        lookahead=2,
        prefill_tokens=64 * len(prompt),
    )
    samples = 3000
    for key in range(samples):
        batcher.submit(key, prompt, seed=key)
    answers = [c.tokens for c in batcher.completions()]
    assert 1.2 < batcher.tokens_per_row_step < 1.95  # drafts were kept, and some rejected

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(prefixes)).logits[:, -1]
        return probs_from_logits(logits, rule).double()

    vocab = model.config.vocab_size
    first = next_probs([prompt])[0]  # [V]
    second_given = next_probs([[*prompt, t] for t in range(vocab)])  # [V, V]
    second = first @ second_given
    pairs = [(a, b) for a in range(vocab) for b in range(vocab)]
    likely = [(a, b) for a, b in pairs if first[a] * second_given[a, b] > 1e-4]
    third_given = next_probs([[*prompt, a, b] for a, b in likely])
    third = torch.stack(
        [first[a] * second_given[a, b] * third_given[i] for i, (a, b) in enumerate(likely)]
    ).sum(0)
    third = third / third.sum()  # the pairs left out carry < 1e-4 each

    def chi_square_p(tokens: list[int], expected: torch.Tensor) -> float:
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        want = expected * len(tokens)
        big = want >= 10
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        wanted = torch.cat([want[big], want[~big].sum()[None]])
        statistic = float(((observed - wanted) ** 2 / wanted).sum())
        degrees = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
        return float(torch.special.gammaincc(degrees, torch.tensor(statistic / 2)))  # sf

    assert all(len(answer) == 3 for answer in answers)
    assert chi_square_p([a[1] for a in answers], second) > 1e-3
    assert chi_square_p([a[2] for a in answers], third) > 1e-3
