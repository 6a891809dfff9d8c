"""The speculative decoding loop: prefill, then propose → verify → compact the cache → commit.

One loop serves every drafter; with ``drafter=None`` each step verifies an empty tree, which is
plain autoregressive decoding through the very same code. A step is the host step
(:func:`draft_step`: the tree on the host) or, where a drafter's tree stays on the device and the
verify path is static, the device step (:func:`device_step`, :mod:`headway.decode.device_step`).
Guarantees (fp32): with greedy sampling the tokens equal the target's own greedy decoding
(``model.generate(do_sample=False)``); with sampling and ``acceptance="lossless"`` they follow
the target distribution shaped by
:class:`~headway.decode.sampling.SamplingParams` (Leviathan et al. 2023; Chen et al. 2023; Miao et
al. 2023, SpecInfer). Lower precisions can flip near-tied argmaxes between the tree forward and a
plain forward, so exactness is only promised in fp32.

Counting convention. ``accept_lengths[0]`` is the prefill forward, which commits the first token
(always 1). Each later entry is one verify forward: accepted drafted tokens + the bonus token
(after truncation at EOS / a stop sequence / ``max_new_tokens``). So ``sum(accept_lengths) ==
len(tokens)`` and ``num_forwards == len(accept_lengths)``. ``tau`` is the mean acceptance length
over the draft steps only, ``mean(accept_lengths[1:])``, the convention of the Medusa and EAGLE
papers (1.0 for plain decoding; NaN if no draft step ran).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.decode.captured import StaticForward, block_bucket
from headway.decode.costs import TreeSizer, verify_cost_table, verify_timer
from headway.decode.device_chain import ChainDrafter, DeviceChain, EmptyChain, chained_step
from headway.decode.device_step import DeviceDrafter, DeviceStep, DeviceVerify
from headway.decode.forwards import EagerForward, TargetForward
from headway.decode.gemm import gemm_route
from headway.decode.keyed_noise import Coupling, sequence_seeds
from headway.decode.kv import context_limit
from headway.decode.options import DecodeOptions
from headway.decode.sampling import GREEDY, SamplingParams, pick_tokens
from headway.decode.session import Drafter, Session, StopReason, commit
from headway.decode.tree import DraftTree, empty_tree, limit_depth
from headway.decode.verify import verify
from headway.timings import remembered, seconds_table, shapes_digest

__all__ = ["Decoder", "Drafter", "GenerationResult", "StopReason", "generate"]

logger = logging.getLogger(__name__)

INITIAL_ROOM = 4096
"""Answer tokens the sequence buffer (and a static cache) holds before they are first grown."""

DEFAULT_OPTIONS = DecodeOptions()


class _NoDrafter(EmptyChain):
    """Plain decoding: always proposes the empty tree (on the device too, so plain captured
    decoding takes the device step: one host read and no tree bookkeeping a token)."""

    hidden_layers: tuple[int, ...] = ()
    max_nodes = 0
    depth = 0
    _nothing: tuple[Tensor, Tensor] | None = None

    def propose_on_device(self) -> tuple[Tensor, Tensor] | None:
        if self._nothing is None:
            nothing = torch.empty(0, dtype=torch.long)
            self._nothing = (nothing, nothing)
        return self._nothing

    def observe_on_device(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: int) -> None:
        return None

    def begin(self, prompt_ids: Tensor) -> None:
        return None

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        return empty_tree()

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        return None


@dataclass
class GenerationResult:
    """What :func:`generate` produced (see the module docstring for the counting convention).

    Attributes:
        tokens: the generated ids only (no prompt), including a final EOS / stop sequence.
        accept_lengths: tokens committed by each target forward, prefill first.
        num_forwards: target forwards run, prefill included.
        stop_reason: why generation ended.
    """

    tokens: list[int]
    accept_lengths: list[int]
    num_forwards: int
    stop_reason: StopReason

    @property
    def tau(self) -> float:
        """Mean tokens per verify forward over the draft steps (prefill excluded); NaN if none."""
        steps = self.accept_lengths[1:]
        return sum(steps) / len(steps) if steps else math.nan


def _first_token(session: Session, logits: Tensor) -> int:
    keys = None if session.sampling.greedy else session.keys(1)[0]
    return int(pick_tokens(logits, session.sampling, keys))


def prefill_step(session: Session) -> None:
    """Run the prompt, commit the first generated token, let the drafter observe."""
    prompt = session.sequence[: session.length]
    logits, hidden = session.target.prefill(prompt[None], session.drafter.hidden_layers)
    committed = commit(session, [_first_token(session, logits)])
    observed = torch.cat([prompt[1:], torch.tensor(committed)])
    session.drafter.observe(observed, hidden)


def _fit(tree: DraftTree, session: Session) -> DraftTree:
    """Trim the draft so every accepted token + the bonus still fits in the context window."""
    room = session.context_limit - session.length
    return limit_depth(tree, room - 1)


def draft_step(session: Session) -> None:
    """One speculative step: propose, verify the tree in one forward, keep the accepted path."""
    root = session.sequence[session.length - 1 : session.length]
    sizer = session.sizer
    floor = None if sizer is None else sizer.floor_for(session.drafter)
    tree = session.drafter.propose(session.sequence[: session.length], floor)
    tree = _fit(tree if sizer is None else sizer.trim(tree), session)
    prefix_len = session.length - 1
    block = torch.cat([root, tree.tokens.cpu()])[None]
    logits, hidden = session.target.verify(
        block, tree.parents, prefix_len, session.drafter.hidden_layers
    )
    rule = session.options.acceptance
    keys = None if session.sampling.greedy else session.keys(tree.size + 1)
    accepted = verify(tree, logits, session.sampling, keys, rule)
    session.target.compact(prefix_len, accepted.path)
    committed = commit(session, accepted.tokens.tolist())
    if sizer is not None:  # the bonus token is not a drafted one
        sizer.observed(len(committed) - 1)
    path = accepted.path[: len(committed)]
    observed_hidden = tuple(layer[path.to(layer.device)] for layer in hidden)
    session.drafter.observe(torch.tensor(committed), observed_hidden)


def device_step(session: Session) -> bool:
    """One speculative step with the tree kept on the device (module docstring); False, with
    nothing done, where it cannot run (no device step set up, too near the context limit, or
    nothing observed), so the caller takes the host step."""
    step = session.device
    if step is None or session.context_limit - session.length < step.drafter.depth + 1:
        return False
    if chained_step(session, step):  # several steps a run, one read (device_chain.py)
        return True
    tree = step.drafter.propose_on_device()
    if tree is None:
        return False
    root = int(session.sequence[session.length - 1])
    hidden_layers = session.drafter.hidden_layers
    tokens, padded, hidden = step.verify.run(
        root, tree, session.length - 1, hidden_layers, session.sampling, session.seed
    )
    committed = commit(session, tokens)
    step.drafter.observe_on_device(padded, hidden, len(committed))
    return True


def _prompt(prompt_ids: Tensor | Sequence[int]) -> Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).cpu()
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(
            f"prompt_ids must be a non-empty [P] or [1, P] tensor of ids (batch size 1), "
            f"got shape {tuple(prompt.shape)}"
        )
    return prompt


class Decoder:
    """Speculative decoding of one ``model`` with one ``drafter`` under ``options``, for any number
    of prompts. What it works out once lives as long as it: how the target runs
    (:mod:`headway.decode.forwards`: the GEMM routing of eager verify forwards, or the static
    cache and captured graphs of ``verify="captured"``) and, with ``options.sizing == "cost"``,
    the verify cost table (timed on the first :meth:`generate`) and the acceptance calibration
    of the one :class:`TreeSizer` every step is sized by. ``drafter=None`` is plain decoding
    through the same loop. ``verify_costs``, a :func:`~headway.decode.costs.verify_cost_table`
    timed elsewhere, is used instead of timing.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        drafter: Drafter | None = None,
        options: DecodeOptions = DEFAULT_OPTIONS,
        *,
        verify_costs: Sequence[float] | None = None,
    ) -> None:
        self.model = model
        self.drafter: Drafter = drafter if drafter is not None else _NoDrafter()
        self.options = options
        if options.verify == "eager":
            gemm_route(model)  # decided now ("auto" times it), not in the first forward
        self.target: TargetForward = (
            EagerForward(model)
            if options.verify == "eager"
            else StaticForward(model, compile=options.verify == "compiled")
        )
        self.sizer: TreeSizer | None = None
        self._costs = None if verify_costs is None else list(verify_costs)
        self._verifier: DeviceVerify | None = None
        self._chain: DeviceChain | None = None

    def _device_step(self, sampling: SamplingParams) -> DeviceStep | None:
        """What the device step needs, where it applies (:mod:`headway.decode.device_step`)."""
        drafter, target = self.drafter, self.target
        if not (
            self.options.device_trees
            and (sampling.greedy or self.options.acceptance == "lossless")
            and (self.options.sizing == "drafter" or drafter.max_nodes == 0)
            and isinstance(target, StaticForward)
            and target.takes_device_trees
            and isinstance(drafter, DeviceDrafter)
        ):
            return None
        if self._verifier is None:
            self._verifier = DeviceVerify(target, drafter.depth)
        own = hasattr(type(drafter), "chain_propose")  # not a wrapper (timing, recording)
        if own and isinstance(drafter, ChainDrafter) and self.options.chain > 1:
            if self._chain is None or self._chain.drafter is not drafter:
                self._chain = DeviceChain(self._verifier, drafter, self.options.chain)
            return DeviceStep(self._verifier, drafter, self._chain)
        return DeviceStep(self._verifier, drafter)

    def prepare(self) -> None:
        """Do now the one-off work the first :meth:`generate` would do (timing the target's
        verify forward for cost sizing), so that per-generation timings leave it out."""
        self._tree_sizer()

    def _timed_costs(self, sizes: int) -> list[float]:
        """The verify cost table for blocks of 1 .. ``sizes`` tokens, timed once per machine,
        model shapes, GEMM route and verify forward (:mod:`headway.timings`)."""
        weight = self.model.get_output_embeddings().weight
        key: dict[str, object] = {"model": shapes_digest(self.model), "sizes": sizes}
        key |= {"route": gemm_route(self.model), "forward": type(self.target).__name__}
        return remembered(
            "the verify cost table",
            key,
            lambda: verify_cost_table(
                self.model, sizes, seconds=verify_timer(self.model, 128, forward=self.target)
            ),
            device=weight.device,
            valid=seconds_table(sizes),
        )

    def _tree_sizer(self) -> TreeSizer | None:
        """The cost sizer, built on first use (timing the verify forward takes a second or so)."""
        if self.options.sizing != "cost" or self.drafter.max_nodes < 1:
            return None
        if self.sizer is None:
            nodes = self.drafter.max_nodes
            costs = self._costs or self._timed_costs(nodes + 1)
            self.sizer = TreeSizer(costs, nodes, budget=f"a drafter of max_nodes={nodes}")
        self.sizer.forget()  # a tree the last generation stopped after is never verified
        return self.sizer

    def generate(
        self,
        prompt_ids: Tensor | Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        eos_token_ids: Sequence[int],
        stop_sequences: Sequence[Sequence[int]] = (),
        stop_check: Callable[[list[int]], bool] | None = None,
        generator: torch.Generator | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Decode up to ``max_new_tokens`` after ``prompt_ids`` (``[P]`` or ``[1, P]``).

        Stops after an EOS in ``eos_token_ids`` (also one inside an accepted draft), after a
        completed stop sequence (matched on the generated tokens; included in the output), at
        ``max_new_tokens``, when ``stop_check(generated_ids)`` turns true after a token (e.g. a
        stop *string* found in the decoded text; the token stays in the output), or when prompt +
        output fill the model's ``max_position_embeddings`` (drafts are trimmed to fit).
        Committed tokens are streamed to ``on_tokens`` after every forward. ``sampling``
        defaults to greedy.
        """
        model = self.model
        prompt = _prompt(prompt_ids)
        _check_request(prompt, max_new_tokens, stop_sequences, context_limit(model))
        if max_new_tokens == 0:
            return GenerationResult([], [], 0, "max_new_tokens")
        sizer = self._tree_sizer()  # may time the target: before its cache is set up
        answer = min(max_new_tokens, INITIAL_ROOM)  # a huge max_new_tokens is a cap: grown later
        block = block_bucket(getattr(self.drafter, "max_nodes", 0))
        self.target.begin(prompt.numel() + answer + block)
        session = Session(
            target=self.target,
            drafter=self.drafter,
            sampling=sampling,
            options=self.options,
            sizer=sizer,
            seed=0 if sampling.greedy else int(sequence_seeds(generator, 1)[0]),
            max_new_tokens=max_new_tokens,
            context_limit=context_limit(model),
            eos=frozenset(int(token) for token in eos_token_ids),
            stop_sequences=tuple(tuple(int(t) for t in stop) for stop in stop_sequences),
            stop_check=stop_check,
            on_tokens=on_tokens,
            sequence=torch.cat([prompt, prompt.new_zeros(answer)]),  # commit grows it
            length=prompt.numel(),
            device=self._device_step(sampling),
        )
        _run(session, prompt)
        assert session.stop_reason is not None  # _run only returns once a stop reason is set
        return GenerationResult(
            tokens=session.generated,
            accept_lengths=session.accept_lengths,
            num_forwards=len(session.accept_lengths),
            stop_reason=session.stop_reason,
        )


def generate(
    model: PreTrainedModel,
    prompt_ids: Tensor | Sequence[int],
    *,
    drafter: Drafter | None,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    eos_token_ids: Sequence[int],
    stop_sequences: Sequence[Sequence[int]] = (),
    stop_check: Callable[[list[int]], bool] | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    options: DecodeOptions = DEFAULT_OPTIONS,
) -> GenerationResult:
    """One generation with a fresh :class:`Decoder` (see :meth:`Decoder.generate`); keep a
    ``Decoder`` instead to decode several prompts under cost sizing without re-timing the
    target and re-learning the calibration each time."""
    return Decoder(model, drafter, options).generate(
        prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_token_ids=eos_token_ids,
        stop_sequences=stop_sequences,
        stop_check=stop_check,
        generator=generator,
        on_tokens=on_tokens,
    )


def _check_request(
    prompt: Tensor, max_new_tokens: int, stop_sequences: Sequence[Sequence[int]], limit: int
) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if any(len(stop) == 0 for stop in stop_sequences):
        raise ValueError("stop_sequences contains an empty sequence, which would match anywhere")
    if prompt.numel() >= limit:
        raise ValueError(
            f"the prompt has {prompt.numel()} tokens but the model's context holds {limit} "
            "(max_position_embeddings); leave room for at least one generated token"
        )


def _run(session: Session, prompt: Tensor) -> None:
    with torch.inference_mode():
        session.drafter.begin(prompt)
        couple = getattr(session.drafter, "couple", None)
        if couple is not None:  # a drafter that drafts with the sampling noise (coupled.py)
            sampled = not session.sampling.greedy and session.options.acceptance == "lossless"
            temperature = session.sampling.temperature
            couple(Coupling(session.seed, temperature) if sampled else None)
        prefill_step(session)
        while session.stop_reason is None:
            if session.length >= session.context_limit:
                session.stop_reason = "context_limit"
                break
            if not device_step(session):
                draft_step(session)
