"""How the decoding loop runs, as opposed to what it generates: :class:`DecodeOptions`.

One frozen value, given to :class:`~headway.decode.generate.Decoder` (or
:func:`~headway.decode.generate.generate`), that the command line builds from ``--sizing``,
``--acceptance`` and ``--verify``. How the forwards multiply on a CPU (``--gemm``) is not an
option of the loop: it is applied once to each model (:func:`headway.decode.gemm.apply_gemm`).
None of it changes what greedy decoding outputs; ``acceptance`` alone can change what sampling
outputs (``"typical"`` is lossy).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

import torch

from headway.decode.verify import AcceptanceRule

__all__ = ["DecodeOptions", "Sizing", "VerifyPath", "verify_path"]

Sizing = Literal["drafter", "cost"]
VerifyPath = Literal["eager", "captured", "compiled"]


@dataclass(frozen=True)
class DecodeOptions:
    """Attributes:
    sizing: ``"drafter"``: each drafter sizes its own trees (a fixed Medusa tree, EAGLE's
        ``total_tokens``, prompt lookup's adaptive length, retrieval's share threshold).
        ``"cost"``: the loop times the target's verify forward once and, every step, sends
        only the drafted nodes that pay for their share of it, ranked by the drafter's
        acceptance estimates (:class:`~headway.decode.costs.TreeSizer`).
    acceptance: ``"lossless"`` (the target's own output) or Medusa's ``"typical"`` (LOSSY when
        sampling; :func:`headway.decode.verify.verify_typical`).
    verify: ``"eager"``: the model's own forward over a ``DynamicCache``. ``"captured"``: a
        static cache, each verify forward replayed from a CUDA graph captured per padded block
        size (:mod:`headway.decode.captured`; uncaptured off CUDA). ``"compiled"``: as
        captured, the verify forward compiled by ``torch.compile`` first (fused kernels on a
        GPU; compiling takes a while on first use of each block size). Same tokens either way
        (fp32).
    device_trees: with ``verify="captured"`` or ``"compiled"``, lossless acceptance and
        ``sizing="drafter"``, let a drafter whose trees stay on the device (static EAGLE
        drafting, Medusa heads, plain decoding) skip the host: layout, mask, acceptance and
        compaction run on the device and a step reads it once
        (:mod:`headway.decode.device_step`). The same tokens either way, greedy or sampled
        with one seed (False is the reference).
    chain: device steps per run (:mod:`headway.decode.device_chain`; without a drafter a
        step is a token): each step's committed count, next root and prefix length stay on the
        device for the next (sampled, each step computes its positions' noise), so a GPU
        takes ``chain`` steps back to back and the host reads it once per run instead of once
        a step (the last few steps of a generation one at a time). Default 1: on an H100
        (2026-11-27, bf16, MT-bench x8) runs of 8 captured as one graph ran 0.63x (plain) and
        0.50x (the shipped EAGLE-3) of a read a step; runs now replay a one-step graph, not
        yet measured on a GPU. Same tokens either way (sampled too, with one seed).
    """

    sizing: Sizing = field(default="drafter")
    acceptance: AcceptanceRule = field(default="lossless")
    verify: VerifyPath = field(default="eager")
    device_trees: bool = field(default=True)
    chain: int = field(default=1)

    def __post_init__(self) -> None:
        if not isinstance(self.chain, int) or self.chain < 1:
            raise ValueError(f"chain={self.chain!r}: a whole number of tokens, at least 1")
        for name, kind in (
            ("sizing", Sizing),
            ("acceptance", AcceptanceRule),
            ("verify", VerifyPath),
        ):
            valid = typing.get_args(kind)
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: choose one of {', '.join(map(repr, valid))}"
                )


def verify_path(name: str, where: torch.device | torch.nn.Module) -> VerifyPath:
    """The verify path ``name`` means for a target on ``where`` (a device, or the model):
    ``"auto"`` (the command line's and the API's default) is ``"captured"`` on one CUDA device,
    where CUDA graphs remove a small target's kernel-launch cost (plain decoding of
    SmolLM2-135M in bf16 on an H200: 221 tokens/s captured, 48 eager), and ``"eager"`` elsewhere:
    off CUDA nothing is captured and the static path is a few percent slower; a model spread
    over several devices (``device_map``) is not captured. Any other name is kept.

    Raises:
        ValueError: a name that is none of auto and the verify paths.
    """
    if name == "auto":
        if isinstance(where, torch.device):
            devices = {where}
        else:
            devices = {parameter.device for parameter in where.parameters()}
        one_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
        return "captured" if one_cuda else "eager"
    valid = typing.get_args(VerifyPath)
    if name not in valid:
        raise ValueError(f"verify={name!r}: choose 'auto' or one of {', '.join(map(repr, valid))}")
    return typing.cast(VerifyPath, name)
