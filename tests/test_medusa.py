"""Medusa heads, the Medusa and distillation losses, and the Medusa drafter.

Losses are checked on hand-made logits whose right answer is known (head k at position t must be
scored against token t + k + 1), and the fast versions against their slow references; the drafter
must keep greedy output identical to transformers' own greedy decoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode.generate import generate
from headway.drafters.medusa_drafter import (
    DEFAULT_CHOICES,
    MC_SIM_7B_63,
    MedusaDrafter,
    resolve_choices,
)
from headway.errors import TargetError
from headway.heads.hidden_states import check_final_hidden, final_hidden_layer
from headway.heads.medusa import MedusaConfig, MedusaHeads, medusa_tensor_shapes
from headway.train.losses import (
    distillation_kl,
    distillation_kl_reference,
    label_mask,
    medusa_loss,
    medusa_loss_reference,
)
from tests.tiny import TINY_VOCAB, tiny_model

PROMPT = torch.tensor([1, 5, 17, 33, 8, 40, 41, 9])
OTHER_PROMPT = torch.tensor([1, 70, 3, 52, 12, 88])
NEW_TOKENS = 40


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and stay fast on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- heads


def test_blocks_and_heads_are_distinct_parameters() -> None:
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=2, hidden_size=8, vocab_size=12))
    pointers = [parameter.data_ptr() for parameter in heads.parameters()]
    assert len(pointers) == 3 * (2 * 2 + 1)  # per head: 2 blocks x (weight, bias) + lm_head
    assert len(set(pointers)) == len(pointers)

    with torch.no_grad():  # the reference's `[ResBlock] * L` would change both blocks here
        heads.get_parameter("heads.0.blocks.0.linear.weight").add_(1.0)
    assert bool((heads.get_parameter("heads.0.blocks.1.linear.weight") == 0).all())
    assert bool((heads.get_parameter("heads.1.blocks.0.linear.weight") == 0).all())


def test_training_one_head_leaves_the_others_alone() -> None:
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(3, 2, 8, 12), torch.randn(12, 8))
    before = {name: tensor.clone() for name, tensor in heads.state_dict().items()}
    optimizer = torch.optim.SGD(heads.parameters(), lr=0.1)
    heads(torch.randn(2, 5, 8))[0].logsumexp(-1).sum().backward()  # a loss on head 0 only
    optimizer.step()
    changed = {
        name for name, tensor in heads.state_dict().items() if not torch.equal(tensor, before[name])
    }
    assert {name.split(".")[1] for name in changed} == {"0"}
    assert "heads.0.blocks.0.linear.weight" in changed
    assert "heads.0.blocks.1.linear.weight" in changed


def test_fresh_heads_equal_the_lm_head(tiny_target: Any) -> None:
    layer = final_hidden_layer(tiny_target)
    ids = PROMPT[None]
    with torch.no_grad():
        outputs = tiny_target(
            input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True
        )
        lm_head = tiny_target.get_output_embeddings().weight
        heads = MedusaHeads(MedusaConfig(3, 2, 32, TINY_VOCAB), lm_head)
        logits = heads(outputs.hidden_states[layer])
    assert logits.shape == (3, 1, PROMPT.numel(), TINY_VOCAB)
    for head_logits in logits:
        torch.testing.assert_close(head_logits, outputs.logits, atol=1e-6, rtol=1e-6)
    copied = heads.get_parameter("heads.0.lm_head.weight")
    assert copied.data_ptr() != lm_head.data_ptr()  # a copy, not an alias


def test_forward_shapes_and_first_heads_only() -> None:
    heads = MedusaHeads(MedusaConfig(4, 1, 8, 12), torch.randn(12, 8))
    hidden = torch.randn(2, 3, 8)
    assert heads(hidden).shape == (4, 2, 3, 12)
    torch.testing.assert_close(heads(hidden, num_heads=2), heads(hidden)[:2])
    shapes = medusa_tensor_shapes(MedusaConfig(2, 1, 8, 12))
    assert shapes == {
        "heads.0.blocks.0.linear.weight": (8, 8),
        "heads.0.blocks.0.linear.bias": (8,),
        "heads.0.lm_head.weight": (12, 8),
        "heads.1.blocks.0.linear.weight": (8, 8),
        "heads.1.blocks.0.linear.bias": (8,),
        "heads.1.lm_head.weight": (12, 8),
    }


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(0, 1, 8, 12)
    with pytest.raises(ValueError, match="unknown keys \\['typo'\\]"):
        MedusaConfig.from_dict(
            {"num_heads": 1, "num_layers": 1, "hidden_size": 8, "vocab_size": 12, "typo": 1}
        )
    config = MedusaConfig(2, 0, 8, 12)
    assert MedusaConfig.from_dict(config.to_dict()) == config


# ----------------------------------------------------------------------------- Medusa loss

SEQUENCES = torch.tensor([[3, 7, 1, 9, 4, 6, 2, 8, 5], [10, 2, 6, 0, 11, 3, 9, 1, 7]])  # no repeats
VOCAB = 12


def aligned_logits(ids: Tensor, num_heads: int, offset: int, margin: float = 30.0) -> Tensor:
    """Logits ``[K, B, T, V]`` whose head i at position t puts ``margin`` on token t + i + offset
    (perfect for offset 2, the Medusa alignment) and stay uniform where that is past the end."""
    batch, length = ids.shape
    logits = torch.zeros(num_heads, batch, length, VOCAB)
    for i in range(num_heads):
        for b in range(batch):
            for t in range(length - i - offset):
                logits[i, b, t, ids[b, t + i + offset]] = margin
    return logits


def test_head_k_at_t_is_scored_against_token_t_plus_k_plus_1() -> None:
    mask = torch.ones_like(SEQUENCES)
    perfect = medusa_loss(aligned_logits(SEQUENCES, 3, offset=2), SEQUENCES, mask)
    assert perfect.loss.item() < 1e-6
    for k in (1, 2, 3):
        assert perfect.metrics[f"head{k}/top1"] == 1.0
        assert perfect.metrics[f"head{k}/ce"] < 1e-6
        assert perfect.metrics[f"head{k}/tokens"] == 2 * (9 - k - 1)
    for offset in (1, 3):  # one token too early / too late
        shifted = medusa_loss(aligned_logits(SEQUENCES, 3, offset=offset), SEQUENCES, mask)
        assert shifted.loss.item() > 10.0
        assert all(shifted.metrics[f"head{k}/top1"] == 0.0 for k in (1, 2, 3))


def test_loss_weights_are_decay_to_the_k() -> None:
    mask = torch.ones_like(SEQUENCES)
    logits = aligned_logits(SEQUENCES, 3, offset=2)
    logits[1] = 0.0  # head 2 uniform: CE = log V; heads 1 and 3 perfect
    for decay in (0.8, 0.5):
        output = medusa_loss(logits, SEQUENCES, mask, decay=decay)
        assert output.metrics["head2/ce"] == pytest.approx(math.log(VOCAB), rel=1e-5)
        assert output.loss.item() == pytest.approx(decay**2 * math.log(VOCAB), rel=1e-4)
    torch.manual_seed(0)
    random = torch.randn(3, 2, 9, VOCAB)
    output = medusa_loss(random, SEQUENCES, mask)
    weighted = sum(0.8**k * output.metrics[f"head{k}/ce"] for k in (1, 2, 3))
    assert output.loss.item() == pytest.approx(weighted, rel=1e-5)


def test_masked_labels_are_ignored() -> None:
    mask = torch.ones_like(SEQUENCES)
    mask[0, 4] = 0  # label x4 of row 0 is not trained: head 1 at t=2, head 2 at t=1, head 3 at t=0
    mask[1, :3] = 0  # a prompt: labels 0..2 of row 1
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 9, VOCAB)
    output = medusa_loss(logits, SEQUENCES, mask)
    assert output.metrics["head1/tokens"] == (7 - 1) + (7 - 1)  # row 1 loses label 2 (t=0)
    assert output.metrics["head3/tokens"] == (5 - 1) + 5
    scrambled = logits.clone()
    scrambled[0, 0, 2] = 100.0 * torch.randn(VOCAB)  # rows whose label is masked out
    scrambled[1, 0, 1] = 100.0 * torch.randn(VOCAB)
    scrambled[2, 0, 0] = 100.0 * torch.randn(VOCAB)
    scrambled[0, 1, 0] = 100.0 * torch.randn(VOCAB)
    scrambled[:, :, -2:] = 100.0 * torch.randn(3, 2, 2, VOCAB)  # no label at all (past the end)
    assert medusa_loss(scrambled, SEQUENCES, mask).loss.item() == pytest.approx(output.loss.item())
    scrambled[0, 0, 3] += 5.0 * torch.randn(VOCAB)  # a trained position does count
    assert medusa_loss(scrambled, SEQUENCES, mask).loss.item() != pytest.approx(output.loss.item())


@pytest.mark.parametrize(("length", "num_heads"), [(9, 3), (3, 3), (1, 2)])
def test_fast_loss_equals_the_reference(length: int, num_heads: int) -> None:
    torch.manual_seed(length)
    ids = torch.randint(0, VOCAB, (2, length))
    mask = (torch.rand(2, length) > 0.3).long()
    logits = torch.randn(num_heads, 2, length, VOCAB, requires_grad=True)
    fast = medusa_loss(logits, ids, mask, decay=0.7)
    slow = medusa_loss_reference(logits, ids, mask, decay=0.7)
    torch.testing.assert_close(fast.loss, slow.loss)
    assert fast.metrics.keys() == slow.metrics.keys()
    for name, value in fast.metrics.items():
        assert value == pytest.approx(slow.metrics[name], rel=1e-5, abs=1e-6), name
    if length > 2:
        (fast_grad,) = torch.autograd.grad(fast.loss, logits)
        (slow_grad,) = torch.autograd.grad(slow.loss, logits)
        torch.testing.assert_close(fast_grad, slow_grad)


def test_loss_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="disagree"):
        medusa_loss(torch.zeros(2, 2, 5, VOCAB), SEQUENCES, torch.ones_like(SEQUENCES))


# ----------------------------------------------------------------------------- distillation KL


def test_distillation_kl_matches_reference_and_masks() -> None:
    torch.manual_seed(0)
    student = torch.randn(2, 6, VOCAB, requires_grad=True)
    teacher = torch.randn(2, 6, VOCAB, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 0]])
    fast = distillation_kl(student, teacher, mask)
    torch.testing.assert_close(fast, distillation_kl_reference(student, teacher, mask))
    assert fast.item() > 0
    fast.backward()
    assert teacher.grad is None  # the frozen teacher gets no gradient
    assert student.grad is not None and bool((student.grad[0, 2] == 0).all())  # masked row
    assert distillation_kl(teacher, teacher, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_distillation_kl_is_teacher_to_student() -> None:
    teacher = torch.log(torch.tensor([[[0.9, 0.1]]]))
    student = torch.log(torch.tensor([[[0.5, 0.5]]]))
    expected = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # KL(p_T || p_S)
    value = distillation_kl(student, teacher, torch.ones(1, 1))
    assert value.item() == pytest.approx(expected, rel=1e-5)
    assert label_mask(torch.tensor([[0, 0, 1, 1]]), 1).tolist() == [[False, True, True, False]]


# ----------------------------------------------------------------------------- drafter


def hf_greedy(model: Any, prompt: Tensor) -> list[int]:
    ids = prompt[None]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        pad_token_id=0,
    )
    tokens: list[int] = out[0, prompt.numel() :].tolist()
    return tokens


def train_heads(model: Any, heads: MedusaHeads, sequence: Tensor, steps: int) -> None:
    """Fit ``heads`` to the target's own greedy ``sequence`` ``[T]`` (a few Adam steps)."""
    layer = final_hidden_layer(model)
    with torch.no_grad():
        ids = sequence[None]
        hidden = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True
        ).hidden_states[layer]
    optimizer = torch.optim.Adam(heads.parameters(), lr=3e-2)
    for _ in range(steps):
        loss = medusa_loss(heads(hidden), ids, torch.ones_like(ids)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_medusa_drafter_keeps_greedy_output(tiny_target: Any) -> None:
    torch.manual_seed(0)
    lm_head = tiny_target.get_output_embeddings().weight.detach()
    heads = MedusaHeads(MedusaConfig(3, 1, 32, TINY_VOCAB), lm_head)
    with torch.no_grad():  # random heads: mostly wrong drafts
        for parameter in heads.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    layer = final_hidden_layer(tiny_target)
    truth = {
        name: hf_greedy(tiny_target, prompt)
        for name, prompt in (("a", PROMPT), ("b", OTHER_PROMPT))
    }

    def run(prompt: Tensor, drafter: MedusaDrafter) -> tuple[list[int], float]:
        result = generate(
            tiny_target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=()
        )
        return result.tokens, result.tau

    tokens, _ = run(PROMPT, MedusaDrafter(heads, hidden_layer=layer))
    assert tokens == truth["a"]

    train_heads(tiny_target, heads, torch.cat([PROMPT, torch.tensor(truth["a"])]), steps=60)
    for choices, depth in (("default", 2), (MC_SIM_7B_63, 3)):
        tokens, tau = run(PROMPT, MedusaDrafter(heads, hidden_layer=layer, choices=choices))
        assert tokens == truth["a"]
        assert tau > depth + 0.8  # heads fitted to this very continuation: nearly all accepted
    tokens, tau = run(OTHER_PROMPT, MedusaDrafter(heads, hidden_layer=layer))
    assert tokens == truth["b"]  # a prompt the heads were not fitted to: few drafts accepted


def test_drafter_proposes_the_heads_top_k_in_tree_order() -> None:
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(2, 1, 8, 12), torch.randn(12, 8))
    drafter = MedusaDrafter(heads, hidden_layer=2, choices=[[0], [1], [0, 0], [0, 1], [1, 0]])
    drafter.begin(PROMPT)
    assert drafter.propose(PROMPT).size == 0  # nothing observed yet
    hidden = torch.randn(3, 8)
    drafter.observe(torch.tensor([4, 5, 6]), (hidden,))
    tree = drafter.propose(PROMPT)
    with torch.no_grad():
        ranked = heads(hidden[-1]).argsort(dim=-1, descending=True)  # [2, V]; the LAST state
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1]
    expected = [ranked[0, 0], ranked[0, 1], ranked[1, 0], ranked[1, 1], ranked[1, 0]]
    assert tree.tokens.tolist() == [int(token) for token in expected]


def test_choices_are_resolved_and_trimmed_to_the_heads() -> None:
    assert len(DEFAULT_CHOICES) == 16
    assert max(len(path) for path in DEFAULT_CHOICES) == 2
    assert resolve_choices("mc_sim_7b_63", 4) == MC_SIM_7B_63
    trimmed = resolve_choices("mc_sim_7b_63", 2)
    assert trimmed and max(len(path) for path in trimmed) == 2
    with pytest.raises(ValueError, match="unknown Medusa choices"):
        resolve_choices("nope", 3)
    heads = MedusaHeads(MedusaConfig(1, 1, 8, 4))
    with pytest.raises(ValueError, match="vocabulary has only 4"):
        MedusaDrafter(heads, hidden_layer=2, choices=[[0], [5]])


def test_final_hidden_state_is_the_lm_head_input(tiny_target: Any) -> None:
    layer = final_hidden_layer(tiny_target)
    assert layer == tiny_target.config.num_hidden_layers
    check_final_hidden(tiny_target, layer)
    with pytest.raises(TargetError, match="not the input of its LM head"):
        check_final_hidden(tiny_target, layer - 1)  # a decoder layer's output, before the norm


def test_begin_resets_the_drafter() -> None:
    """begin() resets the drafter: a second generation starts from an empty proposal."""
    model = tiny_model("llama", seed=1)
    heads = MedusaHeads(
        MedusaConfig(2, 1, 32, TINY_VOCAB), model.get_output_embeddings().weight.detach()
    )
    drafter = MedusaDrafter(heads, hidden_layer=final_hidden_layer(model))
    first = generate(model, PROMPT, drafter=drafter, max_new_tokens=10, eos_token_ids=())
    drafter.begin(OTHER_PROMPT)
    assert drafter.propose(OTHER_PROMPT).size == 0
    second = generate(model, PROMPT, drafter=drafter, max_new_tokens=10, eos_token_ids=())
    assert first.tokens == second.tokens
