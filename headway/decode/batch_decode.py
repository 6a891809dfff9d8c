"""Greedy speculative decoding of several prompts at once (``headway.generate_batch``,
``headway generate --batch``).

The rows' drafting is one :class:`~headway.decode.batch_drafting.BatchDrafter`: one drafter per
row (:class:`~headway.decode.batch_drafting.RowDrafters`, of the
:class:`~headway.decode.session.Drafter` protocol: prompt lookup and retrieval from the row's own
tokens, any other from the target's states the batched steps leave for that row,
:attr:`BatchVerify.hidden`), or an EAGLE draft model drafting every row's tree at once
(:class:`~headway.drafters.batch_eagle.BatchEagle`; Medusa heads likewise,
:class:`~headway.drafters.batch_medusa.BatchMedusa`), and each step verifies every row's tree
in one forward over one static cache (:class:`~headway.decode.batch_step.BatchVerify`: one host
read a step for all rows). Trees
differ in size between rows; a step pads each row's tree to the step's size with a chain of
padding nodes under the root, the first holding a token none of the root's children holds (a
padding node is a candidate like any other: accepted only where it is what greedy decoding or
speculative sampling would commit, so the output is unchanged), the size rounded so the block
is a power of two: a handful of shapes (and, on CUDA, of captured graphs) covers every step. A
row that has finished (EOS, a stop string or ``max_new_tokens``) steps on with an empty tree,
committing nothing, until a quarter of the batch has finished (half where steps are captured as
CUDA graphs, which a new batch size captures again); then the finished rows leave it
(:meth:`BatchVerify.keep_rows`: on a CPU a step's time grows with its rows). With
``max_batch`` below the number of prompts, the waiting prompts take finished rows' places as
soon as rows finish (:meth:`BatchVerify.add_rows` prefills them as rows of their own; their
drafting joins too), so a batch never steps on idle rows while prompts wait.

How far to draft is weighed a step at a time (:class:`~headway.decode.batch_sizer.
BatchSizer`): every row's tree is cut to
one block size ``S`` (1, 2, 4, ... entries a row), the size whose expected committed tokens
over the measured time of a step of that size is highest. The sizes are timed on the rows
themselves once per machine, model, batch size and cache size (kept, as the GEMM route and the
verify cost table are: :mod:`headway.timings`), then following the steps taken; each row's
expected tokens add, for every depth its tree reaches at that size, how often an accepted path
has reached that depth so far. On a CPU, where a step's time
grows with ``B x S``, one row's long draft no longer makes every row verify its padding
(MT-bench x8, SmolLM2 fp32, 2-core EPYC, prompt lookup: a batch whose rows all verified the
longest row's tree ran 1.48x HF greedy one prompt at a time, sized so 2.85x, both on the stock
GEMM route; 4.64x on the packed one with grouped heads read once, docs/usage.md);
on a GPU, where a small model's step costs about the same at any size, the whole trees go.

Greedy, each row's tokens are the target's greedy output for that prompt alone (fp32);
sampled, each row's tokens are what its seed samples for that prompt, whatever the trees, the
batch and the rows beside it (prompt ``i`` gets the ``i``-th seed of
:func:`~headway.decode.keyed_noise.sequence_seeds`; the first prompt's tokens are
``headway.generate``'s for it with the same generator), and they follow the target's
distribution (``tests/test_batch_decode.py``; with Medusa and EAGLE drafters every row accepts
what it accepts decoded alone, ``tests/test_batch_eagle.py``). On a CPU a batch's step is bound by
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
from headway.decode.batch_sizer import BatchSizer, depth_of
from headway.decode.batch_step import BatchVerify
from headway.decode.captured import StaticForward, block_bucket
from headway.decode.gemm import gemm_route
from headway.decode.generate import GenerationResult
from headway.decode.grouped_attention import grouped_attention
from headway.decode.keyed_noise import sequence_seeds
from headway.decode.kv import context_limit
from headway.decode.sampling import GREEDY, SamplingParams
from headway.decode.session import Drafter, StopReason
from headway.errors import HeadwayError

__all__ = ["decode_batch"]


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
    seeds: Sequence[int] | None = None,
    capture: bool | None = None,
    max_batch: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> list[GenerationResult]:
    """Decode ``prompts`` (LongTensors ``[P_b]``) together, drafted by ``drafters``: one per
    row (``drafters[b]``, None: no drafter) or a :class:`~headway.decode.batch_drafting.
    BatchDrafter` drafting every row's tree at once; greedy or by ``sampling`` with the
    prompts' seeds drawn from ``generator`` (or given: ``seeds``, one per prompt); see the
    module docstring.
    ``stop_check(generated)`` true ends a row after that token (stop strings). ``capture``:
    CUDA graphs (default: on CUDA). ``max_batch``: the most prompts decoded at once
    (default: all), the rest taking finished rows' places;
    a list of ``drafters`` may then hold one per row of the first batch. ``on_done(n)`` is
    called as prompts finish, ``n`` the number finished so far (a progress bar). Returns one
    :class:`~headway.decode.generate.GenerationResult` per prompt, as a prompt decoded alone.

    Raises:
        HeadwayError: drafters reading the target's states at different layers, or prompts
            and ``max_new_tokens`` past the target's context.
    """
    if not prompts or (max_batch is not None and max_batch < 1):
        raise ValueError(f"need at least one prompt and max_batch >= 1, not {max_batch}")
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    batch = min(len(prompts), max_batch or len(prompts))
    drafting = _row_drafters(drafters, batch, len(prompts))
    depth = block_bucket(drafting.max_nodes + 1) - 1  # the deepest node, padding included
    _check(model, prompts, depth, max_new_tokens)
    gemm_route(model)  # the model's GEMM route on a CPU ("auto" where none was applied)
    with grouped_attention(model):  # each grouped key/value head read once a step
        forward = StaticForward(model, capture=capture, batch=batch)
        steps = BatchVerify(forward, depth, drafting.hidden_layers)
        ending = _Ending(frozenset(eos_token_ids), max_new_tokens, stop_check)
        keys = None  # greedy: no noise
        if not sampling.greedy:
            given = None if seeds is None else torch.tensor(list(seeds), dtype=torch.long)
            keys = sequence_seeds(generator, len(prompts)) if given is None else given
        rows = _Rows(steps, drafting, prompts, ending, sampling, keys, on_done)
        return _decode(rows)


@dataclass
class _Rows:
    """The batch's rows while it runs: which prompt each row decodes (:attr:`order`), those
    waiting for a row (:attr:`queue`), and every prompt's generation so far."""

    steps: BatchVerify
    drafting: BatchDrafter
    prompts: Sequence[Tensor]
    ending: _Ending
    sampling: SamplingParams
    seeds: Tensor | None  # sampled: each prompt's seed [prompts]
    on_done: Callable[[int], None] | None = None
    order: list[int] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)
    everyone: list[_Row] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)
    started: bool = False  # whether the first rows were prefilled
    reported: int = 0  # prompts finished, as last told to on_done

    def __post_init__(self) -> None:
        self.everyone = [_Row() for _ in self.prompts]
        self.ids = [prompt.tolist() for prompt in self.prompts]
        self.queue = list(range(len(self.prompts)))

    def start(self, prompts: list[int]) -> None:
        """Prefill ``prompts`` (indices) as rows after the batch's (the first: the batch),
        shortest first (rows of like lengths share a prefill forward), and commit their first
        tokens; their drafting learns their prompts."""
        steps, device = self.steps, self.steps.target.model.device
        prompts = sorted(prompts, key=lambda index: self.prompts[index].numel())
        on_device = [self.prompts[index].to(device) for index in prompts]
        seeds = None if self.seeds is None else self.seeds[prompts]
        if not self.started:
            self.started = True
            self.drafting.begin([self.prompts[index] for index in prompts])
            firsts = steps.prefill(on_device, self.sampling, seeds).tolist()
        else:
            self.drafting.add_rows([self.prompts[index] for index in prompts])
            firsts = steps.add_rows(on_device, self.sampling, seeds).tolist()
        kept: list[list[int]] = [[] for _ in self.order]
        for index, first in zip(prompts, firsts, strict=True):
            row, sequence = self.everyone[index], self.ids[index]
            _commit(row, sequence, [int(first)], self.ending)
            # each prompt entry's state predicted the token after it, as in the loop
            kept.append(sequence[1:] if row.stop_reason is None else [])
        self.order += prompts
        self.couple()
        self.drafting.observe(kept, steps.hidden)

    def couple(self) -> None:
        """Sampled, the drafting (where it takes it) drafts each row with the row's noise
        (its prompt's seed: :mod:`headway.drafters.coupled`); greedy, by its top-k."""
        couple = getattr(self.drafting, "couple", None)
        if couple is not None:
            seeds = None if self.seeds is None else self.seeds[self.order]
            couple(seeds, self.sampling.temperature)

    def reshaped(self) -> bool:
        """Drop finished rows (once a quarter of the batch has finished, half where its steps
        are captured, or at once where prompts wait) and put waiting prompts in their places;
        False once every prompt is done."""
        rows = [self.everyone[index] for index in self.order]
        going = [place for place, row in enumerate(rows) if row.stop_reason is None]
        done = len(rows) - len(going)
        if self.on_done is not None:
            finished = len(self.prompts) - len(self.queue) - len(going)
            if finished != self.reported:
                self.reported = finished
                self.on_done(finished)
        if not going and not self.queue:
            return False
        # a captured batch captures its graphs again for every new batch size: there finished
        # rows leave once half has finished (a GPU's step costs about the same for fewer rows)
        share = 2 if self.steps.target.capture else 4
        if done == 0 or (done < -(-len(rows) // share) and not self.queue):
            return True
        self.steps.keep_rows(going)  # none at all, for a moment, where every row finished
        self.drafting.keep_rows(going)
        self.order = [self.order[place] for place in going]
        added, self.queue = self.queue[:done], self.queue[done:]
        if added:
            self.start(added)
        else:
            self.couple()
        return True


def _decode(batch: _Rows) -> list[GenerationResult]:
    steps, drafting = batch.steps, batch.drafting
    batch.start(batch.queue[: steps.batch])
    batch.queue = batch.queue[steps.batch :]
    sizer = BatchSizer(steps, steps.max_depth + 1) if drafting.drafts else None
    while True:
        size = len(batch.order)
        if not batch.reshaped():
            break
        if sizer is not None and len(batch.order) != size:
            sizer.resize(size, len(batch.order))
        rows = [batch.everyone[index] for index in batch.order]
        ids = [batch.ids[index] for index in batch.order]
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
        padded = [_padded(tokens, parents, nodes) for tokens, parents in trees]
        tokens = torch.tensor([t for t, _ in padded], dtype=torch.long)
        parents = torch.tensor([p for _, p in padded], dtype=torch.long)
        roots = torch.tensor([sequence[-1] for sequence in ids])
        begun = time.perf_counter()
        committed = steps.step(roots, tokens, parents, torch.tensor(live), batch.sampling)
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
                sizer.learn(depth_of(tree), len(new) - 1)
            tokens_kept = _commit(row, sequence, new, batch.ending)
            kept.append(tokens_kept if row.stop_reason is None else [])
        if drafting.drafts:
            drafting.observe(kept, steps.hidden)
    results = []
    for row in batch.everyone:
        assert row.stop_reason is not None  # the loop ends once every row has stopped
        forwards = len(row.accept_lengths)
        results.append(GenerationResult(row.tokens, row.accept_lengths, forwards, row.stop_reason))
    return results


def _row_drafters(
    drafters: Sequence[Drafter | None] | BatchDrafter, batch: int, prompts: int
) -> BatchDrafter:
    """``drafters`` as a batch's drafting: a list holds one drafter per row of the first
    batch, or one per prompt (the others kept for rows that join)."""
    if not isinstance(drafters, Sequence):
        return drafters
    if len(drafters) not in (batch, prompts):
        raise ValueError(
            f"need one drafter (or None) per row ({batch}) or per prompt ({prompts}); "
            f"got {len(drafters)}"
        )
    return RowDrafters(drafters[:batch], spare=drafters[batch:])


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
