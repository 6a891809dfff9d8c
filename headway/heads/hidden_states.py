"""Which of a target's ``output_hidden_states`` its LM head reads, checked by a forward hook:
the hidden state Medusa heads and the feature drafters are trained and run on.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.errors import TargetError

__all__ = ["check_final_hidden", "final_hidden_layer"]


def final_hidden_layer(model: PreTrainedModel) -> int:
    """Index into ``output_hidden_states`` of the LM head's input: ``num_hidden_layers``, the last
    entry. In transformers 5.23 that entry is taken after the final norm for Llama, Qwen2 and
    GPT-2 (and every model built on the standard decoder template);
    :func:`check_final_hidden` verifies it for any other model."""
    return int(model.config.get_text_config().num_hidden_layers)


def _probe_ids(model: PreTrainedModel) -> Tensor:
    """A few ordinary token ids ``[1, 4]`` (not the pad token, whose embedding is often zero and
    would make every hidden state zero, hence equal)."""
    pad = getattr(model.config.get_text_config(), "pad_token_id", None)  # CodeGen has none
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = [token for token in range(1, min(vocab, 6)) if token != pad][:4]
    return torch.tensor([ids], dtype=torch.long, device=model.device)


def check_final_hidden(model: PreTrainedModel, layer: int) -> None:
    """Run a few tokens through ``model`` and check that ``output_hidden_states[layer]`` is exactly
    what its output embedding (LM head) consumes, by capturing that input with a forward hook.

    Raises:
        TargetError: for a model family whose hidden states are not ``[batch, tokens, hidden]``
            (Gemma 3n's carry its AltUp streams), or are taken elsewhere (e.g. before a final
            norm): drafters trained on those would read the wrong vector.
    """
    captured: list[Tensor] = []

    def capture(module: torch.nn.Module, args: tuple[Tensor, ...]) -> None:
        captured.append(args[0])

    handle = model.get_output_embeddings().register_forward_pre_hook(capture)
    try:
        with torch.inference_mode():
            ids = _probe_ids(model)
            outputs = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                output_hidden_states=True,
                use_cache=False,
            )
    finally:
        handle.remove()
    shapes = sorted({tuple(state.shape) for state in outputs.hidden_states})
    if any(len(shape) != 3 or shape[:2] != tuple(ids.shape) for shape in shapes):
        raise TargetError(
            f"{type(model).__name__}: its output_hidden_states are {[list(s) for s in shapes]} "
            f"for {list(ids.shape)} tokens, not [batch, tokens, hidden] (Gemma 3n stacks its "
            "AltUp streams), so Medusa and EAGLE drafters cannot read them; use prompt lookup "
            "or retrieval"
        )
    hidden = outputs.hidden_states[layer]
    if not captured or captured[-1].shape != hidden.shape or not torch.equal(captured[-1], hidden):
        raise TargetError(
            f"{type(model).__name__}: output_hidden_states[{layer}] is not the input of its LM "
            "head, so Medusa heads cannot read the right hidden state from this model family; "
            "it needs explicit support in headway.heads.hidden_states"
        )
