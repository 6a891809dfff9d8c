"""Cost-sized Medusa trees: each step sends the best nodes of the choices tree, ranked by the
product of the heads' probabilities along each node's path, as many as pay for their verify
forward. Output stays transformers' greedy output; flat costs send the whole tree, steep costs
nothing; heads that are always rejected stop being sent."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode.costs import best_prefix
from headway.decode.generate import Decoder, generate
from headway.decode.options import DecodeOptions
from headway.drafters.medusa_drafter import DEFAULT_CHOICES, MedusaDrafter
from headway.heads.hidden_states import final_hidden_layer
from headway.heads.io import HeadsError
from headway.heads.medusa import MedusaConfig, MedusaHeads
from tests.drafting import heads_drafter as load_drafter
from tests.loop_sized import LoopSized
from tests.test_generate import hf_greedy
from tests.test_heads_io import save, trained_like_heads
from tests.test_medusa import train_heads
from tests.tiny import TINY_VOCAB, tiny_model

PROMPT = torch.tensor([1, 5, 17, 33, 8, 40, 41, 9])
NEW_TOKENS = 32
SMALL = MedusaConfig(num_heads=2, num_layers=1, hidden_size=8, vocab_size=12)
NODES = len(DEFAULT_CHOICES)  # 16, all within two heads
FLAT = [0.010] * (NODES + 1)  # a bigger verify forward costs nothing: send everything
STEEP = [0.010] + [1.0] * NODES  # any node costs 100 plain steps: send nothing
# a CPU-like table: one token costs more than 2-4 (the small-block product), then it grows
CPU_LIKE = [0.044, 0.030, 0.030, 0.031, 0.040, 0.042, 0.045, 0.050, 0.055]
CPU_LIKE += [0.065 + 0.004 * m for m in range(NODES + 1 - len(CPU_LIKE))]


def small_heads(seed: int = 0, scale: float = 3.0) -> MedusaHeads:
    """Two distinct random heads over a 12-token vocabulary (``scale`` sharpens them)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(SMALL, scale * torch.randn(12, 8))
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return heads


def observed(
    heads: MedusaHeads, verify_costs: list[float] | None
) -> tuple[MedusaDrafter | LoopSized, Tensor]:
    """A drafter on ``heads`` (sized as the loop sizes it with ``verify_costs``) that has
    observed one step; also the state ``[H]`` it keeps."""
    plain = MedusaDrafter(heads, hidden_layer=2)
    drafter = plain if verify_costs is None else LoopSized(plain, verify_costs)
    drafter.begin(PROMPT)
    hidden = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    drafter.observe(torch.tensor([4, 5, 6]), (hidden,))
    return drafter, hidden[-1]


def reference_nodes(heads: MedusaHeads, hidden: Tensor) -> dict[tuple[int, ...], tuple[int, float]]:
    """Each path of :data:`DEFAULT_CHOICES`: its token and its estimate, the product along the
    path of each head's probability of the chosen rank (a loop over paths, no tree code)."""
    with torch.no_grad():
        logits = heads(hidden)  # [2, V]
    probabilities = torch.softmax(logits.float(), dim=-1)
    ranked = logits.argsort(dim=-1, descending=True)
    nodes = {}
    for path in sorted(DEFAULT_CHOICES, key=lambda path: (len(path), path)):  # tree order
        estimate = 1.0
        for depth, rank in enumerate(path):
            estimate *= float(probabilities[depth, ranked[depth, rank]])
        nodes[path] = (int(ranked[len(path) - 1, path[-1]]), estimate)
    return nodes


def test_flat_costs_send_the_whole_tree_and_steep_costs_nothing() -> None:
    heads = small_heads()
    whole, _ = observed(heads, None)
    free, _ = observed(heads, FLAT)
    expected = whole.propose(PROMPT)
    sent = free.propose(PROMPT)
    assert expected.size == NODES
    assert sent.tokens.tolist() == expected.tokens.tolist()
    assert sent.parents.tolist() == expected.parents.tolist()
    unsure, _ = observed(heads, STEEP)
    assert isinstance(unsure, LoopSized)
    assert unsure.propose(PROMPT).size == 0
    unsure.observe(torch.tensor([3]), (torch.randn(1, 8),))  # nothing was sent: nothing learnt
    assert unsure.calibration is not None and unsure.calibration.scale == 1.0


def test_the_kept_nodes_are_the_best_estimated_ones_and_a_tree() -> None:
    costs = [0.010 * (1 + 0.15 * m) for m in range(NODES + 1)]
    drafter, hidden = observed(small_heads(), costs)
    nodes = reference_nodes(drafter.drafter.heads, hidden)  # type: ignore[union-attr]
    best_first = sorted(nodes, key=lambda path: -nodes[path][1])  # stable: parents first on ties
    count = best_prefix(torch.tensor([nodes[path][1] for path in best_first]), costs)
    assert 0 < count < NODES  # the costs cut the tree somewhere inside
    kept = set(best_first[:count])
    assert all(path[:-1] in kept for path in kept if len(path) > 1)  # ancestor-closed
    in_tree_order = [path for path in nodes if path in kept]

    tree = drafter.propose(PROMPT)
    assert tree.tokens.tolist() == [nodes[path][0] for path in in_tree_order]
    assert tree.parents.tolist() == [
        in_tree_order.index(path[:-1]) if len(path) > 1 else -1 for path in in_tree_order
    ]


def test_heads_that_are_always_rejected_stop_being_sent() -> None:
    """Sharp heads (their top tokens near probability 1) that verification never accepts: the
    calibration falls with every rejected tree until no node pays for its forward."""
    costs = [0.010, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018, 0.019, 0.020]
    costs += [0.021 + 0.001 * m for m in range(NODES + 1 - len(costs))]
    drafter = LoopSized(MedusaDrafter(small_heads(scale=10.0), hidden_layer=2), costs)
    drafter.begin(PROMPT)
    hidden = (torch.randn(1, 8, generator=torch.Generator().manual_seed(3)),)
    sizes = []
    for _ in range(12):
        drafter.observe(torch.tensor([9]), hidden)  # only the bonus token: nothing accepted
        sizes.append(drafter.propose(PROMPT).size)
    assert sizes[0] >= 2 and sizes[-1] == 0, sizes
    assert all(later <= earlier for earlier, later in itertools.pairwise(sizes))
    assert drafter.calibration is not None and drafter.calibration.scale < 0.25


def test_cost_sized_medusa_keeps_greedy_output(tiny_target: Any) -> None:
    truth = hf_greedy(tiny_target, PROMPT, NEW_TOKENS, eos=None)
    lm_head = tiny_target.get_output_embeddings().weight.detach()
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(2, 1, 32, TINY_VOCAB), lm_head)
    with torch.no_grad():  # random heads: mostly wrong drafts
        for parameter in heads.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    layer = final_hidden_layer(tiny_target)

    def run(costs: list[float]) -> tuple[list[int], float]:
        drafter = LoopSized(MedusaDrafter(heads, hidden_layer=layer), costs)
        result = generate(
            tiny_target, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=()
        )
        return result.tokens, result.tau

    for costs in (CPU_LIKE, FLAT, STEEP):
        assert run(costs)[0] == truth
    assert run(STEEP)[1] == 1.0  # nothing sent: plain decoding
    train_heads(tiny_target, heads, torch.cat([PROMPT, torch.tensor(truth)]), steps=60)
    tokens, tau = run(CPU_LIKE)
    assert tokens == truth
    assert tau > 2.5  # fitted heads: sure, and right, so whole paths are sent and accepted


def test_the_decoder_times_the_target_once_for_sizing_cost(tmp_path: Path) -> None:
    target = tiny_model("llama")
    run = save(tmp_path / "run", target, trained_like_heads(target))
    sized = load_drafter(run, target, choices=[[0], [1], [0, 0]])
    assert isinstance(sized, MedusaDrafter) and sized.tree.choices == ((0,), (1,), (0, 0))
    decoder = Decoder(target, sized, DecodeOptions(sizing="cost"))
    truth = hf_greedy(target, PROMPT, 8, eos=None)
    for _ in range(2):  # one table, one calibration over both prompts
        result = decoder.generate(PROMPT, max_new_tokens=8, eos_token_ids=())
        assert result.tokens == truth
    assert decoder.sizer is not None and len(decoder.sizer.costs) == 4
    assert Decoder(target, sized).sizer is None
    with pytest.raises(ValueError, match="sizing='some'"):
        DecodeOptions(sizing="some")  # type: ignore[arg-type]
    with pytest.raises(HeadsError, match="change the tree"):
        load_drafter(run, target, choices=[[0], [TINY_VOCAB]])
