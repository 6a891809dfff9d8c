"""Sampling noise keyed by (sequence seed, position, token): Gumbel draws that follow the
distribution, independent across positions and seeds, reproducible."""

from __future__ import annotations

import math

import torch

from headway.decode.keyed_noise import (
    NOISE_BITS,
    draw_keyed,
    gumbel_of_bits,
    gumbels,
    mix32,
    position_keys,
    sequence_seeds,
)


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_mix32_is_a_bijection_of_32_bit_words() -> None:
    words = torch.cat([torch.arange(1 << 16), torch.arange(1, 1 << 16) << 16, torch.tensor([-1])])
    hashed = mix32(words)
    assert int(hashed.min()) >= 0 and int(hashed.max()) < 2**32
    assert hashed[:-1].unique().numel() == words.numel() - 1  # no two words collide
    assert int(hashed[-1]) == int(mix32(torch.tensor([2**32 - 1]))[0])  # taken mod 2**32


def test_the_noise_is_gumbel_and_independent_across_positions_tokens_and_seeds() -> None:
    seeds = sequence_seeds(torch.Generator().manual_seed(0), 16)
    keys = position_keys(seeds, torch.arange(300).expand(16, -1))  # [16, 300]
    noise = gumbels(keys, torch.arange(200))  # [16, 300, 200]
    assert noise.dtype == torch.float32 and bool(noise.isfinite().all())
    u = torch.exp(-torch.exp(-noise.double()))  # back to uniforms
    bins = torch.bincount((u.flatten() * 50).long(), minlength=50).double()
    assert chi_square(bins, torch.full((50,), u.numel() / 50)) < 110  # 49 dof
    assert abs(float(noise.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(noise.var()) - math.pi**2 / 6) < 0.02
    # neighbouring positions, tokens and sequences: no structure in pairs
    for a, b in ((u[:, :-1], u[:, 1:]), (u[..., :-1], u[..., 1:]), (u[:-1], u[1:])):
        cells = (a * 10).long() * 10 + (b * 10).long()
        pairs = torch.bincount(cells.flatten(), minlength=100).double()
        assert chi_square(pairs, torch.full((100,), cells.numel() / 100)) < 170  # 99 dof


def test_a_sequence_keeps_its_seed_whatever_the_count_and_its_noise_whatever_the_batch() -> None:
    one = sequence_seeds(torch.Generator().manual_seed(5), 1)
    many = sequence_seeds(torch.Generator().manual_seed(5), 9)
    assert int(one[0]) == int(many[0]) and many.unique().numel() == 9
    assert int(sequence_seeds(torch.Generator().manual_seed(6), 1)[0]) != int(one[0])
    alone = position_keys(many[3], torch.arange(10, 20))
    together = position_keys(many, torch.arange(10, 20).expand(9, -1))
    assert torch.equal(alone, together[3])
    assert torch.equal(position_keys(many[3], torch.tensor(15)), alone[5])
    tokens = torch.tensor([7, 3, 11])  # a drafter's candidates see the target's noise
    assert torch.equal(gumbels(alone, tokens), gumbels(alone, torch.arange(12))[:, tokens])


def test_the_noise_is_finite_at_its_extremes() -> None:
    """The largest and smallest words give finite noise (with 24 bits the largest rounded to
    u = 1.0 in float32: an infinite Gumbel, NaN scores in coupled drafting, a token always
    drawn whatever its probability)."""
    top = 2**NOISE_BITS - 1  # the largest word a hash gives
    extremes = gumbel_of_bits(torch.tensor([0, 1, top - 1, top]))
    assert bool(extremes.isfinite().all()) and bool((extremes[1:] > extremes[:-1]).all())
    assert float(extremes[-1]) < 17.0 and float(extremes[0]) > -3.0


def test_keyed_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    seeds = sequence_seeds(torch.Generator().manual_seed(1), 20)
    keys = position_keys(seeds, torch.arange(1000).expand(20, -1)).flatten()
    drawn = draw_keyed(probs.expand(keys.numel(), -1), keys)
    counts = torch.bincount(drawn, minlength=5).double()
    assert counts[1] == 0  # never a token without mass
    assert chi_square(counts[probs > 0], probs[probs > 0] * keys.numel()) < 25  # 3 dof
