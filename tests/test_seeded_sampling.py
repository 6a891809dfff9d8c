"""A seed samples the same text whatever drafts it (headway.decode.keyed_noise): every drafter,
the host and the device step, cost-sized trees, a batch of any size (CPU, fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from headway.decode.batch_decode import decode_batch
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams
from headway.drafters.batch_eagle import BatchEagle
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.static_eagle import StaticEagle3Drafter
from headway.heads.eagle import TargetHead
from tests.test_device_step import KINDS, _decoders
from tests.test_eagle3 import PROMPT, target_and_truth
from tests.test_static_eagle import SHAPES, _pair

WARM = SamplingParams(temperature=0.3)  # drafts get accepted, and the text is not greedy's
NEW = 24


def _sampled(run: Decoder, seed: int, sampling: SamplingParams = WARM) -> tuple[list[int], int]:
    result = run.generate(
        PROMPT,
        max_new_tokens=NEW,
        eos_token_ids=(),
        sampling=sampling,
        generator=torch.Generator().manual_seed(seed),
    )
    return result.tokens, sum(length - 1 for length in result.accept_lengths[1:])


@pytest.mark.parametrize(
    "sampling", [WARM, SamplingParams(temperature=1.0, top_k=20, top_p=0.9)], ids=repr
)
def test_a_seed_samples_the_same_text_with_any_drafter_and_step(sampling: SamplingParams) -> None:
    """No drafter, prompt lookup and the EAGLE drafters of every kind (eager ones coupled to the
    sampling noise, static ones), each through the
    host step, the device step, chained device steps and cost-sized host steps: one seed, one
    text; another seed, another text."""
    model, greedy = target_and_truth("llama")
    plain = Decoder(model, None)
    expected, _ = _sampled(plain, 7, sampling)
    assert expected != greedy[:NEW] and _sampled(plain, 8, sampling)[0] != expected
    drafted = 0
    pairs = [_pair(kind, model, SHAPES["tree"]) for kind in KINDS]  # (eager, static)
    for drafter in [None, PromptLookupDrafter(), *(d for pair in pairs for d in pair)]:
        runs = [
            *_decoders(model, drafter),  # the host step and the device step, captured path
            Decoder(model, drafter, DecodeOptions(verify="captured", chain=4)),  # chained runs
            Decoder(model, drafter, DecodeOptions(sizing="cost")),  # cost-sized host steps
        ]
        for run in runs:
            tokens, accepted = _sampled(run, 7, sampling)
            assert tokens == expected, (type(drafter).__name__, run.options)
            drafted += accepted
    assert drafted > 0  # drafts were accepted: the trees did decide tokens


def test_a_sampled_batch_gives_each_prompt_its_seeds_text_whatever_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of one batch, through 1, 2 or 4 rows at a time, with prompt lookup or none, and
    trees cut to sizes drawn at random each step, prefilled in one forward or in runs of like
    lengths: the same tokens for every prompt; the first prompt's are the single-sequence
    loop's for the same generator seed, and two rows of one prompt sample two texts."""
    from headway.decode import batch_prefill, batch_sizer

    chance = torch.Generator().manual_seed(0)

    def any_size(self: Any, parents: list[list[int]], drafting: float = 0.0) -> int:
        return int(torch.randint(0, 8, (), generator=chance))

    monkeypatch.setattr(batch_sizer.BatchSizer, "nodes", any_size)
    model, _ = target_and_truth("llama")
    repeated = torch.cat([PROMPT, PROMPT[:6]])  # prompt lookup finds something to draft
    prompts = [PROMPT, repeated, PROMPT, PROMPT[:5]]
    outputs = []
    settings = [(None, None, 0), ("lookup", None, 0), ("lookup", 1, 0), (None, 2, 0)]
    for drafter_kind, max_batch, budget in [*settings, ("lookup", None, 8)]:
        monkeypatch.setattr(batch_prefill, "PREFILL_TOKENS", budget or batch_prefill.PREFILL_TOKENS)
        drafters = [PromptLookupDrafter() if drafter_kind else None for _ in prompts]
        rows = decode_batch(
            model,
            prompts,
            drafters,
            max_new_tokens=NEW,
            sampling=WARM,
            generator=torch.Generator().manual_seed(4),
            max_batch=max_batch,
        )
        outputs.append([row.tokens for row in rows])
    assert all(found == outputs[0] for found in outputs[1:])
    assert outputs[0][0] == _sampled(Decoder(model, None), 4)[0]
    assert outputs[0][0] != outputs[0][2]  # the same prompt, another seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_seed_samples_the_host_text_on_cuda_through_captured_steps() -> None:
    """On CUDA (fp32), captured: plain decoding, a static EAGLE-3 drafter's and Medusa
    heads' coupled device steps and chained runs sample, from one host seed, the text the CPU
    samples without a drafter (the noise computed inside the graphs); the host step too (no
    drafter, a coupled eager one); a batch's first row, drafted (coupled, captured) or not."""
    from tests.test_device_step import random_medusa
    from tests.test_gpu import EAGLE3_TREE, cuda_eagle3

    model, _ = target_and_truth("llama")
    expected, _ = _sampled(Decoder(model, None), 7)
    medusa = random_medusa(model)  # coupled heads: keys of the live length inside a run
    cuda = model.to("cuda")
    medusa.heads.to("cuda")
    prompt = PROMPT.to("cuda")
    draft, head = cuda_eagle3(cuda), TargetHead.of(cuda)
    for drafter in [None, StaticEagle3Drafter(draft, head, **EAGLE3_TREE), medusa]:
        for chain in (1, 4):
            run = Decoder(cuda, drafter, DecodeOptions(verify="captured", chain=chain))
            result = run.generate(
                prompt,
                max_new_tokens=NEW,
                eos_token_ids=(),
                sampling=WARM,
                generator=torch.Generator().manual_seed(7),
            )
            assert result.tokens == expected, (type(drafter).__name__, chain)
    eager = Eagle3Drafter(draft, head, **EAGLE3_TREE)
    for host in (None, eager):  # the host step on CUDA: host keys, device distributions
        result = Decoder(cuda, host).generate(
            prompt,
            max_new_tokens=NEW,
            eos_token_ids=(),
            sampling=WARM,
            generator=torch.Generator().manual_seed(7),
        )
        assert result.tokens == expected, ("host step", type(host).__name__)
    for drafting in ([None, None], BatchEagle(eager, 2)):
        rows = decode_batch(
            cuda,
            [prompt, prompt[:5]],
            drafting,
            max_new_tokens=NEW,
            sampling=WARM,
            generator=torch.Generator().manual_seed(7),
        )
        assert rows[0].tokens == expected
