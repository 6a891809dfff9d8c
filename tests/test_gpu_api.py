"""``headway.generate`` called again and again on CUDA (its default verify path captured):
the decoder a drafter name resolved to is kept with its static cache and graphs, so later calls
capture nothing new (so do a heads folder's, while its files are unchanged), and every output
equals plain eager decoding (fp32). Skipped without CUDA;
run in the device plan's call A (scripts/device/call_a.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import headway
from headway.decode import captured
from headway.decode.options import DecodeOptions
from headway.target import Target
from tests.test_eagle3 import tiny4
from tests.test_formats import random_run
from tests.tokenizers_fixture import smollm2_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("named", ["prompt-lookup", "heads folder"])
def test_later_api_calls_reuse_the_captured_decoder_on_cuda(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, named: str
) -> None:
    """A drafter name, or a heads folder whose files did not change (an EAGLE-3 run of random
    weights here: static drafting on CUDA), keeps its decoder and graphs between calls."""
    tokenizer = smollm2_tokenizer()
    model = tiny4("llama", vocab_size=len(tokenizer))  # EAGLE-3 fuses three distinct layers
    drafter = (
        "prompt-lookup"
        if named == "prompt-lookup"
        else str(random_run(tmp_path / "run", "eagle3", model))
    )
    model = model.to("cuda")
    target = Target(model, tokenizer, "tiny")
    captures: list[int] = []
    record = captured.record_graph

    def counted(*args: object) -> object:
        captures.append(1)
        return record(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(captured, "record_graph", counted)
    eager = DecodeOptions(verify="eager")
    question = "Name three rivers."
    plain = headway.generate(target, question, drafter=None, options=eager, max_new_tokens=24)
    counts = []
    for _ in range(3):
        out = headway.generate(target, question, drafter=drafter, max_new_tokens=24)
        assert out.token_ids == plain.token_ids
        counts.append(len(captures))
    assert counts[0] > 0 and counts[2] == counts[1] == counts[0]  # nothing captured again
