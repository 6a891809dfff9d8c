"""Coupled drafting (headway/drafters/coupled.py): candidates ranked with the target's noise
are the target's draw more often than the draft's top-k, and the loop couples an EAGLE drafter
to each sampled sequence only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from headway.decode.generate import Decoder
from headway.decode.keyed_noise import Coupling, draw_keyed
from headway.decode.sampling import SamplingParams
from headway.drafters.coupled import coupled_children
from tests.test_eagle3 import PROMPT, target_and_truth
from tests.test_static_eagle import SHAPES, _pair


def test_coupled_candidates_are_the_targets_draw_more_often_than_the_top_k() -> None:
    """A draft close to the target (its logits plus noise of scale 0.3), 50 tokens whose ids
    the draft lists in another order, 3,000 positions: the coupled first candidate is the
    target's Gumbel-max draw far more often than the draft's argmax, and its top 4 too."""
    generator = torch.Generator().manual_seed(0)
    vocab, positions = 50, 3000
    target = torch.randn(vocab, generator=generator) * 1.5
    ids = torch.randperm(vocab, generator=generator)  # candidate i is target token ids[i]
    draft = target[ids] + 0.3 * torch.randn(vocab, generator=generator)
    probs = torch.softmax(target, -1)
    hits = {"coupled 1": 0, "top 1": 0, "coupled 4": 0, "top 4": 0}
    top4 = ids[draft.topk(4).indices]
    for position in range(positions):
        key = Coupling(seed=7, temperature=1.0).key(position, torch.device("cpu"))
        drawn = int(draw_keyed(probs, key))
        scores, tokens = coupled_children(draft[None], ids, 4, key, 1.0)
        assert bool((scores <= 0).all()) and bool((scores[0, :-1] >= scores[0, 1:]).all())
        hits["coupled 1"] += int(tokens[0, 0]) == drawn
        hits["coupled 4"] += drawn in tokens[0].tolist()
        hits["top 1"] += int(top4[0]) == drawn
        hits["top 4"] += drawn in top4.tolist()
    rate = {name: count / positions for name, count in hits.items()}
    assert rate["coupled 1"] > rate["top 1"] + 0.15, rate
    assert rate["coupled 4"] > rate["top 4"] + 0.1, rate


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_loop_couples_an_eagle_drafter_to_sampled_sequences_only(temperature: float) -> None:
    model, _ = target_and_truth("llama")
    drafter, _ = _pair("trained", model, SHAPES["tree"])
    seen: list[Any] = []
    couple = drafter.couple

    def recorded(coupling: Coupling | None) -> None:
        seen.append(coupling)
        couple(coupling)

    drafter.couple = recorded
    Decoder(model, drafter).generate(
        PROMPT,
        max_new_tokens=8,
        eos_token_ids=(),
        sampling=SamplingParams(temperature=temperature),
        generator=torch.Generator().manual_seed(3),
    )
    assert len(seen) == 1
    if temperature == 0.0:
        assert seen[0] is None
    else:
        assert seen[0].temperature == temperature and seen[0].seed >= 0


@pytest.mark.parametrize("coupled", [True, False])
def test_the_coupled_option_decides_whether_a_built_drafter_couples(
    coupled: bool, tmp_path: Any
) -> None:
    """``--draft-option coupled=false`` builds an EAGLE drafter that drafts a sampled
    sequence by its top-k (to measure what coupling adds); the text is the same either way."""
    from headway.heads.eagle import EagleConfig, EagleModel
    from tests.drafting import heads_drafter
    from tests.test_eagle_drafter import save_run

    model, _ = target_and_truth("llama")
    run = save_run(tmp_path / "eagle", model, EagleModel(EagleConfig.from_target(model)))
    drafter: Any = heads_drafter(run, model, coupled=str(coupled).lower())
    assert drafter.couples is coupled
    texts = []
    for index, decoder in enumerate((Decoder(model, drafter), Decoder(model, None))):
        result = decoder.generate(
            PROMPT,
            max_new_tokens=8,
            eos_token_ids=(),
            sampling=SamplingParams(temperature=0.8),
            generator=torch.Generator().manual_seed(3),
        )
        texts.append(result.tokens)
        if index == 0:  # the drafter's: coupled to the sequence or not
            assert (drafter.coupling is not None) is coupled
    assert texts[0] == texts[1]
