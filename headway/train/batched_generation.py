"""Batched generation that keeps every row busy: finished rows leave, waiting prompts join.

``model.generate`` on a padded batch computes every row until the longest answer ends, so with
a 512-token cap and answers of 50 to 512 tokens much of the work is spent on rows that are done;
and its cache grows by concatenation, copying the whole cache at every step. Here (one stock HF
model, no forked modeling code):

- the cache of each layer is a buffer with spare capacity (:class:`SlotLayer`); a step writes
  one column in place and attention reads a view of the filled part;
- a row that ends (EOS or the token cap) leaves the batch at once, and once at most
  ``refill_fraction`` of the slots are busy, waiting prompts are prefilled (left-padded among
  themselves, logits of the last position only) and joined to the batch;
- rows of different lengths share the cache by left padding: the 2-D attention mask hides the
  padding and ``position_ids`` count each row's own tokens, so a row sees exactly what it would
  see alone, and leading columns that no row uses any more are cut off;
- grouped-query attention stays grouped: transformers' SDPA path repeats every key/value head
  for each query head (a copy of the whole cache per layer and step) whenever a mask is given,
  unless ``TRANSFORMERS_SDPA_FORCE_GQA`` is set, which :func:`grouped_attention` does for the
  duration of one forward (15-20% of a bf16 step on this CPU at 64 rows).

Each step's next-token distribution is the target's own for that row's tokens (up to the
rounding of a batched forward); greedy picks its argmax, sampling draws from
``softmax(logits / temperature)`` restricted to the ``top_p`` nucleus.
``tests/test_batched_generation.py`` holds greedy output equal to ``generate`` on each prompt
alone (fp32) and the sampled distribution equal to the unbatched forward's.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from headway.decode.kv import cache_argument


class SlotLayer(DynamicLayer):
    """A cache layer holding keys/values ``[batch, heads, capacity, head_dim]`` with spare room
    at the end; ``keys``/``values`` are views of the first ``length`` columns."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer = key_states.new_zeros((*key_states.shape[:2], 0, key_states.shape[3]))
        self.value_buffer = value_states.new_zeros(
            (*value_states.shape[:2], 0, value_states.shape[3])
        )
        self.length = 0

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self.reserve(end + 64)
        self.key_buffer[..., self.length : end, :] = key_states
        self.value_buffer[..., self.length : end, :] = value_states
        self.length = end
        return self._views()

    def reserve(self, capacity: int) -> None:
        """Grow the buffers to at least ``capacity`` columns (doubling, so growth is rare)."""
        capacity = max(capacity, 2 * self.key_buffer.shape[-2])
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def set_contents(self, keys: Tensor, values: Tensor, *, spare: int = 64) -> None:
        """Replace the contents with ``keys``/``values`` ``[batch, heads, length, head_dim]``
        (copied into new buffers with ``spare`` free columns)."""
        self.length = keys.shape[-2]
        for name, source in (("key_buffer", keys), ("value_buffer", values)):
            buffer = source.new_empty((*source.shape[:2], self.length + spare, source.shape[3]))
            buffer[..., : self.length, :] = source
            setattr(self, name, buffer)
        self.is_initialized = True
        self._views()

    def _views(self) -> tuple[Tensor, Tensor]:
        keys = self.key_buffer[..., : self.length, :]
        values = self.value_buffer[..., : self.length, :]
        self.keys, self.values = keys, values
        return keys, values


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextmanager
def grouped_attention() -> Iterator[None]:
    """Let SDPA take grouped key/value heads as they are (``enable_gqa``) inside the block."""
    before = os.environ.get(_FORCE_GQA)
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_FORCE_GQA]
        else:
            os.environ[_FORCE_GQA] = before


def slot_cache(num_layers: int) -> DynamicCache:
    """A ``DynamicCache`` whose layers are :class:`SlotLayer`."""
    cache = DynamicCache()
    cache.layers = [SlotLayer() for _ in range(num_layers)]
    cache.layer_class_to_replicate = None
    return cache


@dataclass(frozen=True)
class SamplingRule:
    """How a token is picked from a row's logits: ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0

    def pick(self, logits: Tensor, generator: torch.Generator | None) -> Tensor:
        """Next tokens ``[batch]`` from logits ``[batch, vocab]``."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        return torch.multinomial(self.probabilities(logits), 1, generator=generator)[:, 0]

    def probabilities(self, logits: Tensor) -> Tensor:
        """The distribution sampled from: ``softmax(logits / T)`` restricted to the smallest set
        of tokens whose probability reaches ``top_p`` (the nucleus), renormalised."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p >= 1.0:
            return probs
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the better tokens
        sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
        kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return kept / kept.sum(dim=-1, keepdim=True)


@dataclass
class Completion:
    """One finished request: the new tokens (EOS excluded) and why it stopped."""

    key: Hashable
    tokens: list[int]
    finish_reason: str  # "eos" or "length"


@dataclass
class _Row:
    key: Hashable
    position: int  # tokens of this row so far = position id of the next one
    tokens: list[int] = field(default_factory=list)


class ContinuousBatcher:
    """Generate answers for submitted prompts, ``slots`` rows at a time (see module doc).

    ``submit`` may be called while :meth:`completions` runs (e.g. the next turn of a
    conversation once this turn's answer is in): the prompt joins at the next refill.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        slots: int,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        rule: SamplingRule = SamplingRule(),
        generator: torch.Generator | None = None,
        refill_fraction: float = 0.5,
        prefill_tokens: int = 8192,
    ) -> None:
        if slots < 1 or max_new_tokens < 1 or not eos_token_ids:
            raise ValueError("slots and max_new_tokens must be >= 1, eos_token_ids non-empty")
        self.model, self.slots, self.max_new_tokens = model, slots, max_new_tokens
        self.eos = frozenset(eos_token_ids)
        self.pad_token_id, self.rule, self.generator = pad_token_id, rule, generator
        self.refill_at = max(0, int(slots * refill_fraction))
        self.prefill_tokens = prefill_tokens
        self.waiting: deque[tuple[Hashable, list[int]]] = deque()
        self.device = next(model.parameters()).device
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self.cache_columns = 0
        self.steps = 0

    def submit(self, key: Hashable, prompt_ids: Sequence[int]) -> None:
        """Queue one prompt (token ids, chat template applied) under ``key``."""
        if not prompt_ids:
            raise ValueError(f"prompt {key!r} is empty")
        self.waiting.append((key, list(prompt_ids)))

    @torch.inference_mode()
    def completions(self) -> Iterator[Completion]:
        """Run until no prompt is waiting or live, yielding each answer as it ends."""
        rows: list[_Row] = []
        cache, mask = slot_cache(self.num_layers), torch.zeros(0, 0, dtype=torch.long)
        next_tokens = torch.zeros(0, dtype=torch.long)
        while rows or self.waiting:
            if self.waiting and len(rows) <= self.refill_at:
                joined = self._prefill(self.slots - len(rows))
                new_cache, new_mask, new_rows, new_tokens = joined
                cache, mask = _merge(cache, mask, new_cache, new_mask)
                fresh = range(len(rows), len(rows) + len(new_rows))  # only they got a token
                rows, next_tokens = rows + new_rows, torch.cat([next_tokens, new_tokens])
            else:
                fresh = range(len(rows))
                mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
                positions = torch.tensor([[row.position] for row in rows])
                with grouped_attention():
                    logits = self.model(
                        input_ids=next_tokens[:, None].to(self.device),
                        attention_mask=mask.to(self.device),
                        position_ids=positions.to(self.device),
                        **cache_argument(self.model, cache),
                        use_cache=True,
                    ).logits[:, -1]
                for row in rows:
                    row.position += 1
                next_tokens = self.rule.pick(logits, self.generator).cpu()
                self.steps += 1
            done: set[int] = set()
            tokens = next_tokens.tolist()
            for index in fresh:
                row, token = rows[index], tokens[index]
                if token in self.eos:
                    done.add(index)
                    yield Completion(row.key, row.tokens, "eos")
                    continue
                row.tokens.append(token)
                if len(row.tokens) >= self.max_new_tokens:
                    done.add(index)
                    yield Completion(row.key, row.tokens, "length")
            if done:
                keep = torch.tensor(
                    [i for i in range(len(rows)) if i not in done], dtype=torch.long
                )
                rows = [rows[i] for i in keep.tolist()]
                next_tokens = next_tokens[keep] if len(keep) else next_tokens[:0]
                cache, mask = _select(cache, mask, keep)
            self.cache_columns = mask.shape[1]

    def _prefill(self, room: int) -> tuple[DynamicCache, Tensor, list[_Row], Tensor]:
        """Prefill up to ``room`` waiting prompts (and at most ``prefill_tokens`` padded
        tokens), left-padded; return their cache, mask, rows and first tokens."""
        batch: list[tuple[Hashable, list[int]]] = []
        while self.waiting and len(batch) < room:
            longest = max([len(self.waiting[0][1]), *(len(p) for _, p in batch)])
            if batch and longest * (len(batch) + 1) > self.prefill_tokens:
                break
            batch.append(self.waiting.popleft())
        width = max(len(prompt) for _, prompt in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for index, (_, prompt) in enumerate(batch):
            ids[index, width - len(prompt) :] = torch.tensor(prompt)
            mask[index, width - len(prompt) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = slot_cache(self.num_layers)
        with grouped_attention():
            logits = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                **cache_argument(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        rows = [_Row(key, position=len(prompt)) for key, prompt in batch]
        return cache, mask, rows, self.rule.pick(logits, self.generator).cpu()


def _layers(cache: DynamicCache) -> list[SlotLayer]:
    return [layer for layer in cache.layers if isinstance(layer, SlotLayer)]


def _select(cache: DynamicCache, mask: Tensor, keep: Tensor) -> tuple[DynamicCache, Tensor]:
    """Keep rows ``keep`` ``[k]`` and drop leading columns no kept row attends to."""
    mask = mask[keep]
    if not len(keep):
        return slot_cache(len(cache.layers)), mask[:, :0]
    first = int((mask.sum(dim=0) > 0).nonzero()[0]) if mask.numel() else 0
    mask = mask[:, first:]
    device_keep = keep.to(_layers(cache)[0].key_buffer.device)
    for layer in _layers(cache):
        layer.set_contents(
            layer.key_buffer[device_keep, :, first : layer.length],
            layer.value_buffer[device_keep, :, first : layer.length],
        )
    return cache, mask


def _merge(
    cache: DynamicCache, mask: Tensor, new_cache: DynamicCache, new_mask: Tensor
) -> tuple[DynamicCache, Tensor]:
    """Stack two batches into one, left-padding the shorter cache and mask with unused columns.

    Shapes: caches ``[b, heads, t, head_dim]`` and ``[n, heads, t', head_dim]`` per layer, masks
    ``[b, t]`` and ``[n, t']``; the result has ``b + n`` rows and ``max(t, t')`` columns.
    """
    if mask.shape[0] == 0:
        return new_cache, new_mask
    width = max(mask.shape[1], new_mask.shape[1])

    def pad(tensor: Tensor, dim: int) -> Tensor:
        missing = width - tensor.shape[dim]
        if not missing:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = missing
        return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

    for old, new in zip(_layers(cache), _layers(new_cache), strict=True):
        old_keys, old_values = old._views()
        new_keys, new_values = new._views()
        old.set_contents(
            torch.cat([pad(old_keys, 2), pad(new_keys, 2)]),
            torch.cat([pad(old_values, 2), pad(new_values, 2)]),
        )
    return cache, torch.cat([pad(mask, 1), pad(new_mask, 1)])
