"""Comparing headway's EAGLE-3 draft model with another library's on the same inputs.

The other library's model is driven as its training drives it (test-time training): step 1
reads the target's states at every position t and the embedding of x_{t+1}; step k reads step
k-1's output states and x_{t+k} (0 past the end), its row t attending to step 1's rows up to t
and to its own row in the steps between, one position further each step. Helpers here run
headway's :class:`~headway.heads.eagle3.Eagle3Model` the same way and compare the argmax of
every step at every position (draft-vocabulary ids)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headway.heads.eagle import additive_mask
from headway.heads.eagle3 import Eagle3Model
from headway.heads.format_eagle3 import import_eagle3
from tests.test_eagle3 import PROMPT, target_and_truth

STEPS = 3
"""Draft steps compared: each after the first takes the step before's output states (normed
first under EAGLE-3.1's ``norm_output``) and attends to the first step's keys and its own row's
in the steps between."""

SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-eagle3"

QUESTION = "Explain what a hash table is, with an example in Python."

Drafts = Callable[[Tensor, Tensor], list[Tensor]]
"""``(features [1, T, 3H], next_ids [1, T]) -> [argmax [1, T]] * STEPS`` of another library."""


def shipped_draft() -> Eagle3Model:
    """The shipped drafter (eagle3-hf, bf16) as headway reads it, in fp32."""
    imported = import_eagle3(SHIPPED)
    draft = Eagle3Model(imported.config)
    draft.load_state_dict(imported.state_dict)
    return draft.float().eval()


def tiny_ids(family: str = "llama") -> Tensor:
    """``[1, L]``: the prompt and the greedy continuation of the tiny target of ``family``."""
    return torch.cat([PROMPT, torch.tensor(target_and_truth(family)[1])])[None]


def question_ids(tokenizer: Any) -> Tensor:
    """``[1, L]``: :data:`QUESTION` in the target's chat template (43 tokens for SmolLM2)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    ids: Tensor = tokenizer(text, return_tensors="pt").input_ids
    return ids


def features_and_next(model: Any, ids: Tensor, layers: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """The target's states at ``layers`` for ``ids [1, L]`` (positions 0..L-2, concatenated:
    ``[1, L - 1, 3H]``) and the next ids ``[1, L - 1]``."""
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[layer] for layer in layers], dim=-1)[:, :-1], ids[:, 1:]


def headway_drafts(
    draft: Eagle3Model, embed: Any, features: Tensor, next_ids: Tensor
) -> list[Tensor]:
    """headway's draft steps (see the module docstring) with the target's embedding ``embed``."""
    length = next_ids.shape[1]
    cache, states, drafts = draft.new_cache(), draft.fuse(features), []
    visible, ids = torch.ones(length, length, dtype=torch.bool).tril(), next_ids
    with torch.no_grad():
        for step in range(STEPS):
            mask = additive_mask(visible, features.dtype)[None, None]
            positions = torch.arange(length)[None] + step
            states = draft(
                states, embed(ids), position_ids=positions, attention_mask=mask, cache=cache
            )
            drafts.append(draft.logits(states).argmax(-1))
            ids = next_step_ids(ids)
            visible = torch.cat([visible, torch.eye(length, dtype=torch.bool)], dim=-1)
    return drafts


def next_step_ids(ids: Tensor) -> Tensor:
    """``[1, T]`` shifted one left, 0 at the end: what the next step embeds."""
    return torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=-1)


def assert_same_drafts(theirs: Drafts, draft: Eagle3Model, model: Any, ids: Tensor) -> None:
    """``theirs`` and ``draft`` draft the same tokens at every position of ``ids [1, L]`` in
    every step, on ``model``'s states and embedding."""
    features, next_ids = features_and_next(model, ids, draft.config.feature_layers)
    ours = headway_drafts(draft, model.get_input_embeddings(), features, next_ids)
    drafted = theirs(features, next_ids)
    assert len(drafted) == len(ours) == STEPS
    for step, (mine, other) in enumerate(zip(ours, drafted, strict=True)):
        assert torch.equal(mine, other), f"draft step {step + 1}"


def assert_same_tensors(state: dict[str, Tensor], draft: Eagle3Model, prefix: str) -> None:
    """Every tensor of ``draft`` is in ``state`` under its name (``midlayer.`` read as
    ``prefix``), equal after casting to its dtype."""
    for name, tensor in draft.state_dict().items():
        their_name = name.replace("midlayer.", prefix)
        assert their_name in state, name
        assert torch.equal(state[their_name].to(tensor.dtype), tensor), name
