"""Timed drafters (headway/eval/timed_drafter.py): a comparison row decodes as `headway generate`
does, chained device steps included, and reports a drafting cost only where it timed every step."""

from __future__ import annotations

import torch

from headway.decode.device_chain import DeviceChain
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.eval.timed_drafter import TimedChainDrafter, TimedDrafter, timed_drafter
from tests.test_eagle3 import PROMPT, target_and_truth
from tests.test_static_eagle import SHAPES, _pair

CPU = torch.device("cpu")


def test_a_chaining_drafter_is_timed_as_it_runs() -> None:
    """A static EAGLE drafter, wrapped, still takes chained runs on the captured path (the
    decoder chains it, the tokens and acceptance lengths are the bare drafter's); its runs
    are counted and no drafting cost is claimed for them."""
    model, truth = target_and_truth("llama")
    eager, static = _pair("trained", model, SHAPES["tree"])
    _, bare = _pair("trained", model, SHAPES["tree"])
    timed = timed_drafter(static, CPU)
    assert isinstance(timed, TimedChainDrafter)
    options = DecodeOptions(verify="captured", chain=4)
    decoder = Decoder(model, timed, options)
    mine = decoder.generate(PROMPT, max_new_tokens=30, eos_token_ids=())
    theirs = Decoder(model, bare, options).generate(PROMPT, max_new_tokens=30, eos_token_ids=())
    assert mine.tokens == theirs.tokens == truth[:30]
    assert mine.accept_lengths == theirs.accept_lengths
    assert isinstance(decoder._chain, DeviceChain) and decoder._chain.drafter is timed
    assert timed.chained_runs > 0 and timed.step_seconds is None
    timed.reset()
    assert timed.chained_runs == 0

    host = timed_drafter(eager, CPU)  # no chain methods: every step timed
    assert type(host) is TimedDrafter
    Decoder(model, host, DecodeOptions()).generate(PROMPT, max_new_tokens=12, eos_token_ids=())
    assert host.steps > 0 and host.step_seconds is not None and host.step_seconds > 0
