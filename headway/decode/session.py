"""What one generation carries between the loop's steps, and how tokens are committed; what
the loop needs from a drafter (:class:`Drafter`, re-exported by :mod:`headway.decode.generate`).

:class:`Session` is built by :meth:`~headway.decode.generate.Decoder.generate` for each prompt
and never stored on the model; :func:`commit` appends a step's tokens and decides whether
generation stops (EOS, a stop sequence, ``max_new_tokens``). Both the host step
(:func:`~headway.decode.generate.draft_step`) and the device step
(:func:`~headway.decode.generate.device_step`) commit through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import Tensor

from headway.decode.costs import TreeSizer
from headway.decode.device_step import DeviceStep
from headway.decode.forwards import TargetForward
from headway.decode.keyed_noise import position_keys
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams
from headway.decode.tree import DraftTree

__all__ = ["Drafter", "Session", "StopReason", "commit"]

StopReason = Literal["eos", "max_new_tokens", "stop_sequence", "context_limit"]


class Drafter(Protocol):
    """What the loop needs from a drafter (propose/observe, like transformers' candidate
    generators).

    Attributes:
        hidden_layers: target hidden states the drafter needs, as indices into the target's
            ``output_hidden_states``; () for none.
        max_nodes: the most nodes one proposal holds (the loop's cost table covers that many).
    """

    hidden_layers: tuple[int, ...]
    max_nodes: int

    def begin(self, prompt_ids: Tensor) -> None:
        """Start a new generation from ``prompt_ids`` LongTensor ``[P]``."""

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        """Draft a tree continuing ``sequence`` LongTensor ``[T]`` (CPU, read-only): every
        committed id, ending with the root (the last token, not yet in the target cache).

        ``floor`` is ``None`` when the drafter sizes its own tree (``DecodeOptions(sizing=
        "drafter")``). Otherwise the loop sizes it: propose every node worth ranking, with
        ``scores``; nodes whose log acceptance estimate is below ``floor`` cannot pay for
        their share of the verify forward and need not be drafted at all."""
        ...

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Learn the newly committed ``new_tokens [k]``. ``hidden[l][i]`` ``[k, H]`` is the target
        hidden state (layer ``hidden_layers[l]``) at the position just before ``new_tokens[i]``,
        i.e. the state whose LM-head output predicted it. After prefill ``new_tokens`` is
        ``prompt[1:]`` + the first generated token; after a step, accepted tokens + bonus."""


@dataclass
class Session:
    """Everything one generation carries between steps (never stored on the model)."""

    def keys(self, count: int) -> Tensor:
        """Sampling's noise keys (LongTensor ``[count]``, host) of the next ``count``
        positions: the token after the last committed one first
        (:mod:`headway.decode.keyed_noise`)."""
        positions = torch.arange(self.length, self.length + count)
        return position_keys(torch.tensor(self.seed), positions)

    target: TargetForward
    drafter: Drafter
    sampling: SamplingParams
    options: DecodeOptions
    sizer: TreeSizer | None
    seed: int  # the sequence's sampling seed (headway.decode.keyed_noise; greedy: unused)
    max_new_tokens: int
    context_limit: int
    eos: frozenset[int]
    stop_sequences: tuple[tuple[int, ...], ...]
    stop_check: Callable[[list[int]], bool] | None
    on_tokens: Callable[[list[int]], None] | None
    sequence: Tensor  # LongTensor buffer, grown as tokens are committed; `length` of them valid
    length: int
    generated: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    stop_reason: StopReason | None = None
    device: DeviceStep | None = None  # steps whose tree stays on the device, where they can


def _stop_after(session: Session, token: int) -> StopReason | None:
    """Why generation must stop right after committing ``token`` (None: keep going)."""
    if token in session.eos:
        return "eos"
    tail = session.generated
    for stop in session.stop_sequences:
        if len(tail) >= len(stop) and tuple(tail[-len(stop) :]) == stop:
            return "stop_sequence"
    if session.stop_check is not None and session.stop_check(tail):
        return "stop_sequence"
    if len(tail) >= session.max_new_tokens:
        return "max_new_tokens"
    return None


def commit(session: Session, candidates: list[int]) -> list[int]:
    """Append ``candidates`` one by one, stopping right after an EOS, a completed stop sequence
    or the ``max_new_tokens``-th token; stream and return the committed ones."""
    committed: list[int] = []
    for token in candidates:
        if session.length == session.sequence.numel():  # grown on demand, doubling
            session.sequence = torch.cat([session.sequence, torch.zeros_like(session.sequence)])
        session.sequence[session.length] = token
        session.length += 1
        session.generated.append(token)
        committed.append(token)
        session.stop_reason = _stop_after(session, token)
        if session.stop_reason is not None:
            break
    session.accept_lengths.append(len(committed))
    if session.on_tokens is not None:
        session.on_tokens(committed)
    return committed
