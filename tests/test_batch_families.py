"""The batched decoder (regeneration's default engine) for every model family: each row, a
first turn or a next turn continued from its turn before's keys/values, is transformers' greedy
output for its prompt alone (fp32), past a sliding window or an attention chunk too; a target
mixing local and full layers whose forward takes one mask is refused in one line, and
regeneration's ``auto`` answers it with HF generate instead."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from headway.decode import batch_sizer
from headway.decode.batch_decoder import BatchDecoder, Ending
from headway.decode.batch_drafting import RowDrafters
from headway.decode.batch_step import BatchVerify
from headway.decode.captured import StaticForward
from headway.decode.local_attention import has_local_attention
from headway.decode.session import Drafter
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.oracle import OracleDrafter
from headway.errors import TargetError
from headway.target import Target
from headway.train.answering import engine_for
from tests.families import FAMILIES, RECURRENT, family_config, family_model
from tests.test_generate import PROMPT, hf_greedy
from tests.tokenizers_fixture import smollm2_tokenizer

NEW = 8


def _rows_and_a_next_turn(model: PreTrainedModel, new: int, oracle: bool = False) -> None:
    """Two prompts two rows at a time, then the first one's next turn (its prompt, answer and
    three more tokens) continued from its row: each is transformers' greedy output. Drafted by
    prompt lookup, or by ``oracle`` trees three wide (nodes whose positions are not their
    columns')."""
    drafters: list[Drafter] = [PromptLookupDrafter(), PromptLookupDrafter()]
    if oracle:
        # rows are prefilled shortest first, their drafters in that order
        firsts = (PROMPT[:7], PROMPT)
        truths = [hf_greedy(model, p.to(model.device), new, eos=None) for p in firsts]
        drafters = [OracleDrafter(truth, 4, width=3) for truth in truths]
    drafting = RowDrafters(drafters)
    decoder = BatchDecoder(model, drafting, 2, Ending(frozenset(), new))
    prompts = {decoder.submit(PROMPT): PROMPT, decoder.submit(PROMPT[:7]): PROMPT[:7]}
    out: dict[int, list[int]] = {}
    steps: list[int] = []
    for index, result in decoder.completions():
        out[index] = result.tokens
        steps += result.accept_lengths
        if index == 0:
            after = torch.cat([PROMPT, torch.tensor(result.tokens), PROMPT[:3]])
            prompts[decoder.submit(after, after=index)] = after
    assert len(out) == 3 and decoder.reused == PROMPT.numel() + new - 1
    if oracle:  # the trees were accepted several nodes deep
        assert max(steps) > 3
    for index, tokens in out.items():
        truth = hf_greedy(model, prompts[index].to(model.device), new, eos=None)
        assert tokens == truth, index


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_and_continued_turns_are_each_prompts_greedy_output(family: str) -> None:
    model = family_model(family)
    assert engine_for(Target(model, smollm2_tokenizer(), family), "auto") == "batch"
    _rows_and_a_next_turn(model, NEW)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3-text", "llama4-text"])
def test_rows_past_a_sliding_window_or_a_chunk_are_exact(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3-token window (Mistral and a 4-layer Gemma 3 slide on every layer, Gemma 2
    alternates sliding and full layers) or Llama 4's 16-token chunks: rows of 7 to 40 tokens
    reach past them, and each is still transformers' greedy output (whose cache drops what
    slid out), drafted by prompt lookup or by whole trees whose accepted nodes sit at columns
    past their positions."""
    config = family_config(family, layers=4)
    if family != "llama4-text":
        config.sliding_window = 3  # shallower than a tree: its own nodes slide out too
    torch.manual_seed(0)
    model = type(family_model(family))(config).eval()
    assert has_local_attention(model)
    _rows_and_a_next_turn(model, 12)
    whole = lambda self, parents, drafting=0.0: max(map(len, parents), default=0)  # noqa: E731
    monkeypatch.setattr(batch_sizer.BatchSizer, "nodes", whole)  # every tree sent whole
    monkeypatch.setattr(batch_sizer, "PLAIN_EVERY", 10**9)  # every step drafts
    _rows_and_a_next_turn(model, 12, oracle=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama-llama3-rope", "gemma3-text", "llama4-text"])
def test_captured_rows_past_a_window_or_a_chunk_are_exact_on_cuda(family: str) -> None:
    """On CUDA the steps are captured: the local masks are built inside the graphs, and the
    graphs of two rows are kept when the third prompt takes a finished row's place."""
    config = family_config(family, layers=4)
    if family == "gemma3-text":
        config.sliding_window = 3
    torch.manual_seed(0)
    model = type(family_model(family))(config).eval().to("cuda")
    _rows_and_a_next_turn(model, 12)


def test_a_mixed_target_taking_one_mask_is_refused_and_regenerated_by_generate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from headway.decode import local_attention

    monkeypatch.setattr(local_attention, "takes_mask_mapping", lambda model: False)
    model = family_model("gemma2")
    with pytest.raises(TargetError, match="one mask per layer type") as refused:
        BatchVerify(StaticForward(model, capture=False, batch=2), max_depth=1)
    assert "\n" not in str(refused.value)
    assert engine_for(Target(model, smollm2_tokenizer(), "gemma2"), "auto") == "generate"


@pytest.mark.parametrize("family", RECURRENT)
def test_regeneration_answers_a_recurrent_target_with_generate(family: str) -> None:
    target = Target(family_model(family), smollm2_tokenizer(), family)
    assert engine_for(target, "auto") == "generate"


@pytest.mark.parametrize("family", ["gemma2", "llama4-text"])
def test_a_local_targets_step_body_reads_nothing_back(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local masks are built inside the step's body (what a GPU records as a graph): on a
    sliding (Gemma 2, 3 tokens, mixed with full layers) or chunked (Llama 4) target the body
    reads nothing back and copies nothing in (headway.eval.dispatch's counter), one host read
    a step, and rows past the window or chunk are transformers' greedy output."""
    from tests.test_batch_step import DEPTH, _counted_bodies, _decode

    config = family_config(family, layers=4)
    if family != "llama4-text":
        config.sliding_window = 3
    torch.manual_seed(0)
    model = type(family_model(family))(config).eval()
    prompts = [PROMPT, PROMPT[:5]]
    truths = [hf_greedy(model, p, 20 + DEPTH + 1, eos=None) for p in prompts]
    step = BatchVerify(StaticForward(model, batch=2), max_depth=DEPTH)
    roots = step.prefill(prompts)
    counter = _counted_bodies(step, model, roots, monkeypatch)
    monkeypatch.setattr(step, "prefill", lambda prompts: roots)
    with torch.inference_mode(), counter:
        generated = _decode(step, prompts, truths, 20)
    assert [row[:20] for row in generated] == [truth[:20] for truth in truths]
    assert counter.counts.graph_faults == {}
