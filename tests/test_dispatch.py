"""The CPU proxy for GPU decoding cost: ops counted where they run, syncs counted, and nothing
left patched afterwards."""

from __future__ import annotations

import torch
from torch import Tensor

from headway.decode.forwards import EagerForward
from headway.decode.generate import Decoder, generate
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.oracle import OracleDrafter
from headway.eval.dispatch import DispatchCounter, count_decoding, dispatch_table
from tests.tiny import tiny_model

PROMPT = torch.tensor([1, 7, 23, 45, 12, 9, 60, 7, 23, 45, 12])


def test_ops_and_syncs_are_counted_where_they_run() -> None:
    x = torch.arange(6.0)
    tolist = Tensor.tolist
    with DispatchCounter() as counter:
        y = x * 2 + 1  # two ops
        with counter.inside_target():
            z = y.sum()  # one op, the target's
        assert int(z) == 36  # select-free item: one op, one sync
        assert y.tolist()[0] == 1.0  # no op, one sync
        assert y.nonzero().numel() == 6  # one op, one sync
    assert (counter.counts.ops, counter.counts.target_ops, counter.counts.syncs) == (4, 1, 3)
    assert Tensor.tolist is tolist  # restored on exit


def test_plain_decoding_dispatches_little_outside_the_target_and_the_counter_leaves() -> None:
    model = tiny_model("llama")
    plain = Decoder(model, None)
    counts = count_decoding(plain, [PROMPT], max_new_tokens=12, eos_token_ids=())
    assert counts.tokens == 12 and counts.steps == 11  # the prefill commits the first token
    assert counts.target_ops > 10 * counts.steps  # a forward is many ops
    assert "verify" not in vars(plain.target) and type(plain.target) is EagerForward
    truth = generate(model, PROMPT, drafter=None, max_new_tokens=12, eos_token_ids=()).tokens
    assert plain.generate(PROMPT, max_new_tokens=12, eos_token_ids=()).tokens == truth


def test_a_drafter_adds_ops_outside_the_target_and_the_table_shows_them() -> None:
    model = tiny_model("llama")
    truth = generate(model, PROMPT, drafter=None, max_new_tokens=16, eos_token_ids=()).tokens
    counts = {
        "none": count_decoding(Decoder(model, None), [PROMPT], max_new_tokens=16, eos_token_ids=()),
        "oracle": count_decoding(
            Decoder(model, OracleDrafter(truth, 3, width=2)),
            [PROMPT],
            max_new_tokens=16,
            eos_token_ids=(),
        ),
        "lookup": count_decoding(
            Decoder(model, PromptLookupDrafter(min_ngram=1)),
            [PROMPT],
            max_new_tokens=16,
            eos_token_ids=(),
        ),
    }
    assert counts["oracle"].steps < counts["none"].steps  # drafts were accepted
    for name in ("oracle", "lookup"):
        assert counts[name].per_step()["ops_per_step"] > counts["none"].per_step()["ops_per_step"]
    lines = dispatch_table(counts)
    assert len(lines) == 5 and lines[2].startswith("| none |")
