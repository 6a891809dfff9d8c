"""speculators itself loads headway's EAGLE-3 exports and drafts what headway drafts.

``speculators`` (PyPI, the library whose checkpoint format vLLM serves natively) is installed by
``make setup`` without its dependencies (it pins transformers <= 5.19; its EAGLE-3 model and
converter run on the transformers headway installs). These tests hand headway's exports to its
own loader (``Eagle3DraftModel.from_pretrained``) and converter (``Eagle3Converter``, which turns
EAGLE research-layout checkpoints, the layout of ``--format eagle3-hf``, into speculators ones),
then compare every tensor and the first draft step (the argmax at every position of a sequence,
in draft-vocabulary ids) with headway's own :class:`~headway.heads.eagle3.Eagle3Model`. That
checks the wiring no name schema can: fc over the three feature slices (and EAGLE-3.1's
``fc_norm`` / ``norm_output``), the norms of the first layer, RoPE, the LM head and the
vocabulary maps. The shipped drafter is converted and compared on SmolLM2's real features.

Skipped where speculators is not installed; an installed one that fails to import fails.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.format_eagle3 import export_eagle3, import_eagle3
from headway.heads.format_speculators import export_speculators
from headway.heads.io import save_heads
from headway.heads.vocab import DraftVocab
from headway.target import Target, fingerprint, resolve_target_path
from tests.test_eagle3 import PROMPT, TINY_VOCAB, target_and_truth, trained

try:
    metadata.version("speculators")
except metadata.PackageNotFoundError:
    pytest.skip("speculators is not installed (make setup installs it)", allow_module_level=True)
# Installed: a failing import is a failure, not a skip.
core = importlib.import_module("speculators.models.eagle3")
converter = importlib.import_module("speculators.convert.eagle.eagle3_converter")

SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-eagle3"


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


def _their_drafts(model: Any, features: Tensor, next_ids: Tensor) -> Tensor:
    """speculators' first draft step: ``features [1, T, 3H]`` (the target's states at t) and
    ``next_ids [1, T]`` (x_{t+1}) -> the draft-vocabulary argmax ``[1, T]``."""
    with torch.no_grad():
        drafts = model(
            hidden_states=features,
            input_ids=next_ids,
            document_ids=torch.zeros_like(next_ids),
            ttt_steps=1,
        )
    return drafts[0]


def _our_drafts(draft: Eagle3Model, features: Tensor, embeddings: Tensor) -> Tensor:
    """headway's first draft step on the same inputs (``embeddings`` of ``next_ids``)."""
    with torch.no_grad():
        return draft.logits(draft(draft.fuse(features), embeddings)).argmax(-1)


def _inputs(model: Any, ids: Tensor, layers: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """The target's features at ``layers`` for ``ids [1, L]`` (positions 0..L-2), the next ids
    and their embeddings."""
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[layer] for layer in layers], dim=-1)[:, :-1]
    next_ids = ids[:, 1:]
    return features, next_ids, model.get_input_embeddings()(next_ids)


def _tensors_equal(theirs: Any, draft: Eagle3Model) -> None:
    state = theirs.state_dict()
    for name, tensor in draft.state_dict().items():
        their_name = name.replace("midlayer.", "layers.0.")
        assert their_name in state, name
        assert torch.equal(state[their_name].to(tensor.dtype), tensor), name


def _same_first_drafts(theirs: Any, draft: Eagle3Model, model: Any) -> None:
    """Both models draft the same tokens at every position of the tiny target's prompt and
    greedy continuation."""
    _tensors_equal(theirs, draft)
    ids = torch.cat([PROMPT, torch.tensor(target_and_truth("llama")[1])])[None]
    features, next_ids, embeddings = _inputs(model, ids, draft.config.feature_layers)
    assert torch.equal(
        _their_drafts(theirs, features, next_ids), _our_drafts(draft, features, embeddings)
    )


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


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The tiny Llama target and its saved folder (what the exports name as the verifier)."""
    model, _ = target_and_truth("llama")
    folder = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(folder)
    return model, folder


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
    _same_first_drafts(theirs, draft, model)


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
    theirs = _their_model(tmp_path / "converted")
    _same_first_drafts(theirs, draft, model)


def test_the_shipped_drafter_converts_and_drafts_as_headway_does(
    smollm2: Target, tmp_path: Path
) -> None:
    """The shipped binary (eagle3-hf, bf16) through speculators' converter with SmolLM2 as the
    verifier and speculators' default feature layers ([2, 15, 27] for 30 layers, the ones
    headway trained on), on a real question's features, in fp32."""
    imported = import_eagle3(SHIPPED)
    draft = Eagle3Model(imported.config)
    draft.load_state_dict(imported.state_dict)
    draft = draft.float().eval()
    converter.Eagle3Converter().convert(
        SHIPPED, tmp_path / "converted", str(resolve_target_path("smollm2-135m")), validate=False
    )
    theirs = _their_model(tmp_path / "converted")
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    assert list(draft.config.feature_layers) == [2, 15, 27]
    _tensors_equal(theirs, draft.to(torch.bfloat16).float())
    text = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain what a hash table is, with an example in Python."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = smollm2.tokenizer(text, return_tensors="pt").input_ids
    features, next_ids, embeddings = _inputs(smollm2.model, ids, draft.config.feature_layers)
    ours, drafted = (
        _our_drafts(draft, features, embeddings),
        _their_drafts(theirs, features, next_ids),
    )
    assert ours.shape == drafted.shape and ours.numel() > 40
    assert torch.equal(drafted, ours)
