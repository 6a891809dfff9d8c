"""One verify cost table per verify path, shared by the cost-sized decoders of a comparison
(``scripts/compare.py``'s rows used to time one each: seconds per row, the same forwards)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from headway.decode.options import DecodeOptions
from headway.drafters.lookup import PromptLookupDrafter
from headway.eval.cost_tables import CostTables
from tests.tiny import tiny_model


def test_cost_sized_decoders_share_one_table_unless_one_needs_a_larger_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timed: list[int] = []

    def table(model: Any, max_tokens: int, **_: Any) -> list[float]:
        timed.append(max_tokens)
        return [0.01 * (1 + m / 8) for m in range(1, max_tokens + 1)]

    # the module, not the function headway.decode re-exports under its name
    generate = importlib.import_module("headway.decode.generate")
    monkeypatch.setattr(generate, "verify_cost_table", table)
    model, tables = tiny_model("llama"), CostTables()

    def decoder(nodes: int, sizing: str = "cost", verify: str = "eager") -> Any:
        drafter = PromptLookupDrafter(max_nodes=nodes, adaptive=False)
        options = DecodeOptions(sizing=sizing, verify=verify)  # type: ignore[arg-type]
        return tables.decoder(model, drafter, options)

    first = decoder(12)
    assert timed == [13]
    smaller = decoder(5)  # served by the first table: its first six entries
    assert timed == [13]
    smaller.prepare()
    assert smaller.sizer is not None and smaller.sizer.costs == first.sizer.costs[:6]
    decoder(12, sizing="drafter")  # sized by the drafter: no table
    decoder(20)  # needs more than the table holds: timed, and kept for later decoders
    assert timed == [13, 21]
    decoder(16)
    assert timed == [13, 21]
    decoder(8, verify="captured")  # another verify path times its own forwards
    assert timed == [13, 21, 9]
