"""Coupled Medusa drafting: each head's candidates ranked with the noise the target draws with
at the position that head predicts (headway/drafters/medusa_drafter.py, batch_medusa.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode.batch_decode import decode_batch
from headway.decode.batch_drafting import RowDrafters
from headway.decode.generate import Decoder, GenerationResult, generate
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams
from headway.drafters.batch_medusa import BatchMedusa
from headway.drafters.medusa_drafter import MedusaDrafter
from headway.heads.hidden_states import final_hidden_layer
from headway.heads.medusa import MedusaConfig, MedusaHeads
from tests.test_batch_eagle import NEW_TOKENS, PROMPTS, _whole_trees
from tests.test_batch_medusa import _drafters
from tests.test_eagle3 import PROMPT, target_and_truth
from tests.tiny import TINY_VOCAB

WARM = SamplingParams(temperature=1.0)


class SeeingMedusa(MedusaDrafter):
    """Medusa heads whose first head is the target itself: its logits at the position after
    the sequence (the distribution the target draws the first drafted token from)."""

    def __init__(self, model: Any) -> None:
        torch.manual_seed(1)
        heads = MedusaHeads(MedusaConfig(2, 1, 32, TINY_VOCAB), model.lm_head.weight).eval()
        choices = [[0], [1], [2], [0, 0]]
        super().__init__(heads, hidden_layer=final_hidden_layer(model), choices=choices)
        self.model = model
        self._next: Tensor | None = None

    def propose(self, sequence: Tensor, floor: float | None = None) -> Any:
        with torch.inference_mode():
            self._next = self.model(sequence[None]).logits[0, -1]
        return super().propose(sequence, floor)

    def head_logits(self, hidden: Tensor) -> Tensor:
        logits = super().head_logits(hidden).clone()
        assert self._next is not None
        logits[0] = self._next
        return logits


def _sampled(model: Any, drafter: MedusaDrafter | None, seed: int) -> GenerationResult:
    return generate(
        model, PROMPT, drafter=drafter, max_new_tokens=40, eos_token_ids=(), sampling=WARM,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def test_the_first_head_coupled_at_its_position_drafts_the_targets_draw() -> None:
    """A first head equal to the target's next-token distribution, coupled: its first
    candidate is the target's draw at nearly every step (the noise is the target's at the
    position the head predicts), so far more tokens are accepted than by the top-3 of the
    same distribution; the text is the target's either way."""
    model, _ = target_and_truth("llama")
    accepted = {}
    for coupled in (True, False):
        drafter = SeeingMedusa(model)
        drafter.couples = coupled
        runs = [_sampled(model, drafter, seed) for seed in range(3)]
        plain = [_sampled(model, None, seed) for seed in range(3)]
        assert [run.tokens for run in runs] == [run.tokens for run in plain]
        assert (drafter.coupling is not None) is coupled
        steps = [n for run in runs for n in run.accept_lengths[1:]]
        accepted[coupled] = sum(n >= 2 for n in steps) / len(steps)
    assert accepted[True] > 0.9 and accepted[True] > accepted[False] + 0.2, accepted


@pytest.mark.parametrize("chain", [1, 4])
def test_device_steps_couple_as_the_host_step_does(chain: int) -> None:
    """Sampled through the device step (the captured path's, uncaptured on a CPU), one step
    a run or four, coupled random Medusa heads draft what the host step drafts (the same
    acceptance lengths: the sequence length they count themselves, moved on the device in a
    chained run)."""
    model, _ = target_and_truth("llama")
    drafter = _drafters(model, "default", 1)[0]
    results = []
    for options in (DecodeOptions(), DecodeOptions(verify="captured", chain=chain)):
        decoder = Decoder(model, drafter, options)
        results.append(
            decoder.generate(
                PROMPT,
                max_new_tokens=40,
                eos_token_ids=(),
                sampling=WARM,
                generator=torch.Generator().manual_seed(4),
            )
        )
    assert results[0].tokens == results[1].tokens
    assert results[0].accept_lengths == results[1].accept_lengths


def test_greedy_medusa_drafts_by_the_top_k() -> None:
    model, _ = target_and_truth("llama")
    drafter = _drafters(model, "default", 1)[0]
    generate(model, PROMPT, drafter=drafter, max_new_tokens=4, eos_token_ids=())
    assert drafter.coupling is None


@pytest.mark.parametrize("choices", ["default", [[0], [1], [0, 0], [0, 0, 0], [1, 0]]])
def test_a_sampled_batch_couples_each_row_as_its_own_drafter_does(
    choices: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampled, the batch's heads rank each row's candidates with that row's noise: every
    row drafts and accepts what its own coupled drafter does, and the first row what it does
    decoded alone with the same seed; uncoupled, the same texts are accepted otherwise."""
    _whole_trees(monkeypatch)
    model, _ = target_and_truth("llama")
    drafters = _drafters(model, choices, 4)

    def run(drafting: Any) -> list[GenerationResult]:
        return decode_batch(
            model, PROMPTS, drafting, max_new_tokens=NEW_TOKENS, sampling=WARM,
            generator=torch.Generator().manual_seed(6),
        )  # fmt: skip

    together, alone = run(BatchMedusa(drafters[3], 3)), run(RowDrafters(drafters[:3]))
    assert [row.tokens for row in together] == [row.tokens for row in alone]
    assert [row.accept_lengths for row in together] == [row.accept_lengths for row in alone]
    single = generate(
        model, PROMPTS[0], drafter=drafters[0], max_new_tokens=NEW_TOKENS, eos_token_ids=(),
        sampling=WARM, generator=torch.Generator().manual_seed(6),
    )  # fmt: skip
    assert (single.tokens, single.accept_lengths) == (
        together[0].tokens,
        together[0].accept_lengths,
    )
    drafters[3].couples = False
    plain = run(BatchMedusa(drafters[3], 3))
    assert [row.tokens for row in plain] == [row.tokens for row in together]
    assert [row.accept_lengths for row in plain] != [row.accept_lengths for row in together]
