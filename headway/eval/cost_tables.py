"""One verify cost table per verify path, shared by every cost-sized decoder of a comparison.

Timing a :func:`~headway.decode.costs.verify_cost_table` takes seconds (4 s on a 2-core CPU for
SmolLM2), and each cost-sized :class:`~headway.decode.generate.Decoder` of one target and one
verify path would time the same forwards; ``scripts/compare.py`` builds a dozen of them.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from headway.decode.generate import Decoder, Drafter
from headway.decode.options import DecodeOptions

__all__ = ["CostTables"]


class CostTables:
    """The verify cost tables of one target, by verify path. A table timed for ``n`` block
    tokens serves any decoder needing at most ``n`` (its first entries, interpolated over a grid
    that reaches ``n`` rather than stopping at the decoder's own size); a decoder needing more
    times a larger one, which later decoders share."""

    def __init__(self) -> None:
        self.tables: dict[str, list[float]] = {}

    def decoder(
        self, model: PreTrainedModel, drafter: Drafter | None, options: DecodeOptions
    ) -> Decoder:
        """``Decoder(model, drafter, options)``; cost-sized, it gets the path's table, timed
        now by this decoder (its own verify forward) if none is large enough."""
        if options.sizing != "cost" or drafter is None or drafter.max_nodes < 1:
            return Decoder(model, drafter, options)
        needed = drafter.max_nodes + 1
        table = self.tables.get(options.verify, [])
        if len(table) >= needed:
            return Decoder(model, drafter, options, verify_costs=table[:needed])
        decoder = Decoder(model, drafter, options)
        decoder.prepare()
        assert decoder.sizer is not None
        self.tables[options.verify] = list(decoder.sizer.costs)
        return decoder
