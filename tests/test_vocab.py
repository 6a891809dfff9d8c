"""The EAGLE-3 draft vocabulary: d2t/t2d on the worked example, round trips between draft and target
ids, the renormalised target distribution, frequency-based selection, and clear errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from headway.heads.vocab import DraftVocab, check_vocab, choose_vocab, token_counts


def test_worked_example_from_the_docstring() -> None:
    vocab = DraftVocab.from_target_ids([5, 1, 4], 6)  # any order: draft ids follow target ids
    assert vocab.d2t.tolist() == [1, 3, 3]
    assert vocab.t2d.tolist() == [False, True, False, False, True, True]
    assert vocab.d2t.dtype == torch.long and vocab.t2d.dtype == torch.bool
    assert (vocab.size, vocab.vocab_size) == (3, 6)
    assert vocab.to_target(torch.tensor([0, 1, 2])).tolist() == [1, 4, 5]
    assert vocab.to_draft(torch.arange(6)).tolist() == [-1, 0, -1, -1, 1, 2]


def test_round_trip_between_draft_and_target_ids() -> None:
    generator = torch.Generator().manual_seed(0)
    chosen = torch.randperm(1000, generator=generator)[:137]
    vocab = DraftVocab.from_target_ids(chosen, 1000)
    draft_ids = torch.arange(137)
    targets = vocab.to_target(draft_ids)
    assert sorted(targets.tolist()) == sorted(chosen.tolist())
    assert torch.equal(vocab.to_draft(targets), draft_ids)
    outside = torch.tensor([t for t in range(1000) if t not in set(chosen.tolist())])
    assert bool((vocab.to_draft(outside) == -1).all())
    assert torch.equal(vocab.t2d.nonzero()[:, 0], targets)  # t2d marks exactly the mapped ids
    again = DraftVocab.from_tensors(vocab.d2t.clone(), vocab.t2d.clone())
    assert torch.equal(again.target_ids, vocab.target_ids)
    full = DraftVocab.identity(50, 50)  # the full vocabulary is the identity map
    assert not bool(full.d2t.any()) and bool(full.t2d.all())


def test_restricted_logits_give_the_renormalised_target_distribution() -> None:
    logits = torch.randn(4, 7, 30, generator=torch.Generator().manual_seed(1))
    vocab = DraftVocab.from_target_ids([2, 3, 11, 17, 29], 30)
    restricted = torch.softmax(vocab.restrict(logits), dim=-1)  # [4, 7, 5], draft-id order
    p = torch.softmax(logits, dim=-1)[..., [2, 3, 11, 17, 29]]
    torch.testing.assert_close(restricted, p / p.sum(-1, keepdim=True))
    assert torch.allclose(restricted.sum(-1), torch.ones(4, 7))


def test_the_most_frequent_trained_tokens_are_chosen() -> None:
    rows = [
        ([5, 7, 7, 9, 9, 9], [0, 1, 1, 1, 1, 1]),  # 5 is a prompt token: never counts as trained
        ([9, 3, 3, 5, 5, 5], [1, 1, 1, 0, 0, 0]),
    ]
    counts = token_counts(rows, 12)
    assert counts.trained.tolist() == [0, 0, 0, 2, 0, 0, 0, 2, 0, 4, 0, 0]
    assert counts.seen[5] == 4
    assert choose_vocab(counts, 1).target_ids.tolist() == [9]
    # 3 and 7 tie on trained counts (2 each) and on seen counts (2 each): the lower id wins
    assert choose_vocab(counts, 2).target_ids.tolist() == [3, 9]
    # past the trained tokens, the slots go to the most seen token (5), then the lowest ids
    assert choose_vocab(counts, 4).target_ids.tolist() == [3, 5, 7, 9]
    assert choose_vocab(counts, 6).target_ids.tolist() == [0, 1, 3, 5, 7, 9]
    assert choose_vocab(counts, 99).size == 12  # capped at the target vocabulary


def test_selection_matches_the_reference_counter_when_there_are_no_ties() -> None:
    """The reference: ``Counter`` of the tokens with ``loss_mask == 1``, ``most_common(N)``."""
    generator = torch.Generator().manual_seed(2)
    weights = torch.linspace(1.0, 50.0, 40)
    ids = torch.multinomial(weights, 20_000, replacement=True, generator=generator)
    mask = (torch.rand(20_000, generator=generator) < 0.7).long()
    counter = Counter(ids[mask.bool()].tolist())
    frequencies = sorted(counter.values(), reverse=True)
    assert frequencies[9] != frequencies[10]  # no tie at the cut
    expected = sorted(token for token, _ in counter.most_common(10))
    chosen = choose_vocab(token_counts([(ids, mask)], 40), 10)
    assert chosen.target_ids.tolist() == expected


def test_inconsistent_maps_are_refused() -> None:
    vocab = DraftVocab.from_target_ids([1, 4, 5], 6)
    wrong_t2d = vocab.t2d.clone()
    wrong_t2d[0] = True
    with pytest.raises(ValueError, match="different vocabularies"):
        check_vocab(vocab.d2t, wrong_t2d)
    with pytest.raises(ValueError, match="two draft ids to one target id"):
        check_vocab(torch.tensor([1, 0]), vocab.t2d)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        check_vocab(torch.tensor([1, 3, 9]), vocab.t2d)
    with pytest.raises(ValueError, match="int64"):
        check_vocab(vocab.d2t.int(), vocab.t2d)
    with pytest.raises(ValueError, match="duplicates"):
        DraftVocab.from_target_ids([1, 1, 4], 6)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        token_counts([([1, 99], [1, 1])], 6)
