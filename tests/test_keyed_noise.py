"""Sampling noise keyed by (sequence seed, position): uniform, independent, reproducible."""

from __future__ import annotations

import torch

from headway.decode.keyed_noise import mix32, sequence_seeds, uniforms_at
from headway.decode.sampling import sample_with


def chi_square(counts: torch.Tensor, expected: float) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_mix32_is_a_bijection_of_32_bit_words() -> None:
    words = torch.cat([torch.arange(1 << 16), torch.arange(1, 1 << 16) << 16, torch.tensor([-1])])
    hashed = mix32(words)
    assert int(hashed.min()) >= 0 and int(hashed.max()) < 2**32
    assert hashed[:-1].unique().numel() == words.numel() - 1  # no two words collide
    assert int(hashed[-1]) == int(mix32(torch.tensor([2**32 - 1]))[0])  # taken mod 2**32


def test_uniforms_are_uniform_and_independent_across_positions_and_seeds() -> None:
    seeds = sequence_seeds(torch.Generator().manual_seed(0), 64)
    positions = torch.arange(2000).expand(64, -1)
    u = uniforms_at(seeds, positions)  # [64, 2000]
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    bins = torch.bincount((u.flatten() * 50).long(), minlength=50).double()
    assert chi_square(bins, u.numel() / 50) < 110  # 49 dof: p < 1e-6 beyond
    # consecutive positions and neighbouring sequences: no structure in pairs
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        cells = (a * 10).long() * 10 + (b * 10).long()
        pairs = torch.bincount(cells.flatten(), minlength=100).double()
        assert chi_square(pairs, cells.numel() / 100) < 170  # 99 dof
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.01


def test_a_sequence_keeps_its_seed_whatever_the_count_and_its_uniforms_whatever_the_batch() -> None:
    one = sequence_seeds(torch.Generator().manual_seed(5), 1)
    many = sequence_seeds(torch.Generator().manual_seed(5), 9)
    assert int(one[0]) == int(many[0]) and many.unique().numel() == 9
    assert int(sequence_seeds(torch.Generator().manual_seed(6), 1)[0]) != int(one[0])
    alone = uniforms_at(many[3], torch.arange(10, 20))
    together = uniforms_at(many, torch.arange(10, 20).expand(9, -1))
    assert torch.equal(alone, together[3])
    assert torch.equal(uniforms_at(many[3], torch.tensor(15)), alone[5])


def test_plain_sampling_over_keyed_uniforms_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    seeds = sequence_seeds(torch.Generator().manual_seed(1), 20)
    u = uniforms_at(seeds, torch.arange(1000).expand(20, -1)).flatten()
    drawn = sample_with(probs.expand(u.numel(), -1), u)
    counts = torch.bincount(drawn, minlength=5).double()
    assert counts[1] == 0  # never a token without mass
    expected = probs[probs > 0] * u.numel()
    assert float(((counts[probs > 0] - expected) ** 2 / expected).sum()) < 25  # 3 dof
