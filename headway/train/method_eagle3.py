"""EAGLE-3 training with training-time test (Li et al. 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", arXiv:2503.01840, §3.2), as a
:class:`~headway.train.methods.Method`.

**Training-time test (TTT).** Teacher forcing alone trains step 0 only: at inference every deeper
draft step reads the drafter's *own* previous state, never a target feature. TTT unrolls S steps
(default 7) over the whole sequence at once. Step 0 reads the fused target features ``g_t``;
step j >= 1 at row t reads the drafter's own output of step j - 1 at row t and the embedding of
the ground-truth token ``x_{t+j+1}`` (the reference shifts ``input_ids`` left once per step), at
rotary position ``t + j`` (the reference's ``position_ids + lck``). Row t of step j drafts
``x_{t+j+2}``; :func:`~headway.train.losses_eagle.eagle3_loss` scores it.

Attention. Step j at row t sees what the drafter will see at inference after committing
``x_0 .. x_{t+1}`` and drafting j tokens: step 0 at rows ``<= t`` of its sample (the committed
pairs) and steps ``1 .. j`` at row t itself (its own chain), nothing else. :func:`ttt_unroll` runs
the stock draft layer once per step over a ``DynamicCache`` that grows by T keys per step, with
the 4-D mask ``[causal within the sample | I | I | ... | I]`` (:func:`ttt_attention_mask`): the
reference's concatenated per-step KV and custom mask, written with transformers' own attention
layer; its attention function is :func:`~headway.decode.grouped_attention.packed_sdpa` (SDPA
with each grouped key/value head read once for its query heads, where the stock function
repeats it; fwd + bwd of a TTT chunk is faster on a CPU). :func:`ttt_unroll_reference`
recomputes every (row, step) from scratch as plain causal decoding, and a test holds the two
equal. Gradients flow through every step, cached keys included, as in the reference (no
feature noise and no feature regression in EAGLE-3).

Rows. A row's state at step j reaches later steps only at its own row (the identity blocks), so
steps ``1 .. S-1`` run only on the rows some loss term reads (``rows``: answer tokens and the few
rows before each answer, about half of a ShareGPT block); step 0 runs on every row, since every
row's step-0 key is read. They run in chunks of ``TTT_CHUNK`` rows of one batch row, each chunk
over the window of step-0 keys its rows can see (its own packed sample, not the whole block):
``R / T`` of the linear work and about ``R (W + jC)`` instead of ``T (T + jT)`` of the attention
(window W, chunk C). The kept rows' states and gradients are exactly those of the full unroll
(``tests/test_eagle3.py``; ``scripts/bench_train.py`` prints the gain).

**Draft vocabulary.** The N most frequent trained tokens of the training data
(:func:`~headway.train.vocab_counts.training_vocab`). The draft LM head starts from the target's
rows for those tokens (``eagle3.lm_head_init=target``; the reference starts from a random
``nn.Linear``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from headway.decode.grouped_attention import PACKED
from headway.heads.eagle import TargetHead, additive_mask
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.hidden_states import final_hidden_layer
from headway.heads.loading import FoundHeads
from headway.heads.vocab import DraftVocab
from headway.run_config import RunConfig
from headway.target import Target
from headway.train.batching import document_attention_mask
from headway.train.init_weights import check_head_config, load_initial
from headway.train.losses import LossOutput
from headway.train.losses_eagle import eagle3_loss, eagle3_rows
from headway.train.losses_lk import LKLoss
from headway.train.vocab_counts import training_vocab

__all__ = [
    "Eagle3",
    "ttt_attention_mask",
    "ttt_row_count",
    "ttt_unroll",
    "ttt_unroll_reference",
]

TTT_CHUNK = 64  # rows per chunk of TTT steps >= 1 (ttt_unroll)


def ttt_attention_mask(visible: Tensor, step: int, dtype: torch.dtype) -> Tensor:
    """Additive mask ``[B, 1, R, T + step R]`` of TTT step ``step`` over the keys of steps
    ``0 .. step`` (in cache order): ``visible`` (bool ``[B, 1, R, T]``: R rows, causal within a
    sample; R = T when every row runs) for step 0's keys, the identity (row r sees only row r)
    for each later step's.

    Example, T = 3, step 2 (``.`` = blocked)::

        row 0:  1 . .   1 . .   1 . .
        row 1:  1 1 .   . 1 .   . 1 .
        row 2:  1 1 1   . . 1   . . 1
    """
    rows = visible.shape[-2]
    own = torch.eye(rows, dtype=torch.bool, device=visible.device)
    own = own.expand(*visible.shape[:-1], rows)
    return additive_mask(torch.cat([visible, *([own] * step)], dim=-1), dtype)


def _shift_left(embeddings: Tensor, offset: int) -> Tensor:
    """Row t gets ``embeddings[:, t + offset]``; rows past the end get zeros. ``[B, T, H]``."""
    pad = embeddings.new_zeros(
        embeddings.shape[0], min(offset, embeddings.shape[1]), *embeddings.shape[2:]
    )
    return torch.cat([embeddings[:, offset:], pad], dim=1)


def ttt_unroll(
    draft: Eagle3Model,
    fused: Tensor,
    embeddings: Tensor,
    *,
    positions: Tensor,
    visible: Tensor,
    steps: int,
    rows: Tensor | None = None,
    chunk: int = TTT_CHUNK,
) -> list[Tensor]:
    """The draft's states after each of ``steps`` TTT steps (module docstring).

    Args:
        draft: the EAGLE-3 draft model.
        fused: ``[B, T, H]``, ``g_t = fc([l_t; m_t; h_t])``.
        embeddings: ``[B, T, H]``, the target's embedding of ``x_t`` (row t of step j reads row
            ``t + j + 1``; zeros past the end).
        positions: LongTensor ``[B or 1, T]``, position of row t (restarting per packed sample).
        visible: bool ``[B, 1, T, T]``, step 0's attention: causal within a sample.
        steps: S, how many draft steps to unroll.
        rows: bool ``[B, T]``, the rows steps ``1 .. S-1`` must compute (module docstring);
            ``None``: every row.
        chunk: steps ``1 .. S-1`` run the kept rows in chunks of this many rows of one batch
            row each (so a batch row keeping few rows does not pay for one keeping many).

    Returns:
        S tensors ``[B, T, H]``: the pre-norm state after step j at each row (steps >= 1: zeros
        at rows ``rows`` leaves out).
    """
    cache = draft.new_cache()
    states = draft(
        fused,
        _shift_left(embeddings, 1),
        position_ids=positions,
        attention_mask=ttt_attention_mask(visible, 0, fused.dtype),
        cache=cache,
    )
    outputs = [states]
    if steps == 1:
        return outputs
    batch, length = fused.shape[:2]
    chunks = None if rows is None else _row_chunks(rows, chunk)
    if chunks is not None:  # [K] batch row of each chunk, [K, C] its rows, [K, C] kept
        item, index, kept = chunks
        states = states[item[:, None], index]
        positions = positions.expand(batch, length)[item[:, None], index]
        visible = visible.expand(batch, 1, length, length)[item[:, None], 0, index][:, None]
        cache.batch_select_indices(item)  # each chunk reads its batch row's step-0 keys
        visible = _window_keys(cache, visible, kept)  # ... those its kept rows can see
    for step in range(1, steps):
        shifted = _shift_left(embeddings, step + 1)
        states = draft(
            states,
            shifted if chunks is None else shifted[item[:, None], index],
            position_ids=positions + step,
            attention_mask=ttt_attention_mask(visible, step, fused.dtype),
            cache=cache,
        )
        if chunks is None:
            outputs.append(states)
        else:
            full = states.new_zeros(batch, length, states.shape[-1])
            kept_states = states * kept[..., None].to(states.dtype)
            outputs.append(full.index_put((item[:, None], index), kept_states, accumulate=True))
    return outputs


def _window_keys(cache: DynamicCache, visible: Tensor, kept: Tensor) -> Tensor:
    """Cut each chunk's step-0 keys (``[K, heads, T, d]`` in ``cache``) to the one window of
    ``W`` columns that holds every key its kept rows see (``visible`` bool ``[K, 1, C, T]``,
    ``kept`` bool ``[K, C]``), W the widest chunk's; returns ``visible`` over the windows,
    ``[K, 1, C, W]``. A chunk of packed samples thus attends over its own sample's keys, not
    the whole block. Filler rows may see nothing here; they see their own later-step keys."""
    length = visible.shape[-1]
    seen = (visible[:, 0] & kept[:, :, None]).any(1)  # [K, T]
    columns = torch.arange(length, device=visible.device)
    first = torch.where(seen, columns, length).amin(-1)
    last = torch.where(seen, columns, -1).amax(-1)
    width = max(int((last - first).amax()) + 1, 1)
    start = first.clamp(0, length - width)
    take = start[:, None] + torch.arange(width, device=visible.device)  # [K, W]
    for layer in cache.layers:
        held = cast(DynamicLayer, layer)
        assert held.keys is not None and held.values is not None  # step 0 has run
        index = take[:, None, :, None].expand(-1, held.keys.shape[1], -1, held.keys.shape[-1])
        held.keys, held.values = held.keys.gather(2, index), held.values.gather(2, index)
    return visible.gather(-1, take[:, None, None, :].expand(-1, 1, visible.shape[2], -1))


def ttt_row_count(rows: Tensor, chunk: int = TTT_CHUNK) -> int:
    """Rows each TTT step >= 1 of :func:`ttt_unroll` runs for kept ``rows`` ``[B, T]``
    (the rows chunks are filled up with included)."""
    chunks = _row_chunks(rows, chunk)
    return rows.numel() if chunks is None else chunks[1].numel()


def _row_chunks(rows: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """The kept rows (bool ``[B, T]``) cut into chunks of ``size`` rows of one batch row each:
    LongTensors ``[K]`` (the batch row of each chunk) and ``[K, C]`` (its rows; the last chunk of
    a batch row is filled up with row 0), bool ``[K, C]`` (which of them are kept rows).
    ``None`` where every row is kept."""
    if bool(rows.all()):
        return None
    size = max(1, min(size, rows.shape[1]))
    items, indices, kept = [], [], []
    for b, row in enumerate(rows):
        chosen = row.nonzero().flatten()
        count = -(-len(chosen) // size)
        count = max(count, 1) if b == 0 else count  # K >= 1 even if no row is kept
        filled = torch.zeros(count * size, dtype=torch.long, device=rows.device)
        filled[: len(chosen)] = chosen
        flags = torch.arange(count * size, device=rows.device) < len(chosen)
        indices.append(filled.view(count, size))
        kept.append(flags.view(count, size))
        items.append(torch.full((count,), b, dtype=torch.long, device=rows.device))
    return torch.cat(items), torch.cat(indices), torch.cat(kept)


def ttt_unroll_reference(
    draft: Eagle3Model, fused: Tensor, embeddings: Tensor, steps: int
) -> list[Tensor]:
    """The slow, obvious :func:`ttt_unroll` for one unpadded sequence (``[1, T, H]`` inputs):
    every row t is decoded on its own, as the drafter would at inference, by a plain causal
    forward over the committed pairs ``0 .. t`` followed by its own chain of drafted pairs, run
    from scratch (no cache, no TTT mask) once per step."""
    length = fused.shape[1]
    zero = embeddings.new_zeros(1, 1, embeddings.shape[-1])
    padded = torch.cat([embeddings, *([zero] * (steps + 1))], dim=1)
    outputs = [torch.zeros_like(fused) for _ in range(steps)]
    for row in range(length):
        features = fused[:, : row + 1]
        for step in range(steps):
            tokens = padded[:, 1 : row + step + 2]  # x_1 .. x_{row+step+1}
            states = draft(features, tokens, attention_mask=None)  # causal, positions 0 ..
            outputs[step][0, row] = states[0, -1]
            features = torch.cat([features, states[:, -1:]], dim=1)
    return outputs


class Eagle3(nn.Module):
    """The ``eagle3`` method: an EAGLE-3 drafter trained with training-time test."""

    name = "eagle3"

    def __init__(
        self,
        config: RunConfig,
        target: Target,
        *,
        vocab: DraftVocab | None = None,
        init: FoundHeads | None = None,
    ) -> None:
        super().__init__()
        settings = config.eagle3
        layers = settings.feature_layers
        self.head_config = Eagle3Config.from_target(
            target.model,
            draft_vocab_size=settings.draft_vocab_size,
            feature_layers=(layers[0], layers[1], layers[2]) if layers else None,
            fc_norm=settings.fc_norm,
            norm_output=settings.norm_output,
        )
        self.final_layer = final_hidden_layer(target.model)
        self.feature_layers = (*self.head_config.feature_layers, self.final_layer)
        if init is not None:
            check_head_config(
                self.head_config,
                init,
                "eagle3",
                ("draft_vocab_size", "feature_layers", "fc_norm", "norm_output"),
            )
            vocab = DraftVocab.from_tensors(init.state_dict["d2t"], init.state_dict["t2d"])
        if vocab is None:
            vocab = training_vocab(
                config, target, self.feature_layers, self.head_config.draft_vocab_size
            )
        # Grouped key/value heads read once per query group (the draft's own sdpa repeats
        # them): the same attention in a third less time on a CPU (module docstring).
        self.draft = Eagle3Model(self.head_config, attn_implementation=PACKED)
        self.draft.set_vocab(vocab)
        self.target_head = TargetHead.of(target.model)  # a plain attribute: not a submodule
        if settings.lm_head_init == "target":
            weight = self.target_head.lm_head.weight
            assert isinstance(weight, Tensor)
            self.draft.lm_head.weight.data.copy_(weight.detach()[vocab.target_ids])
        self.steps, self.decay = settings.ttt_steps, settings.loss_decay
        self.lk: LKLoss | None = None  # eagle3.loss: the soft CE, or an LK loss in its place
        if settings.loss != "soft_ce":
            self.lk = LKLoss(settings.loss, settings.lk_scale, settings.lk_decay)
        if init is not None:
            load_initial(self.draft, init)

    @property
    def dtype(self) -> torch.dtype:
        return self.draft.fc.weight.dtype

    def _visible(self, batch: dict[str, Tensor]) -> Tensor:
        """Bool ``[B, 1, T, T]``: causal, within one sample, padding only sees padding."""
        if "document_ids" in batch:
            return document_attention_mask(batch["document_ids"])
        return document_attention_mask(batch["attention_mask"].long() - 1)

    def ttt_rows(self, batch: dict[str, Tensor]) -> Tensor:
        """Bool ``[B, T]``: the rows TTT steps ``1 .. S-1`` run (those their losses read)."""
        return eagle3_rows(batch["loss_mask"], self.steps, batch.get("document_ids"))[1:].any(0)

    def forward(self, batch: dict[str, Tensor], hidden: dict[int, Tensor]) -> LossOutput:
        """Loss of a batch: ``input_ids``/``attention_mask``/``loss_mask`` ``[B, T]`` (+ packed
        ``position_ids``/``document_ids``); ``hidden[l]`` ``[B, T, H]`` for the three feature
        layers and the final one (the target's LM-head input, for its distribution)."""
        taps = [hidden[layer].to(self.dtype) for layer in self.head_config.feature_layers]
        fused = self.draft.fuse(torch.cat(taps, dim=-1))
        ids = batch["input_ids"]
        with torch.no_grad():
            embeddings = self.target_head.embed_tokens(ids, self.dtype)
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
        states = ttt_unroll(
            self.draft,
            fused,
            embeddings,
            positions=positions,
            visible=self._visible(batch),
            steps=self.steps,
            rows=self.ttt_rows(batch),
        )
        return eagle3_loss(
            states,
            hidden[self.final_layer],
            batch["loss_mask"],
            draft_logits=self.draft.logits,
            target_logits=self.target_head.logits,
            target_ids=self.draft.vocab.target_ids,
            decay=self.decay,
            document_ids=batch.get("document_ids"),
            target_argmax=batch.get("target_argmax"),  # offline features carry it
            lk=self.lk,
        )

    def parameter_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        return [{"params": list(self.draft.parameters()), "lr": lr, "weight_decay": weight_decay}]

    def export(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """(head config, draft weights with ``d2t``/``t2d``), never the target's tensors."""
        state = {name: value.detach().cpu() for name, value in self.draft.state_dict().items()}
        return self.head_config.to_dict(), state
