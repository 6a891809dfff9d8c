"""Every family of ``tests/families.py`` on CUDA (``pytest -m gpu``): plain decoding and an
oracle tree, eager and over the captured static cache (CUDA graphs; the host-filled masks of
sliding and chunked layers), give transformers' own greedy output in fp32 (MLA's wider keys,
Gemma 3n's shared keys/values, GPT-OSS's sinks, Llama 4's chunks past their first chunk)."""

from __future__ import annotations

import pytest
import torch

from headway.decode.captured import StaticForward
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.drafters.oracle import OracleDrafter
from tests.families import FAMILIES, family_model
from tests.test_generate import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
PROMPT = [1, 5, 17, 33, 8, 40, 41, 9]
NEW_TOKENS = 40  # past Gemma 3n's 8-token window and two of Llama 4's 16-token chunks


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_exactly_over_the_captured_cache_on_cuda(family: str) -> None:
    model = family_model(family).to(CUDA)
    prompt = torch.tensor(PROMPT, device=CUDA)
    truth = hf_greedy(model, prompt, NEW_TOKENS, eos=None)
    for verify in ("eager", "captured"):
        for drafter in (None, OracleDrafter(truth, 4, width=3)):
            decoder = Decoder(model, drafter, DecodeOptions(verify=verify))
            if verify == "captured":
                assert isinstance(decoder.target, StaticForward) and decoder.target.capture
            result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_ids=())
            assert result.tokens == truth, (verify, drafter)
