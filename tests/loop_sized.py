"""A drafter as the decoding loop sizes it under ``DecodeOptions(sizing="cost")``, with a given
cost table: for unit tests of one drafter's scored proposals without a target model."""

from __future__ import annotations

from torch import Tensor

from headway.decode.costs import AcceptanceCalibration, TreeSizer
from headway.decode.generate import Drafter
from headway.decode.tree import DraftTree


class LoopSized:
    """``drafter`` behind the loop's :class:`TreeSizer` over ``costs`` (propose with the floor,
    trim, calibrate on what was accepted), exactly as ``Decoder`` drives it."""

    def __init__(self, drafter: Drafter, costs: list[float]) -> None:
        self.drafter = drafter
        self.sizer = TreeSizer(costs, drafter.max_nodes)
        self.hidden_layers = drafter.hidden_layers
        self.max_nodes = drafter.max_nodes

    @property
    def verify_costs(self) -> list[float]:
        return self.sizer.costs

    @property
    def calibration(self) -> AcceptanceCalibration:
        return self.sizer.calibration

    def begin(self, prompt_ids: Tensor) -> None:
        self.sizer.forget()
        self.drafter.begin(prompt_ids)

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        floor = self.sizer.floor_for(self.drafter)
        return self.sizer.trim(self.drafter.propose(sequence, floor))

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        self.sizer.observed(new_tokens.numel() - 1)
        self.drafter.observe(new_tokens, hidden)
