"""Greedy speculative decoding of several prompts at once (``headway.generate_batch``,
``headway generate --batch``).

The rows' drafting is one :class:`~headway.decode.batch_drafting.BatchDrafter`: one drafter per
row (:class:`~headway.decode.batch_drafting.RowDrafters`, of the
:class:`~headway.decode.session.Drafter` protocol: prompt lookup and retrieval from the row's own
tokens, Medusa drafters also from the target's states the batched steps leave for that row,
:attr:`BatchVerify.hidden`), or an EAGLE draft model drafting every row's tree at once
(:class:`~headway.drafters.batch_eagle.BatchEagle`), and
each step verifies every row's tree in one forward over one static cache
(:class:`~headway.decode.batch_step.BatchVerify`: one host read a step for all rows). Trees
differ in size between rows; a step pads each row's tree to the step's size with a chain of
padding nodes under the root, the first holding a token none of the root's children holds (a
padding node is a candidate like any other: accepted only where it is what greedy decoding or
speculative sampling would commit, so the output is unchanged), the size rounded so the block
is a power of two: a handful of shapes (and, on CUDA, of captured graphs) covers every step. A
row that has finished (EOS, a stop string or ``max_new_tokens``) steps on with an empty tree,
committing nothing, until every row has.

How far to draft is weighed a step at a time (:class:`BatchSizer`): every row's tree is cut to
one block size ``S`` (1, 2, 4, ... entries a row), the size whose expected committed tokens
over the measured time of a step of that size is highest. The sizes are timed on the rows
themselves once per machine, model, batch size and cache size (kept, as the GEMM route and the
verify cost table are: :mod:`headway.timings`); the expected tokens count each row's tree depth
at that size times the share of drafted depth accepted so far. On a CPU, where a step's time
grows with ``B x S``, one row's long draft no longer makes every row verify its padding
(MT-bench x8, SmolLM2 fp32, 2-core EPYC, prompt lookup: a batch whose rows all verified the
longest row's tree ran 1.48x HF greedy one prompt at a time, sized so 2.85x, both on the stock
GEMM route; 4.64x on the packed one with grouped heads read once, docs/usage.md);
on a GPU, where a small model's step costs about the same at any size, the whole trees go.

Greedy, each row's tokens are the target's greedy output for that prompt alone (fp32);
sampled, each row's tokens follow the target's distribution for its prompt
(``tests/test_batch_decode.py``; with Medusa and EAGLE drafters every row accepts what it
accepts decoded alone, ``tests/test_batch_eagle.py``). On a CPU a batch's step is bound by
arithmetic, not by reading the weights, so drafting seldom pays there (docs/usage.md, "Several
prompts at once"): prompt lookup, whose drafting costs nothing, is the batch's default.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.decode.batch_drafting import BatchDrafter, RowDrafters
from headway.decode.batch_step import BatchVerify
from headway.decode.captured import StaticForward, block_bucket
from headway.decode.gemm import gemm_route
from headway.decode.generate import GenerationResult
from headway.decode.grouped_attention import grouped_attention
from headway.decode.kv import context_limit
from headway.decode.sampling import GREEDY, SamplingParams
from headway.decode.session import Drafter, StopReason
from headway.errors import HeadwayError
from headway.timings import remembered, seconds_table, shapes_digest

__all__ = ["BatchSizer", "decode_batch"]


@dataclass
class _Row:
    """One prompt's generation while the batch runs: its tokens, the tokens each target
    forward committed for it (prefill first), and why it stopped (None while it goes on)."""

    tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    stop_reason: StopReason | None = None


def decode_batch(
    model: PreTrainedModel,
    prompts: Sequence[Tensor],
    drafters: Sequence[Drafter | None] | BatchDrafter,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    stop_check: Callable[[list[int]], bool] | None = None,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
    capture: bool | None = None,
) -> list[GenerationResult]:
    """Decode ``prompts`` (LongTensors ``[P_b]``) together, drafted by ``drafters``: one per
    row (``drafters[b]``, None: no drafter) or a :class:`~headway.decode.batch_drafting.
    BatchDrafter` drafting every row's tree at once; greedy or by ``sampling`` with
    ``generator``; see the module docstring. ``stop_check(generated)`` true ends a row after
    that token (stop strings). ``capture``: CUDA graphs (default: on CUDA). Returns one
    :class:`~headway.decode.generate.GenerationResult` per prompt, as a prompt decoded alone.

    Raises:
        HeadwayError: drafters reading the target's states at different layers, or prompts
            and ``max_new_tokens`` past the target's context.
    """
    if not prompts:
        raise ValueError("need at least one prompt")
    drafting = RowDrafters(drafters) if isinstance(drafters, Sequence) else drafters
    depth = block_bucket(drafting.max_nodes + 1) - 1  # the deepest node, padding included
    _check(model, prompts, depth, max_new_tokens)
    gemm_route(model)  # the model's GEMM route on a CPU ("auto" where none was applied)
    with grouped_attention(model):  # each grouped key/value head read once a step
        forward = StaticForward(model, capture=capture, batch=len(prompts))
        steps = BatchVerify(forward, depth, drafting.hidden_layers)
        ending = _Ending(frozenset(eos_token_ids), max_new_tokens, stop_check)
        return _decode(steps, prompts, drafting, ending, sampling, generator)


def _decode(
    steps: BatchVerify,
    prompts: Sequence[Tensor],
    drafting: BatchDrafter,
    ending: _Ending,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> list[GenerationResult]:
    model = steps.target.model
    rows = everyone = [_Row() for _ in prompts]
    ids = [prompt.tolist() for prompt in prompts]
    drafting.begin(prompts)
    on_device = [prompt.to(model.device) for prompt in prompts]
    firsts = steps.prefill(on_device, sampling, generator).tolist()
    for row, sequence, first in zip(rows, ids, firsts, strict=True):
        _commit(row, sequence, [int(first)], ending)
    # the prompt's pairs and the first token, as the loop's: each prompt entry's state
    # predicted the token after it
    drafting.observe(
        [
            sequence[1:] if row.stop_reason is None else []
            for row, sequence in zip(rows, ids, strict=True)
        ],
        steps.hidden,
    )
    sizer = BatchSizer(steps, steps.max_depth + 1) if drafting.drafts else None
    while any(row.stop_reason is None for row in rows):
        live = [row.stop_reason is None for row in rows]
        drafts = sizer is not None and sizer.drafts()
        start = time.perf_counter()
        trees = drafting.propose(ids, live) if drafts else [([], [])] * len(rows)
        nodes = 0
        if sizer is not None and drafts:
            sent = [parents for (_, parents), on in zip(trees, live, strict=True) if on]
            nodes = sizer.nodes(sent, time.perf_counter() - start)
        trees = [(tokens[:nodes], parents[:nodes]) for tokens, parents in trees]
        padded = [_padded(tokens, parents, nodes) for tokens, parents in trees]
        tokens = torch.tensor([t for t, _ in padded], dtype=torch.long)
        parents = torch.tensor([p for _, p in padded], dtype=torch.long)
        roots = torch.tensor([sequence[-1] for sequence in ids])
        begun = time.perf_counter()
        committed = steps.step(roots, tokens, parents, torch.tensor(live), sampling, generator)
        if sizer is not None:
            sizer.timed(block_bucket(nodes + 1), time.perf_counter() - begun)
        kept: list[list[int]] = []
        for row, sequence, new, (_, tree), on in zip(
            rows, ids, committed, trees, live, strict=True
        ):
            if not on:
                kept.append([])
                continue
            if sizer is not None and tree:
                sizer.learn(_depth_of(tree), len(new) - 1)
            tokens_kept = _commit(row, sequence, new, ending)
            kept.append(tokens_kept if row.stop_reason is None else [])
        if drafting.drafts:
            drafting.observe(kept, steps.hidden)
        going = [index for index, row in enumerate(rows) if row.stop_reason is None]
        if going and len(rows) - len(going) >= -(-len(rows) // 4):  # a quarter has finished
            steps.keep_rows(going)  # finished rows leave: a step's work is the live rows'
            drafting.keep_rows(going)
            if sizer is not None:
                sizer.resize(len(rows), len(going))
            rows, ids = [rows[index] for index in going], [ids[index] for index in going]
    results = []
    for row in everyone:
        assert row.stop_reason is not None  # the loop ends once every row has stopped
        forwards = len(row.accept_lengths)
        results.append(GenerationResult(row.tokens, row.accept_lengths, forwards, row.stop_reason))
    return results


PLAIN_EVERY = 32
"""Drafted steps in a row after which :class:`BatchSizer` times one step without drafts."""

WEIGHT = 0.3
"""The weight of a step just timed in :class:`BatchSizer`'s running mean of its size."""


class BatchSizer:
    """The block size of a batch's steps (module docstring): ``seconds[i]``, what a step of
    ``2^i`` entries a row takes on ``steps``' rows, timed once per machine, model shapes, GEMM
    route, batch size and cache capacity (kept by :mod:`headway.timings`; each size one run that
    builds its buffers, or graph, then one timed, both committing nothing), and the share of
    drafted depth accepted so far."""

    def __init__(self, steps: BatchVerify, largest: int) -> None:
        self.steps = steps
        model = steps.target.model
        count = largest.bit_length()  # sizes 1, 2, 4, ..., largest
        key = {"model": shapes_digest(model), "route": gemm_route(model), "sizes": count}
        key |= {"batch": steps.batch, "capacity": steps.target.cache.capacity, "step": "routed"}
        kept = remembered(
            "the batched step cost table",
            key,
            lambda: [self._time(1 << index) for index in range(count)],
            device=model.device,
            valid=seconds_table(count),
        )
        self.seconds: list[float] = list(kept)  # follows the steps taken (timed)
        self.accepted, self.drafted = 1.0, 2.0  # a prior: half of what is drafted
        self.pause = 0  # steps left without drafting (drafting did not pay when last weighed)
        self.skipped = 0  # the pause drafting takes next time it does not pay (doubles)
        self.drafted_steps = 0  # steps drafted since the last plain one

    def drafts(self) -> bool:
        """Whether this step's rows draft: not while a pause runs (drafting was weighed and
        did not pay), so the drafters' cost is not paid either; afterwards they draft again
        and the step is weighed anew. After :data:`PLAIN_EVERY` drafted steps in a row, one
        step goes without drafts, so that the plain step's figure, which every decision is
        weighed against, follows the machine too (:meth:`timed`)."""
        if self.pause > 0:
            self.pause -= 1
            self.drafted_steps = 0
            return False
        if self.drafted_steps >= PLAIN_EVERY:
            self.drafted_steps = 0
            return False
        self.drafted_steps += 1
        return True

    def _time(self, size: int) -> float:
        batch, nodes = self.steps.batch, size - 1
        roots = torch.zeros(batch, dtype=torch.long)
        tokens = torch.zeros(batch, nodes, dtype=torch.long)
        parents = torch.full((batch, nodes), -1, dtype=torch.long)
        idle = torch.zeros(batch, dtype=torch.bool)
        self.steps.step(roots, tokens, parents, idle)
        start = time.perf_counter()
        self.steps.step(roots, tokens, parents, idle)
        return time.perf_counter() - start

    def nodes(self, parents: Sequence[list[int]], drafting: float = 0.0) -> int:
        """The tree size (``S - 1`` nodes a row) whose expected tokens a second are highest
        for these rows' trees (``parents`` each, cut to a size by keeping their first nodes),
        the ``drafting`` seconds the trees took counted against every size but none. Where the
        best is slower than a step whose rows never drafted, the next steps skip drafting: 1,
        then 2, 4, ... up to 64 steps while it keeps losing (a win resets the pause)."""
        share = self.accepted / self.drafted
        best, best_rate = 0, len(parents) / (self.seconds[0] + drafting)  # drafting, unused
        plain = len(parents) / self.seconds[0]  # had the rows not drafted at all
        for index, seconds in enumerate(self.seconds[1:], start=1):
            size = 1 << index
            expected = sum(1 + share * _depth_of(tree[: size - 1]) for tree in parents)
            if expected / (seconds + drafting) > best_rate:
                best, best_rate = size - 1, expected / (seconds + drafting)
        if best_rate < plain:  # drafting costs more than it brings: pause it
            self.skipped = min(64, max(1, 2 * self.skipped))
            self.pause = self.skipped
        else:
            self.skipped = 0
        return best

    def timed(self, size: int, seconds: float) -> None:
        """A step of ``size`` entries a row took ``seconds`` (its host read included): the
        table follows what steps take now, a running mean with :data:`WEIGHT` on the newest
        step (a table timed once, or when the machine was busier, misjudges every
        step after: on a 2-core EPYC a 4-row step was timed at 28.8 ms and then took 24.4).
        A step over three times the table's figure is left out (a CUDA graph's capture)."""
        index = size.bit_length() - 1
        current = self.seconds[index]
        if seconds <= 3 * current:
            self.seconds[index] = (1 - WEIGHT) * current + WEIGHT * seconds

    def resize(self, old: int, new: int) -> None:
        """The batch went from ``old`` rows to ``new``: every size's figure scaled by
        ``new / old`` (a CPU's steps cost about what their rows do; the ratios between sizes,
        which the choices weigh, are kept), then followed as the new steps are timed."""
        self.seconds = [seconds * new / old for seconds in self.seconds]

    def learn(self, depth: int, accepted: int) -> None:
        """A row's tree of ``depth`` had ``accepted`` of its nodes accepted."""
        self.drafted += depth
        self.accepted += accepted


def _depth_of(parents: list[int]) -> int:
    """The depth of a tree given by ``parents`` in topological order (0 for no nodes)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return max(depths, default=0)


def _check(
    model: PreTrainedModel, prompts: Sequence[Tensor], depth: int, max_new_tokens: int
) -> None:
    """Refuse prompts and ``max_new_tokens`` that, with trees ``depth`` deep (padding
    included), would pass the target's context."""
    if max_new_tokens < 1 or min(prompt.numel() for prompt in prompts) < 1:
        raise ValueError("need max_new_tokens >= 1 and prompts of at least one token")
    longest = max(prompt.numel() for prompt in prompts) + max_new_tokens + depth + 1
    if longest > context_limit(model):
        raise HeadwayError(
            f"the longest prompt and max_new_tokens={max_new_tokens} need {longest} positions; "
            f"the target holds {context_limit(model)}: shorten them"
        )


def _padded(tokens: list[int], parents: list[int], size: int) -> tuple[list[int], list[int]]:
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


@dataclass(frozen=True)
class _Ending:
    """When a row stops: an EOS id, ``check(generated)`` true (stop strings), or
    ``max_new_tokens``."""

    eos: frozenset[int]
    max_new_tokens: int
    check: Callable[[list[int]], bool] | None


def _commit(
    row: _Row,
    sequence: list[int],
    new: list[int],
    ending: _Ending,
) -> list[int]:
    """Append ``new`` to the row, stopping right after an EOS, the token the stop check
    stops at, or the ``max_new_tokens``-th token; returns what was kept."""
    kept: list[int] = []
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
            break
    sequence += kept
    row.accept_lengths.append(len(kept))
    return kept
