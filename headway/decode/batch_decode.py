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
``max_batch`` below the number of prompts, the waiting prompts take finished rows' places
(:meth:`BatchVerify.add_rows` prefills them as rows of their own; their drafting joins too): on
a CPU as soon as rows finish, so a batch never steps on idle rows while prompts wait; where
steps are captured once half the batch has finished (idle rows cost a GPU's step little). A
batch refilled to its size keeps its steps' graphs (the rows' lengths, seeds and columns live
in buffers that outlive a change of rows: ``tests/test_static_rows.py``); a smaller one
captures its own.

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

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.decode.batch_decoder import BatchDecoder, Ending
from headway.decode.batch_drafting import BatchDrafter, RowDrafters
from headway.decode.generate import GenerationResult
from headway.decode.keyed_noise import sequence_seeds
from headway.decode.sampling import GREEDY, SamplingParams
from headway.decode.session import Drafter

__all__ = ["decode_batch"]


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
    BatchDrafter` drafting every row's tree at once (a list of one per prompt: ``drafters[i]``
    drafts prompt ``i``; prompts are decoded shortest first); greedy or by ``sampling`` with the
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
    # shortest first (rows of like lengths decode together), a drafter given per prompt with it
    order = sorted(range(len(prompts)), key=lambda index: prompts[index].numel())
    if isinstance(drafters, Sequence) and len(drafters) == len(prompts):
        drafters = [drafters[index] for index in order]
    drafting = _row_drafters(drafters, batch, len(prompts))
    keys = None  # greedy: no noise
    if not sampling.greedy:
        given = None if seeds is None else torch.tensor(list(seeds), dtype=torch.long)
        keys = sequence_seeds(generator, len(prompts)) if given is None else given
    ending = Ending(frozenset(eos_token_ids), max_new_tokens, stop_check)
    decoder = BatchDecoder(model, drafting, batch, ending, sampling=sampling, capture=capture)
    submitted = {
        decoder.submit(prompts[index], None if keys is None else int(keys[index])): index
        for index in order
    }
    results: dict[int, GenerationResult] = {}
    for index, result in decoder.completions():
        results[submitted[index]] = result
        if on_done is not None:
            on_done(len(results))
    return [results[index] for index in range(len(prompts))]


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
