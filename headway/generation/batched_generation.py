"""Batched generation that keeps every row busy: finished rows leave, waiting prompts join, and
each row may verify a few drafted tokens per forward.

``model.generate`` on a padded batch computes every row until the longest answer ends, so with
a 512-token cap and answers of 50 to 512 tokens much of the work is spent on rows that are done;
and its cache grows by concatenation, copying the whole cache at every step. Here (one stock HF
model, no forked modeling code):

- every row keeps its keys/values in its own slot of a :class:`RaggedCache`, at the columns of
  its positions; a step writes each row's new tokens after its own and attends through a 4-D
  mask, so rows of any length share one forward and nothing is shifted or re-padded;
- a row that ends (EOS or the token cap) leaves at once (the last live row takes its slot), and
  once at most ``refill_fraction`` of the slots are busy, waiting prompts are prefilled
  (left-padded among themselves, logits of the last position only) and placed in free slots;
- with ``lookahead = k > 0`` each row drafts up to ``k`` tokens by prompt lookup in its own
  prompt and answer, and one forward of ``1 + k`` tokens per row verifies every chain
  (:mod:`headway.generation.lookahead`): a CPU step is bound by reading the KV cache, which a longer
  step reads once for all its tokens;
- grouped key/value heads are read once per step (:mod:`headway.decode.grouped_attention`);
- the LM head gets a contiguous input (:func:`~headway.decode.gemm.contiguous_head`): a prefill
  keeps the last position only, a strided ``[rows, 1, hidden]`` view;
- a conversation's next turn continues from its previous answer's keys/values: a prompt
  submitted under a key while that key's completion is being handled (as turn-by-turn
  regeneration does) prefills only what follows the longest prefix it shares with the finished
  row's tokens (the history, re-rendered by the chat template, mostly re-tokenizes to the same
  ids). Counted over 1,416 turns of ``data/regenerated/smollm2-sharegpt-turns`` (up to three
  deep; ``scripts/history_share.py``), 17% of the prompt tokens are left to prefill. Time saved
  depends on the prefill's share of the work: ``scripts/bench_regenerate.py --max-turns 3
  --recompute-history`` (fp32, a 2-core AVX2 EPYC, answers identical) ran 1.36x faster with a
  128-token cap at batch 16 and 1.10x with a 512-token cap at batch 8, where longer answers
  and lookahead's draft rows dominate (:attr:`ContinuousBatcher.prefilled`,
  :attr:`~ContinuousBatcher.reused` count the two kinds of prompt tokens).

Each kept token is the target's own for that row's tokens (up to the rounding of a batched
forward): greedy keeps the argmax, sampling draws from ``softmax(logits / temperature)``
restricted to the ``top_p`` nucleus with the noise of the row's seed and the token's position
(:mod:`headway.decode.keyed_noise`; a draft is kept where it is the token drawn), so a sampled
answer depends on its prompt and seed only: not on lookahead, the slots or the rows beside it.
``tests/test_batched_generation.py`` holds greedy output equal to ``generate`` on each prompt
alone (fp32) with and without lookahead, and the sampled distribution equal to the target's;
``tests/test_lookahead.py`` one seed's answer the same with and without lookahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from headway.decode.batch_decoder import shared_prefix
from headway.decode.gemm import (
    Route,
    contiguous_head,
    forget_packed,
    gemm_route,
    routed_linears,
)
from headway.decode.grouped_attention import grouped_attention
from headway.decode.keyed_noise import position_keys
from headway.decode.kv import cache_argument, recurrent_layer
from headway.decode.sampling import SamplingParams, pick_tokens
from headway.drafters.lookup import NgramIndex
from headway.errors import HeadwayError
from headway.generation.lookahead import accept_chains
from headway.generation.ragged_cache import RaggedCache, step_mask
from headway.generation.repetition import ends_in_loop

__all__ = [
    "Completion",
    "ContinuousBatcher",
    "grouped_attention",
]


@dataclass
class Completion:
    """One finished request: the new tokens (EOS excluded) and why it stopped."""

    key: Hashable
    tokens: list[int]
    finish_reason: str  # "eos", "length" or "loop"


class _Row:
    """A live request: its answer so far, the token to feed next, its n-gram index and its
    sampling seed."""

    def __init__(self, key: Hashable, prompt: list[int], max_n: int, seed: int) -> None:
        self.key, self.prompt, self.seed = key, prompt, seed
        self.tokens: list[int] = []
        self.last = -1
        self.index = NgramIndex(min_ngram=1, max_ngram=max_n) if max_n else None
        if self.index is not None:
            self.index.extend(prompt)

    def draft(self, count: int) -> list[int]:
        return self.index.follow(count) if self.index is not None else []


@contextmanager
def _releasing_packed(model: PreTrainedModel, route: Route) -> Iterator[None]:
    """On exit, drop ``model``'s reordered weights if ``route`` is the packed one."""
    try:
        yield
    finally:
        if route == "packed":
            forget_packed(model)


class ContinuousBatcher:
    """Generate answers for submitted prompts, ``slots`` rows at a time (see module doc).

    ``submit`` may be called while :meth:`completions` runs (e.g. the next turn of a
    conversation once this turn's answer is in): the prompt joins at the next refill.
    ``lookahead`` is the most tokens a row drafts per step (0: plain decoding), ``ngram`` the
    longest suffix prompt lookup matches. ``stop_loops`` > 0 ends a row (``"loop"``) at the
    first token past that many periods of a repetition loop, that token left out
    (:func:`~headway.generation.repetition.ends_in_loop`). ``reuse_history`` continues a next
    turn from the finished row's cache (module doc); False prefills every prompt whole.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        slots: int,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        rule: SamplingParams | None = None,
        refill_fraction: float = 0.5,
        prefill_tokens: int = 8192,
        lookahead: int = 0,
        ngram: int = 4,
        stop_loops: int = 0,
        reuse_history: bool = True,
    ) -> None:
        if slots < 1 or max_new_tokens < 1 or not eos_token_ids:
            raise ValueError("slots and max_new_tokens must be >= 1, eos_token_ids non-empty")
        if lookahead < 0 or ngram < 1:
            raise ValueError("lookahead must be >= 0 and ngram >= 1")
        recurrent = recurrent_layer(model)
        if recurrent is not None:  # ragged rows place each row's keys/values in one cache
            raise HeadwayError(
                f"{recurrent}, not keys/values alone, which the continuous engine places row "
                "by row: regenerate with --engine generate (HF generate on padded batches) "
                "or --server"
            )
        self.model, self.slots, self.max_new_tokens = model, slots, max_new_tokens
        self.eos = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.rule = rule or SamplingParams()  # greedy
        self.refill_at = max(0, int(slots * refill_fraction))
        self.prefill_tokens = prefill_tokens
        self.lookahead, self.ngram, self.stop_loops = lookahead, ngram, stop_loops
        self.reuse_history = reuse_history
        self.waiting: deque[tuple[Hashable, list[int], int]] = deque()  # key, ids, seed
        # next turns that continue a finished row: key, prompt ids, seed, the prefix's cache
        self.resuming: deque[tuple[Hashable, list[int], int, DynamicCache]] = deque()
        self.device = next(model.parameters()).device
        self.gemm = gemm_route(model)  # the route applied to the model (auto where none was)
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self.steps = 0  # forwards after the prefills
        self.row_steps = 0  # rows those forwards advanced, summed
        self.generated = 0  # tokens they added
        self.prefilled = 0  # prompt tokens run through a prefill
        self.reused = 0  # prompt tokens taken from a finished row's cache instead

    def submit(self, key: Hashable, prompt_ids: Sequence[int], seed: int = 0) -> None:
        """Queue one prompt (token ids, chat template applied) under ``key``; sampled, its
        tokens are drawn with the noise of ``seed`` (module docstring)."""
        if not prompt_ids:
            raise ValueError(f"prompt {key!r} is empty")
        self.waiting.append((key, list(prompt_ids), seed))

    @property
    def tokens_per_row_step(self) -> float:
        """Tokens a row gained per forward on average (1.0 without lookahead)."""
        return self.generated / self.row_steps if self.row_steps else 0.0

    @torch.inference_mode()
    def completions(self) -> Iterator[Completion]:
        """Run until no prompt is waiting or live, yielding each answer as it ends.

        Until the generator ends or is closed (between yields too), the model runs with
        :func:`grouped_attention`, :func:`contiguous_head` and its linear layers on the route
        applied to the model (:func:`~headway.decode.gemm.routed_linears`); do not use it
        elsewhere meanwhile. Reordered weights of the packed route are dropped at the end, so a
        regeneration does not leave a second copy of the weights to the training after it.
        """
        rows: list[_Row] = []
        cache = RaggedCache(self.num_layers, self.slots)
        with (
            grouped_attention(self.model),
            contiguous_head(self.model),
            routed_linears(self.model, self.gemm),
            _releasing_packed(self.model, self.gemm),
        ):
            while rows or self.waiting or self.resuming:
                refill = bool(self.waiting) and len(rows) <= min(self.refill_at, self.slots - 1)
                if self.resuming or refill:  # continued turns at once: each freed its slot
                    new_rows, first = (
                        self._resume_all(cache)
                        if self.resuming
                        else self._prefill(cache, self.slots - len(rows))
                    )
                    rows.extend(new_rows)
                    added = {len(rows) - len(new_rows) + i: [t] for i, t in enumerate(first)}
                    stepped = False
                else:
                    added = dict(enumerate(self._step(cache, rows)))
                    stepped = True
                done: list[int] = []
                for index, tokens in added.items():
                    before = len(rows[index].tokens)
                    completion = self._extend(rows[index], tokens)
                    if stepped:  # what the row kept: not drafts past its EOS, cap or loop
                        ended = completion is not None and completion.finish_reason == "eos"
                        self.generated += len(rows[index].tokens) - before + ended
                    if completion is not None:
                        done.append(index)
                        yield completion
                        self._continue(cache, index, rows[index])
                for index in sorted(done, reverse=True):
                    last = len(rows) - 1
                    if index != last:
                        cache.move(last, index)
                        rows[index] = rows[last]
                    rows.pop()
                    cache.drop_last()

    def _extend(self, row: _Row, tokens: list[int]) -> Completion | None:
        """Add a step's tokens to ``row``; its completion if one of them ends it."""
        for token in tokens:
            if token in self.eos:
                return Completion(row.key, row.tokens, "eos")
            row.tokens.append(token)
            if self.stop_loops and ends_in_loop(row.tokens, repeats=self.stop_loops):
                row.tokens.pop()
                return Completion(row.key, row.tokens, "loop")
            if len(row.tokens) >= self.max_new_tokens:
                return Completion(row.key, row.tokens, "length")
        if row.index is not None:
            row.index.extend(tokens)
        row.last = tokens[-1]
        return None

    def _step(self, cache: RaggedCache, rows: list[_Row]) -> list[list[int]]:
        """One forward of every live row (its next token and its drafts); the tokens each
        keeps."""
        room = self.max_new_tokens - 1  # drafts past the cap would be cut anyway
        drafts = [row.draft(min(self.lookahead, room - len(row.tokens))) for row in rows]
        step = 1 + max(len(draft) for draft in drafts)
        ids = torch.full((len(rows), step), self.pad_token_id, dtype=torch.long)
        for index, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
            ids[index, : 1 + len(draft)] = torch.tensor([row.last, *draft])
        columns = cache.begin_step(step, self.device)
        logits = self.model(
            input_ids=ids.to(self.device),
            attention_mask=step_mask(self.model, columns, cache.width, self.model.dtype),
            position_ids=columns,
            **cache_argument(self.model, cache),
            use_cache=True,
        ).logits
        keys = None
        if not self.rule.greedy:  # entry j predicts the token at the row's length + j
            seeds = torch.tensor([row.seed for row in rows])
            lengths = torch.tensor([len(row.prompt) + len(row.tokens) for row in rows])
            keys = position_keys(seeds, lengths[:, None] + torch.arange(step))
        accepted = accept_chains(logits, drafts, self.rule, keys)
        cache.advance([1 + kept for kept in accepted.kept])
        self.steps += 1
        self.row_steps += len(rows)
        return accepted.tokens

    def _continue(self, cache: RaggedCache, index: int, row: _Row) -> None:
        """If the prompt submitted last is ``row``'s key's (its next turn, submitted while its
        completion was handled), queue it to continue from the prefix it shares with what
        ``row`` holds in ``cache`` (live row ``index``); a prompt sharing nothing waits as any."""
        if not self.reuse_history or not self.waiting or self.waiting[-1][0] != row.key:
            return
        key, ids, seed = self.waiting[-1]
        held = (row.prompt + row.tokens)[: cache.lengths[index]]  # what the row's columns hold
        common = shared_prefix(held, ids)
        if common:
            self.waiting.pop()
            self.resuming.append((key, ids, seed, cache.row_cache(index, common)))

    def _resume_all(self, cache: RaggedCache) -> tuple[list[_Row], list[int]]:
        """Every continued turn as a row again (each in the slot its turn before freed, so a
        copied prefix lives one step at most); their rows and first tokens."""
        rows: list[_Row] = []
        first: list[int] = []
        while self.resuming:
            key, ids, seed, past = self.resuming.popleft()
            rows.append(self._row(key, ids, seed))
            first.append(self._resume(cache, ids, seed, past))
        return rows, first

    def _row(self, key: Hashable, prompt: list[int], seed: int) -> _Row:
        return _Row(key, prompt, self.ngram if self.lookahead else 0, seed)

    def _first_tokens(self, logits: Tensor, seeds: list[int], lengths: list[int]) -> Tensor:
        """Each prefilled row's first token from its last logits ``[rows, V]``: the argmax,
        or the draw with the noise of its seed at its prompt's length."""
        keys = None
        if not self.rule.greedy:
            keys = position_keys(torch.tensor(seeds), torch.tensor(lengths))
        return pick_tokens(logits, self.rule, keys)

    def _resume(self, cache: RaggedCache, ids: list[int], seed: int, past: DynamicCache) -> int:
        """Prefill what follows ``past``'s tokens of ``ids`` over ``past`` (batch 1), place the
        row in ``cache``; its first token."""
        start = past.get_seq_length()
        positions = torch.arange(start, len(ids), device=self.device)[None]
        logits = self.model(
            input_ids=torch.tensor(ids[start:], device=self.device)[None],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
            position_ids=positions,
            **cache_argument(self.model, past),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        self.prefilled += len(ids) - start
        self.reused += start
        self._place(cache, past, [len(ids)])
        return int(self._first_tokens(logits, [seed], [len(ids)])[0])

    def _place(self, cache: RaggedCache, prefilled: DynamicCache, lengths: list[int]) -> None:
        """Put prefilled rows of ``lengths`` tokens into ``cache``, sized first for their
        longest answer and drafts, so that decoding them never grows it."""
        cache.reserve(max(lengths) + self.max_new_tokens + self.lookahead + 1)
        cache.place(prefilled, lengths)

    def _prefill(self, cache: RaggedCache, room: int) -> tuple[list[_Row], list[int]]:
        """Prefill up to ``room`` waiting prompts (and at most ``prefill_tokens`` padded
        tokens), left-padded, into free slots of ``cache``; their rows and first tokens."""
        batch: list[tuple[Hashable, list[int], int]] = []
        while self.waiting and len(batch) < room:
            longest = max([len(self.waiting[0][1]), *(len(p) for _, p, _ in batch)])
            if batch and longest * (len(batch) + 1) > self.prefill_tokens:
                break
            batch.append(self.waiting.popleft())
        width = max(len(prompt) for _, prompt, _ in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for index, (_, prompt, _) in enumerate(batch):
            ids[index, width - len(prompt) :] = torch.tensor(prompt)
            mask[index, width - len(prompt) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        prefilled = DynamicCache()
        logits = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            **cache_argument(self.model, prefilled),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        lengths = [len(prompt) for _, prompt, _ in batch]
        self.prefilled += sum(lengths)
        self._place(cache, prefilled, lengths)
        rows = [self._row(key, prompt, seed) for key, prompt, seed in batch]
        first = self._first_tokens(logits, [seed for _, _, seed in batch], lengths)
        return rows, first.tolist()
