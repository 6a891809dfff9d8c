"""SpecForge's EAGLE-3 model reads headway's ``eagle3-hf`` export and drafts what headway drafts.

SpecForge (PyPI ``specforge``, SGLang's drafter-training framework) defines the layout SGLang
serves as ``LlamaForCausalLMEagle3``; ``make setup`` installs it without its dependencies (it
pins torch 2.11, transformers 5.8.1 and sglang). Its model is built here from the export's
``config.json`` (``LlamaConfig``, as its ``config_class``) and the export's tensors loaded by
name, then driven through its own ``project_hidden_states`` / ``backbone`` / ``compute_logits``
with its test-time-training cache: three draft steps at every position must equal headway's
(:mod:`tests.engine_drafts`), for a trained tiny drafter and for the shipped one on SmolLM2.

Not through its ``from_pretrained``: under transformers 5.24 that leaves its own rotary
embedding's ``inv_freq`` buffer uninitialised (measured: -2.1e7 where 1.0 belongs), a
SpecForge/transformers mismatch, not a property of the checkpoint.

Skipped where SpecForge is not installed; an installed one that fails to import fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import LlamaConfig

from headway.heads.format_eagle3 import export_eagle3
from headway.heads.io import save_heads
from headway.target import Target, fingerprint
from tests.engine_drafts import (
    SHIPPED,
    STEPS,
    assert_same_drafts,
    assert_same_tensors,
    next_step_ids,
    question_ids,
    shipped_draft,
    tiny_ids,
)
from tests.installed import installed_modules
from tests.test_eagle3 import target_and_truth, trained

(llama3_eagle,) = installed_modules("specforge", "specforge.modeling.draft.llama3_eagle")


def _their_model(folder: Path, embedding: Tensor) -> Any:
    """SpecForge's ``LlamaForCausalLMEagle3`` for ``folder``, fp32, sdpa attention; the
    target's ``embedding`` stands in for the ``embed_tokens`` the export leaves out (SGLang
    shares the target's). Every tensor of the export must be one of its parameters."""
    model = llama3_eagle.LlamaForCausalLMEagle3(
        LlamaConfig.from_pretrained(str(folder)), attention_backend="sdpa"
    )
    missing, unexpected = model.load_state_dict(
        load_file(str(folder / "model.safetensors")), strict=False
    )
    assert (missing, unexpected) == (["embed_tokens.weight"], [])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embedding)
    return model.float().eval()


def _drafts_of(model: Any) -> Any:
    """SpecForge's training step (``project_hidden_states``, then per step ``backbone`` over
    its ``cache_hidden`` and ``compute_logits``) as the comparison's ``theirs``."""

    def drafts(features: Tensor, next_ids: Tensor) -> list[Tensor]:
        length = next_ids.shape[1]
        cache: list[list[Tensor]] = [[], []]
        steps, ids = [], next_ids
        with torch.no_grad():
            states = model.project_hidden_states(features)
            mask = model.prepare_decoder_attention_mask(
                torch.ones(1, length, dtype=torch.bool), states, 1, length, 0
            )
            for _ in range(STEPS):
                states = model.backbone(
                    input_embeds=model.embed_input_ids(ids),
                    hidden_states=states,
                    cache_hidden=cache,
                    attention_mask=mask,
                    position_ids=torch.arange(length)[None],
                    use_cache=False,
                )
                steps.append(model.compute_logits(states).argmax(-1))
                ids = next_step_ids(ids)
        return steps

    return drafts


def test_specforge_reads_the_eagle3_hf_export(tmp_path: Path) -> None:
    model, _ = target_and_truth("llama")
    draft = trained("llama")
    run = save_heads(
        tmp_path / "run",
        method="eagle3",
        head_config=draft.config.to_dict(),
        state_dict=draft.state_dict(),
        target_fingerprint=fingerprint(model),
        target_name="org/tiny-llama",
    )
    export = export_eagle3(run, tmp_path / "export")
    theirs = _their_model(export, model.get_input_embeddings().weight)
    assert theirs.draft_vocab_size == draft.config.draft_vocab_size
    assert_same_tensors(theirs.state_dict(), draft, "midlayer.")
    assert_same_drafts(_drafts_of(theirs), draft, model, tiny_ids())


@pytest.mark.slow  # loads SmolLM2
def test_specforge_reads_the_shipped_drafter(smollm2: Target) -> None:
    """The shipped binary (bf16) in fp32 on SmolLM2's features for a real question."""
    draft = shipped_draft()
    embedding = smollm2.model.get_input_embeddings().weight
    assert isinstance(embedding, Tensor)
    theirs = _their_model(SHIPPED, embedding)
    assert_same_tensors(theirs.state_dict(), draft.to(torch.bfloat16).float(), "midlayer.")
    assert_same_drafts(_drafts_of(theirs), draft, smollm2.model, question_ids(smollm2.tokenizer))
