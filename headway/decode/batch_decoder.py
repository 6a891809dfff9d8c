"""The batched decoder as a stream: prompts submitted while it runs, results as rows finish.

:class:`BatchDecoder` is the one engine behind :func:`~headway.decode.batch_decode.
decode_batch` (``headway.generate_batch``, ``headway generate --batch``) and regeneration
(``headway data regenerate``): :meth:`~BatchDecoder.submit` queues a prompt,
:meth:`~BatchDecoder.completions` decodes and yields each prompt's result as soon as its row
stops, and a prompt submitted meanwhile (a conversation's next turn, once its turn before is
in) takes a finished row's place at the next step (see :mod:`headway.decode.batch_decode` for
the steps, the drafting and when finished rows leave).

A prompt submitted ``after`` another (the turn before, whose row has just finished) starts from
the keys/values that row left: the tokens it shares with that row's prompt and answer are
copied (:meth:`~headway.decode.static_cache.StaticCache.row_prefix`) instead of prefilled again
(a fourth ShareGPT turn shares ~90% of its prompt with the turn before). Only where no
drafting reads the target's states (prompt lookup, none): those would need the states of the
copied part too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.decode.batch_drafting import BatchDrafter
from headway.decode.batch_sizer import BatchSizer, depth_of
from headway.decode.batch_step import BatchVerify
from headway.decode.captured import StaticForward, block_bucket
from headway.decode.gemm import gemm_route
from headway.decode.generate import GenerationResult
from headway.decode.grouped_attention import grouped_attention
from headway.decode.kv import context_limit
from headway.decode.sampling import GREEDY, SamplingParams
from headway.decode.session import StopReason
from headway.decode.static_cache import Prefix, prefix_length
from headway.errors import HeadwayError

__all__ = ["BatchDecoder", "shared_prefix"]


@dataclass
class _Row:
    """One prompt's generation: its tokens, the tokens each target forward committed for it
    (prefill first), and why it stopped (None while it goes on)."""

    tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    stop_reason: StopReason | None = None

    def result(self) -> GenerationResult:
        assert self.stop_reason is not None
        return GenerationResult(
            self.tokens, self.accept_lengths, len(self.accept_lengths), self.stop_reason
        )


@dataclass(frozen=True)
class Ending:
    """When a row stops: an EOS id, ``check(generated)`` true (stop strings), or
    ``max_new_tokens``."""

    eos: frozenset[int]
    max_new_tokens: int
    check: Callable[[list[int]], bool] | None = None


class BatchDecoder:
    """Decode submitted prompts ``rows`` at a time (module docstring), drafted by
    ``drafting`` (one drafter per row, or one for all rows); greedy, or by ``sampling`` with
    each prompt's seed. ``capture``: CUDA graphs (default: on CUDA). ``reuse``: a prompt
    submitted ``after`` a finished one starts from what that row's keys/values share with it.
    :attr:`prefilled` and :attr:`reused` count the prompt tokens run and those copied."""

    def __init__(
        self,
        model: PreTrainedModel,
        drafting: BatchDrafter,
        rows: int,
        ending: Ending,
        *,
        sampling: SamplingParams = GREEDY,
        capture: bool | None = None,
        reuse: bool = True,
    ) -> None:
        if rows < 1 or ending.max_new_tokens < 1:
            raise ValueError(f"need rows >= 1 and max_new_tokens >= 1, not {rows}, {ending}")
        self.model, self.drafting, self.rows, self.ending = model, drafting, rows, ending
        self.sampling, self.capture = sampling, capture
        self.reuse = reuse and not drafting.hidden_layers
        self.depth = block_bucket(drafting.max_nodes + 1) - 1  # the deepest node, padding too
        self.prompts: list[Tensor] = []
        self.seeds: list[int] = []
        self.after: list[int | None] = []
        self.everyone: list[_Row] = []
        self.ids: list[list[int]] = []
        self.queue: list[int] = []
        self.order: list[int] = []  # which prompt each row of the batch decodes
        self.prefilled = self.reused = 0
        self._done: list[int] = []  # prompts stopped since the last yield
        self._steps: BatchVerify | None = None

    def submit(self, prompt: Tensor, seed: int | None = None, after: int | None = None) -> int:
        """Queue ``prompt`` (LongTensor ``[P]``, at least one token; ``seed``: its sampling
        seed, needed where sampled; ``after``: the prompt whose row it may continue from);
        returns its index, which :meth:`completions` yields with its result.

        Raises:
            HeadwayError: the prompt and ``max_new_tokens`` past the target's context.
        """
        if prompt.numel() < 1:
            raise ValueError("a prompt needs at least one token")
        longest = prompt.numel() + self.ending.max_new_tokens + self.depth + 1
        if longest > context_limit(self.model):
            raise HeadwayError(
                f"a prompt of {prompt.numel()} tokens and max_new_tokens="
                f"{self.ending.max_new_tokens} need {longest} positions; the target holds "
                f"{context_limit(self.model)}: shorten them"
            )
        if seed is None and not self.sampling.greedy:
            raise ValueError("a sampled prompt needs its seed")
        self.prompts.append(prompt)
        self.seeds.append(0 if seed is None else seed)
        self.after.append(after)
        self.everyone.append(_Row())
        self.ids.append(prompt.tolist())
        self.queue.append(len(self.prompts) - 1)
        return len(self.prompts) - 1

    def completions(self) -> Iterator[tuple[int, GenerationResult]]:
        """Decode until every prompt submitted (before or while it runs) has stopped,
        yielding ``(index, result)`` as each does."""
        if not self.queue:
            return
        gemm_route(self.model)  # the model's GEMM route on a CPU ("auto" where none applied)
        with grouped_attention(self.model):  # each grouped key/value head read once a step
            batch = min(self.rows, len(self.queue))
            forward = StaticForward(self.model, capture=self.capture, batch=batch)
            self._steps = BatchVerify(forward, self.depth, self.drafting.hidden_layers)
            first, self.queue = self.queue[:batch], self.queue[batch:]
            self._start(first, [None] * batch, begin=True)
            yield from self._finished()
            drafts = self.drafting.drafts
            sizer = BatchSizer(self._steps, self._steps.max_depth + 1) if drafts else None
            while True:
                size = len(self.order)
                if not self._reshaped():
                    break
                yield from self._finished()
                if sizer is not None and len(self.order) != size:
                    sizer.resize(size, len(self.order))
                self._step(sizer)
                yield from self._finished()

    def _finished(self) -> Iterator[tuple[int, GenerationResult]]:
        done, self._done = self._done, []
        for index in done:
            yield index, self.everyone[index].result()

    def _start(self, prompts: list[int], prefixes: list[Prefix | None], begin: bool) -> None:
        """Prefill ``prompts`` (indices; each from its prefix where given) as rows after the
        batch's (``begin``: the batch itself), shortest first (rows of like lengths share a
        prefill forward), and commit their first tokens; their drafting learns their prompts."""
        steps = self._steps
        assert steps is not None
        device = steps.target.model.device
        known = [prefix_length(prefix) for prefix in prefixes]
        order = sorted(
            range(len(prompts)), key=lambda i: self.prompts[prompts[i]].numel() - known[i]
        )
        prompts = [prompts[i] for i in order]
        prefixes = [prefixes[i] for i in order]
        self.reused += sum(known)
        self.prefilled += sum(self.prompts[index].numel() for index in prompts) - sum(known)
        on_device = [self.prompts[index].to(device) for index in prompts]
        seeds = None
        if not self.sampling.greedy:
            seeds = torch.tensor([self.seeds[index] for index in prompts], dtype=torch.long)
        given = prefixes if any(f is not None for f in prefixes) else None
        if begin:
            self.drafting.begin([self.prompts[index] for index in prompts])
            firsts = steps.prefill(on_device, self.sampling, seeds, given).tolist()
        else:
            self.drafting.add_rows([self.prompts[index] for index in prompts])
            firsts = steps.add_rows(on_device, self.sampling, seeds, given).tolist()
        kept: list[list[int]] = [[] for _ in self.order]
        for index, first in zip(prompts, firsts, strict=True):
            row, sequence = self.everyone[index], self.ids[index]
            self._commit(index, [int(first)])
            # each prompt entry's state predicted the token after it, as in the loop
            kept.append(sequence[1:] if row.stop_reason is None else [])
        self.order += prompts
        self._couple()
        self.drafting.observe(kept, steps.hidden)

    def _couple(self) -> None:
        """Sampled, the drafting (where it takes it) drafts each row with the row's noise
        (its prompt's seed: :mod:`headway.drafters.coupled`); greedy, by its top-k."""
        couple = getattr(self.drafting, "couple", None)
        if couple is not None:
            seeds = None
            if not self.sampling.greedy:
                seeds = torch.tensor([self.seeds[index] for index in self.order])
            couple(seeds, self.sampling.temperature)

    def _reshaped(self) -> bool:
        """Drop finished rows (once a quarter of the batch has finished, or at once where
        prompts wait; half where its steps are captured) and put waiting prompts in their
        places; False once every prompt is done."""
        steps = self._steps
        assert steps is not None
        rows = [self.everyone[index] for index in self.order]
        going = [place for place, row in enumerate(rows) if row.stop_reason is None]
        done = len(rows) - len(going)
        if not going and not self.queue:
            return False
        # where steps are captured finished rows leave (and waiting prompts join) once half
        # has finished: idle rows cost a GPU's step little, and a batch of another size
        # captures its graphs again; on a CPU, where a step's time grows with its rows, once a
        # quarter has, or at once where prompts wait
        captured = steps.target.capture
        share = 2 if captured else 4
        if done == 0 or (done < -(-len(rows) // share) and (captured or not self.queue)):
            return True
        added, prefixes = self._joining(done, going)
        steps.keep_rows(going)  # none at all, for a moment, where every row finished
        self.drafting.keep_rows(going)
        self.order = [self.order[place] for place in going]
        if added:
            self._start(added, prefixes, begin=False)
        else:
            self._couple()
        return True

    def _joining(self, done: int, going: list[int]) -> tuple[list[int], list[Prefix | None]]:
        """The ``done`` waiting prompts to take finished rows' places, those continuing a row
        about to leave first, and the keys/values each continues from (copied before the
        rows leave)."""
        steps = self._steps
        assert steps is not None
        staying = set(going)
        leaving = {
            self.order[place]: place for place in range(len(self.order)) if place not in staying
        }
        continuing = {i for i in self.queue if self.reuse and self.after[i] in leaving}
        added = sorted(self.queue, key=lambda i: i not in continuing)[:done]  # stable sort
        joining = set(added)
        self.queue = [i for i in self.queue if i not in joining]
        prefixes: list[Prefix | None] = []
        for index in added:
            before, prefix = self.after[index], None
            if index in continuing and before is not None:
                # the row's columns hold every token but its last (the root not yet fed)
                common = shared_prefix(self.ids[before][:-1], self.ids[index])
                if common:
                    prefix = steps.target.cache.row_prefix(leaving[before], common)
            prefixes.append(prefix)
        return added, prefixes

    def _step(self, sizer: BatchSizer | None) -> None:
        """One step of every row: draft, verify, commit."""
        steps, drafting = self._steps, self.drafting
        assert steps is not None
        rows = [self.everyone[index] for index in self.order]
        ids = [self.ids[index] for index in self.order]
        live = [row.stop_reason is None for row in rows]
        drafts = drafting.drafts and (sizer is None or sizer.drafts())
        start = time.perf_counter()
        trees = drafting.propose(ids, live) if drafts else [([], [])] * len(rows)
        nodes = 0
        if drafts:
            sent = [parents for (_, parents), on in zip(trees, live, strict=True) if on]
            whole = max((len(tree) for tree in sent), default=0)
            nodes = whole if sizer is None else sizer.nodes(sent, time.perf_counter() - start)
        trees = [(tokens[:nodes], parents[:nodes]) for tokens, parents in trees]
        padded = [padded_tree(tokens, parents, nodes) for tokens, parents in trees]
        tokens = torch.tensor([t for t, _ in padded], dtype=torch.long)
        parents = torch.tensor([p for _, p in padded], dtype=torch.long)
        roots = torch.tensor([sequence[-1] for sequence in ids])
        begun = time.perf_counter()
        committed = steps.step(roots, tokens, parents, torch.tensor(live), self.sampling)
        if sizer is not None:
            sizer.timed(block_bucket(nodes + 1), time.perf_counter() - begun)
        kept: list[list[int]] = []
        for index, new, (_, tree), on in zip(self.order, committed, trees, live, strict=True):
            if not on:
                kept.append([])
                continue
            if sizer is not None and tree:
                sizer.learn(depth_of(tree), len(new) - 1)
            tokens_kept = self._commit(index, new)
            kept.append(tokens_kept if self.everyone[index].stop_reason is None else [])
        if drafting.drafts:
            drafting.observe(kept, steps.hidden)

    def _commit(self, index: int, new: list[int]) -> list[int]:
        """Append ``new`` to prompt ``index``'s row, stopping right after an EOS, the token the
        stop check stops at, or the ``max_new_tokens``-th token; returns what was kept."""
        row, ending, kept = self.everyone[index], self.ending, []
        for token in new:
            kept.append(token)
            row.tokens.append(token)
            if token in ending.eos:
                row.stop_reason = "eos"
            elif ending.check is not None and ending.check(row.tokens):
                row.stop_reason = "stop_sequence"
            elif len(row.tokens) >= ending.max_new_tokens:
                row.stop_reason = "max_new_tokens"
            if row.stop_reason is not None:
                self._done.append(index)
                break
        self.ids[index] += kept
        row.accept_lengths.append(len(kept))
        return kept


def shared_prefix(before: Sequence[int], now: Sequence[int]) -> int:
    """Tokens ``now`` shares with ``before`` from the start, leaving ``now`` one to run (a
    continued prompt prefills at least its last token)."""
    common = 0
    for a, b in zip(before, now[:-1], strict=False):
        if a != b:
            break
        common += 1
    return common


def padded_tree(tokens: list[int], parents: list[int], size: int) -> tuple[list[int], list[int]]:
    """The tree grown to ``size`` nodes by a chain of padding nodes under the root, the first
    holding a token none of the root's children holds: siblings stay distinct, which lossless
    sampling over a tree needs (a padding node is then a candidate like any other)."""
    missing = size - len(tokens)
    if missing <= 0:
        return tokens, parents
    taken = {token for token, parent in zip(tokens, parents, strict=True) if parent < 0}
    fill = next(token for token in range(len(taken) + 1) if token not in taken)
    chain = [-1, *range(len(tokens), len(tokens) + missing - 1)]
    return tokens + [fill] * missing, parents + chain
