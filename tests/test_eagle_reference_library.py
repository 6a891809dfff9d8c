"""The EAGLE reference code reads headway's ``eagle1`` export and predicts what headway predicts.

``eagle-llm`` (PyPI, SafeAILab's EAGLE-1/2 package) is installed by ``make setup`` without its
dependencies (it pins accelerate 0.21, gradio and an old protobuf). Its draft model
``eagle.model.cnets.Model`` is built from the export's ``config.json`` (its ``EConfig``) and the
export's tensors loaded by name; on the tiny Llama's states it must predict the features
headway's :class:`~headway.heads.eagle.EagleModel` predicts, and so the same next tokens through
the target's LM head, at every position: fc over (embedding, feature) in that order, the first
layer without an input norm, biases, attention and MLP.

Two properties of that code, written here so they are not mistaken for the export's: it reads
``rope_scaling`` as a dict with a ``type`` key (transformers 5 fills ``{"rope_type":
"default"}`` for none, so the test sets it back to ``None``), and its attention always uses
RoPE base 10000 and ``head_dim = hidden_size // num_attention_heads`` whatever the config says,
so for a target with another base (SmolLM2: 100000, Llama 3: 500000) its drafts differ from
headway's, vLLM's and SGLang's (docs/usage.md).

Skipped where eagle-llm is not installed; an installed one that fails to import fails.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from headway.heads.format_eagle1 import export_eagle1
from tests.installed import installed_modules
from tests.test_eagle_drafter import PROMPT, fit_drafter, hf_greedy, last_features, save_run
from tests.tiny import tiny_model

cnets, configs = installed_modules("eagle-llm", "eagle.model.cnets", "eagle.model.configs")


def test_the_reference_model_reads_the_eagle1_export(tmp_path: Path) -> None:
    target = tiny_model("llama")
    assert target.config.rope_parameters["rope_theta"] == 10000.0  # the reference code's base
    ids = torch.cat([PROMPT, torch.tensor(hf_greedy(target, PROMPT, 24, eos=None))])[None]
    draft = fit_drafter(target, ids, steps=120).eval()
    export = export_eagle1(save_run(tmp_path / "run", target, draft), tmp_path / "export")

    config = configs.EConfig.from_pretrained(str(export))
    assert config.rope_scaling in (None, {"rope_theta": 10000.0, "rope_type": "default"})
    config.rope_scaling = None
    theirs = cnets.Model(config, load_emb=False, bias=True)
    missing, unexpected = theirs.load_state_dict(
        load_file(str(export / "model.safetensors")), strict=False
    )
    assert (missing, unexpected) == (["embed_tokens.weight"], [])
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    theirs = theirs.float().eval()

    features, next_ids = last_features(target, ids)[:, :-1], ids[:, 1:]
    with torch.no_grad():
        predicted = theirs(features, next_ids)
        ours = draft(features, target.get_input_embeddings()(next_ids))
        assert torch.allclose(predicted, ours, atol=1e-5, rtol=1e-5)
        assert torch.equal(target.lm_head(predicted).argmax(-1), target.lm_head(ours).argmax(-1))
