"""Verify-cost helpers: which nodes pay for their forward, and the online acceptance scale."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from headway.decode.costs import AcceptanceCalibration, TreeSizer, worth_threshold
from headway.decode.generate import generate
from headway.drafters.datastore import NgramDatastore, RetrievalDrafter
from tests.loop_sized import LoopSized
from tests.test_generate import hf_greedy
from tests.tiny import tiny_model


def test_worth_threshold_is_the_cheapest_marginal_node() -> None:
    # one extra node costs 100% more, two 55% each, three 40% each
    assert worth_threshold([0.01, 0.02, 0.021, 0.022]) == pytest.approx(0.4)
    assert worth_threshold([0.01, 0.01]) == 0.0
    assert worth_threshold([0.01]) == float("inf")


def test_calibration_scales_estimates_by_what_was_accepted() -> None:
    calibration = AcceptanceCalibration(prior_tokens=4.0)
    assert calibration.scale == 1.0
    calibration.update(predicted=10.0, accepted=2)
    assert calibration.scale == pytest.approx(6 / 14)
    scaled = calibration.apply(torch.tensor([0.9, 0.5]))
    assert scaled.tolist() == pytest.approx([0.9 * 6 / 14, 0.5 * 6 / 14])
    calibration.update(predicted=0.0, accepted=60)
    assert calibration.scale == 4.0 and calibration.apply(torch.tensor([0.5])).item() == 1.0


def test_tree_sizer_keeps_what_pays_and_calibrates_on_what_it_sent() -> None:
    estimates = torch.tensor([0.9, 0.5, 0.2, 0.05])
    sizer = TreeSizer([0.010] * 5, max_nodes=4)  # verifying more costs nothing: send all
    assert sizer.keep(estimates) == 4
    sizer.observed(1)  # the four nodes predicted 1.65 tokens; one was accepted
    assert sizer.calibration.scale == pytest.approx((4 + 1) / (4 + 1.65))
    sizer.observed(3)  # nothing pending any more: no second update
    assert sizer.calibration.scale == pytest.approx((4 + 1) / (4 + 1.65))

    steep = TreeSizer([0.010, 0.030, 0.050, 0.070, 0.090], max_nodes=4)
    assert steep.keep(estimates) == 0
    steep.observed(2)  # nothing was sent, so nothing is learnt
    assert steep.calibration.scale == 1.0

    knee = TreeSizer([0.010, 0.012, 0.019, 0.020, 0.021], max_nodes=4)
    assert knee.keep(estimates) == 1
    knee.forget()  # generation stopped before the tree was verified
    knee.observed(0)
    assert knee.calibration.scale == 1.0
    assert knee.keep(estimates) == 1
    knee.observed(0)  # 0.9 predicted, nothing accepted
    assert knee.calibration.scale == pytest.approx(4 / 4.9)

    with pytest.raises(ValueError, match="5 nodes ranked"):
        knee.keep(torch.ones(5))
    with pytest.raises(ValueError, match=r"verify_costs has 2 entries; max_nodes=4 .* 1\.\.5"):
        TreeSizer([0.01, 0.02], max_nodes=4)
    with pytest.raises(ValueError, match="verify_costs has 2 entries; a tree of 3 nodes"):
        TreeSizer([0.01, 0.02], max_nodes=3, budget="a tree of 3 nodes")


def test_a_fallen_scale_is_probed_and_recovers() -> None:
    """Rejections push the scale down until nothing is sent; then only every 5th held-back step
    sends the best node, and accepted probes raise the scale until trees are sent again."""
    costs = [0.010, 0.013, 0.014, 0.015, 0.016]  # a node pays above ~0.3 acceptance
    estimates = torch.tensor([0.9, 0.8, 0.7, 0.6])
    sizer = TreeSizer(costs, max_nodes=4, probe_every=5)
    sent = []
    for _ in range(30):  # a bad stretch: whatever is sent is rejected
        sent.append(sizer.keep(estimates))
        sizer.observed(0)
    silent = sent.index(0)
    assert silent > 0
    assert sent[silent:] == ([0, 0, 0, 0, 1] * 10)[: 30 - silent]  # probes, one node each
    for _ in range(40):  # the drafter is right again: every probed node is accepted
        count = sizer.keep(estimates)
        sizer.observed(count)
    assert sizer.keep(estimates) >= 2  # the scale recovered; trees are sent without probing

    steep = TreeSizer([0.010, 0.030, 0.050, 0.070, 0.090], max_nodes=4, probe_every=2)
    assert [steep.keep(estimates) for _ in range(6)] == [0] * 6  # raw estimates never pay: no probe
    with pytest.raises(ValueError, match="probe_every"):
        TreeSizer(costs, max_nodes=4, probe_every=0)


def test_tree_sizer_score_floor_is_the_log_of_the_calibrated_threshold() -> None:
    costs = [0.01, 0.02, 0.021, 0.022]  # worth_threshold 0.4 (three nodes at 40% each)
    sizer = TreeSizer(costs, max_nodes=3)
    assert sizer.score_floor() == pytest.approx(math.log(0.4))
    sizer.calibration.update(predicted=4.0, accepted=0)  # scale 0.5: a node needs 0.8 raw
    assert sizer.score_floor() == pytest.approx(math.log(0.8))
    sizer.calibration.update(predicted=8.0, accepted=0)  # scale 0.25: only a certain node
    assert sizer.score_floor() == 0.0
    assert TreeSizer(costs, max_nodes=1).score_floor() == 0.0  # one node: threshold 1.0
    assert TreeSizer([0.01, 0.01, 0.02], max_nodes=2).score_floor() == -math.inf


def test_a_draft_level_that_costs_time_raises_the_floor() -> None:
    """One more level of draft forwards must pay too: its seconds against a plain token's."""
    flat = TreeSizer([0.01, 0.01, 0.01], max_nodes=2)  # verifying more costs nothing extra
    assert flat.score_floor() == -math.inf
    assert flat.score_floor(level_seconds=0.001) == pytest.approx(math.log(0.1))
    cheaper = TreeSizer([0.01, 0.008, 0.009], max_nodes=2)  # a negative verify share counts 0
    assert cheaper.score_floor(level_seconds=0.002) == pytest.approx(math.log(0.2))
    costs = [0.01, 0.02, 0.021, 0.022]  # worth_threshold 0.4, plus a level at 10% of a token
    assert TreeSizer(costs, max_nodes=3).score_floor(0.001) == pytest.approx(math.log(0.5))
    assert flat.score_floor(level_seconds=0.05) == 0.0  # dearer than a token: only certainty
    timed = type("Timed", (), {"level_seconds": 0.001})()
    assert flat.floor_for(timed) == pytest.approx(math.log(0.1))  # the drafter's own timing
    assert flat.floor_for(object()) == -math.inf  # a drafter that times nothing


def test_a_corpus_that_is_always_rejected_stops_being_sent() -> None:
    """Every corpus continuation agrees (shares 1.0), verification accepts none of it: the scale
    falls with every rejected tree until no node pays for its forward."""
    store = NgramDatastore([[1, 2, 3, 4, 5, 6]] * 3)
    costs = [0.010, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018, 0.019, 0.020]
    drafter = LoopSized(RetrievalDrafter(store, min_hits=1), costs)
    drafter.begin(torch.tensor([7]))
    sequence = torch.tensor([7, 1, 2])
    sizes = []
    for _ in range(12):
        sizes.append(drafter.propose(sequence).size)
        drafter.observe(torch.tensor([9]), ())  # only the bonus token: nothing accepted
    assert sizes[0] == 4 and sizes[-1] == 0
    assert all(later <= earlier for earlier, later in itertools.pairwise(sizes))
    assert drafter.calibration.scale < 0.2


def test_a_corpus_that_is_right_keeps_being_sent_and_decoding_is_exact() -> None:
    model = tiny_model("llama")
    prompt = torch.tensor([5, 17, 42, 8, 91, 23])
    truth = hf_greedy(model, prompt, 32, eos=None)
    costs = [0.010, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018, 0.019, 0.020]
    drafter = LoopSized(RetrievalDrafter(NgramDatastore([truth] * 3), min_hits=1), costs)
    result = generate(model, prompt, drafter=drafter, max_new_tokens=32, eos_token_ids=())
    assert result.tokens == truth
    assert drafter.calibration.scale > 0.5 and result.tau > 1.5, result.accept_lengths


def test_the_verify_timer_prefills_once_and_prepare_builds_the_sizer() -> None:
    """A cost table times several block sizes after one prefill (each timed forward is cut
    back to the prefix), and ``Decoder.prepare`` does that timing before any generation."""
    from headway.decode.costs import verify_cost_table, verify_timer
    from headway.decode.forwards import EagerForward
    from headway.decode.generate import Decoder
    from headway.decode.options import DecodeOptions

    model = tiny_model("llama")
    runner = EagerForward(model)
    prefills = []
    real = runner.prefill

    def counted(
        ids: torch.Tensor, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        prefills.append(ids.shape[1])
        return real(ids, layers)

    runner.prefill = counted  # type: ignore[method-assign,assignment]
    table = verify_cost_table(model, 9, seconds=verify_timer(model, 16, forward=runner))
    assert prefills == [16] and len(table) == 9 and all(t > 0 for t in table)
    assert runner.cache.get_seq_length() == 16  # the prefix, every timed block cut back
    drafter = RetrievalDrafter(NgramDatastore([[1, 2, 3, 4]]), min_hits=1)
    decoder = Decoder(model, drafter, DecodeOptions(sizing="cost"))
    assert decoder.sizer is None
    decoder.prepare()
    assert decoder.sizer is not None
