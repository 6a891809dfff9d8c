"""speculators itself loads headway's EAGLE-3 exports and drafts what headway drafts.

``speculators`` (PyPI, the library whose checkpoint format vLLM serves natively) is installed by
``make setup`` without its dependencies (it pins transformers <= 5.19; its EAGLE-3 model and
converter run on the transformers headway installs). These tests hand headway's exports to its
own loader (``Eagle3DraftModel.from_pretrained``) and converter (``Eagle3Converter``, which turns
EAGLE research-layout checkpoints, the layout of ``--format eagle3-hf``, into speculators ones),
then compare every tensor and three draft steps at every position of a sequence
(:mod:`tests.engine_drafts`) with headway's own :class:`~headway.heads.eagle3.Eagle3Model`. That
checks the wiring no name schema can: fc over the three feature slices (and EAGLE-3.1's
``fc_norm`` / ``norm_output``), the norms of the first layer, RoPE, the LM head, the vocabulary
maps and what one step hands the next. The shipped drafter is converted and compared on
SmolLM2's real features; the checkpoint speculators' converter writes reads back into headway
and decodes losslessly.

Skipped where speculators is not installed; an installed one that fails to import fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.cli import main
from headway.decode.generate import generate
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.format_eagle3 import export_eagle3
from headway.heads.format_speculators import export_speculators, import_speculators
from headway.heads.io import save_heads
from headway.heads.vocab import DraftVocab
from headway.target import Target, fingerprint, hub_id, resolve_target_path
from tests.drafting import heads_drafter
from tests.engine_drafts import (
    SHIPPED,
    STEPS,
    assert_same_drafts,
    assert_same_tensors,
    question_ids,
    shipped_draft,
    tiny_ids,
)
from tests.installed import installed_modules
from tests.test_eagle3 import PROMPT, TINY_VOCAB, TREE, target_and_truth, trained

core, converter = installed_modules(
    "speculators", "speculators.models.eagle3", "speculators.convert.eagle.eagle3_converter"
)


def _their_model(folder: Path) -> Any:
    """speculators' ``Eagle3DraftModel`` from ``folder``, fp32, eager attention (its default,
    flex attention, runs uncompiled on a CPU). The target's embedding is loaded from the
    verifier explicitly: headway's exports leave ``embed_tokens`` out, as vLLM shares the
    target's, and speculators' loader takes an embedding still NaN for a missing one, a sentinel
    that transformers 5.24 does not always leave (1 of 3 loads kept uninitialised memory)."""
    config = core.Eagle3SpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    model = core.Eagle3DraftModel.from_pretrained(str(folder), config=config)
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model.float().eval()


def _drafts_of(model: Any) -> Any:
    """speculators' own test-time-training loop as the comparison's ``theirs``."""

    def drafts(features: Tensor, next_ids: Tensor) -> list[Tensor]:
        with torch.no_grad():
            steps: list[Tensor] = model(
                hidden_states=features,
                input_ids=next_ids,
                document_ids=torch.zeros_like(next_ids),
                ttt_steps=STEPS,
            )
        return steps

    return drafts


def _same(theirs: Any, draft: Eagle3Model, model: Any, ids: Tensor) -> None:
    assert_same_tensors(theirs.state_dict(), draft, "layers.0.")
    assert_same_drafts(_drafts_of(theirs), draft, model, ids)


def _eagle31(model: Any) -> Eagle3Model:
    """A random EAGLE-3.1 draft (fc_norm, norm_output) over 48 scattered target ids, its norm
    weights moved off one so a norm wired to the wrong input shows."""
    torch.manual_seed(3)
    ids = torch.randperm(TINY_VOCAB)[:48].sort().values
    config = Eagle3Config.from_target(model, draft_vocab_size=48, fc_norm=True, norm_output=True)
    draft = Eagle3Model(config, attn_implementation="sdpa")
    draft.set_vocab(DraftVocab.from_target_ids(ids, TINY_VOCAB))
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return draft.eval()


def _saved(family: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The tiny target of ``family`` and its saved folder (what exports name as the verifier)."""
    model, _ = target_and_truth(family)
    folder = tmp_path_factory.mktemp(f"verifier-{family}")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The tiny Llama target and its saved folder."""
    return _saved("llama", tmp_path_factory)


def _run(draft: Eagle3Model, model: Any, folder: Path, out: Path) -> Path:
    return save_heads(
        out,
        method="eagle3",
        head_config=draft.config.to_dict(),
        state_dict=draft.state_dict(),
        target_fingerprint=fingerprint(model),
        target_name=str(folder),
    )


@pytest.mark.parametrize("variant", ["trained", "eagle3.1"])
def test_speculators_loads_the_speculators_export(
    variant: str, verifier: tuple[Any, Path], tmp_path: Path
) -> None:
    model, folder = verifier
    draft = trained("llama") if variant == "trained" else _eagle31(model)
    out = export_speculators(_run(draft, model, folder, tmp_path / "run"), tmp_path / "export")
    theirs = _their_model(out)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == list(draft.config.feature_layers)
    assert theirs.config.draft_vocab_size == draft.config.draft_vocab_size
    assert (theirs.config.fc_norm, theirs.config.norm_output) == (
        draft.config.fc_norm,
        draft.config.norm_output,
    )
    _same(theirs, draft, model, tiny_ids())


def test_speculators_loads_an_export_for_a_qwen2_target(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The draft layer is a Llama layer whatever the target (Qwen2's attention biases stay in
    the target): speculators reads the target's layer count and embedding from the verifier
    folder and drafts as headway does on that target's states. (GPT-2 targets cannot be tried:
    speculators' loader looks for ``embed_tokens.weight`` in the verifier, which GPT-2 names
    ``transformer.wte.weight``.)"""
    model, folder = _saved("qwen2", tmp_path_factory)
    draft = trained("qwen2")
    out = export_speculators(_run(draft, model, folder, tmp_path / "run"), tmp_path / "export")
    theirs = _their_model(out)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == list(draft.config.feature_layers)
    _same(theirs, draft, model, tiny_ids("qwen2"))


def test_speculators_converts_the_eagle3_hf_export(
    verifier: tuple[Any, Path], tmp_path: Path
) -> None:
    model, folder = verifier
    draft = trained("llama")
    export = export_eagle3(_run(draft, model, folder, tmp_path / "run"), tmp_path / "export")
    converter.Eagle3Converter().convert(
        export,
        tmp_path / "converted",
        str(folder),
        validate=False,
        eagle_aux_hidden_state_layer_ids=list(draft.config.feature_layers),
    )
    _same(_their_model(tmp_path / "converted"), draft, model, tiny_ids())
    # and back: the checkpoint speculators wrote (no headway block) reads and decodes in headway
    read = import_speculators(tmp_path / "converted")
    assert read.fingerprint is None and read.config == draft.config
    assert_same_tensors(read.state_dict, draft, "midlayer.")
    truth = target_and_truth("llama")[1]
    drafter = heads_drafter(tmp_path / "converted", model, **TREE)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=len(truth), eos_token_ids=())
    assert result.tokens == truth


@pytest.mark.slow  # loads SmolLM2
def test_the_shipped_drafter_converts_and_drafts_as_headway_does(
    smollm2: Target, tmp_path: Path
) -> None:
    """The shipped binary (eagle3-hf, bf16) through speculators' converter with SmolLM2 as the
    verifier and speculators' default feature layers ([2, 15, 27] for 30 layers, the ones
    headway trained on), on a real question's features, in fp32."""
    draft = shipped_draft()
    converter.Eagle3Converter().convert(
        SHIPPED, tmp_path / "converted", str(resolve_target_path("smollm2-135m")), validate=False
    )
    theirs = _their_model(tmp_path / "converted")
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    assert list(draft.config.feature_layers) == [2, 15, 27]
    _same(theirs, draft, smollm2.model, question_ids(smollm2.tokenizer))


@pytest.mark.slow  # loads SmolLM2
def test_the_shipped_drafter_exported_as_speculators_loads_there(
    smollm2: Target, tmp_path: Path
) -> None:
    """``headway export drafters/smollm2-135m-eagle3 --format speculators``, its verifier
    pointed at the local SmolLM2 folder (the export names the hub id, which vLLM downloads and
    this machine cannot), read by speculators' own loader."""
    out = tmp_path / "speculators"
    assert main(["export", str(SHIPPED), "--format", "speculators", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == hub_id("smollm2-135m")
    config["speculators_config"]["verifier"]["name_or_path"] = str(
        resolve_target_path("smollm2-135m")
    )
    (out / "config.json").write_text(json.dumps(config))
    _same(_their_model(out), shipped_draft(), smollm2.model, question_ids(smollm2.tokenizer))
