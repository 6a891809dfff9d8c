"""``headway export`` converts between layouts: a headway export in one engine layout (the
shipped drafter's ``eagle3-hf``, a Medusa reference folder) is written in another with the same
tensors, target and feature layers; folders published by others, which record no target,
convert for the target ``--target`` names (its fingerprint recorded, their sizes checked) and
are refused in one line without it; a Medusa-2 export converts only from its run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.heads.format_eagle3 import export_eagle3, import_eagle3
from headway.heads.format_medusa import export_medusa, import_medusa
from headway.heads.format_speculators import import_speculators
from headway.heads.io import HeadsError, load_heads, save_heads
from headway.heads.loading import heads_to_export
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.target import TargetFingerprint, fingerprint
from tests.engine_drafts import SHIPPED
from tests.test_eagle3 import tiny4
from tests.test_formats import random_run
from tests.tokenizers_fixture import smollm2_tokenizer


def _export(source: Path, layout: str, out: Path) -> Path:
    assert main(["export", str(source), "--format", layout, "--out", str(out)]) == 0
    return out


def _same_tensors(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert sorted(first) == sorted(second)
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def test_the_shipped_drafter_converts_to_speculators_and_back(tmp_path: Path) -> None:
    shipped = import_eagle3(SHIPPED)
    native = _export(SHIPPED, "speculators", tmp_path / "speculators")
    config = json.loads((native / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    converted = import_speculators(native)
    assert converted.fingerprint == shipped.fingerprint
    assert converted.config == shipped.config
    _same_tensors(converted.state_dict, shipped.state_dict)

    back = import_eagle3(_export(native, "eagle3-hf", tmp_path / "eagle3-hf"))
    assert (back.config, back.fingerprint, back.target_name) == (
        shipped.config,
        shipped.fingerprint,
        shipped.target_name,
    )
    _same_tensors(back.state_dict, shipped.state_dict)


STAMP = TargetFingerprint("LlamaForCausalLM", 8, 12, 2, "0" * 64)


def _medusa_run(directory: Path, method: str) -> Path:
    torch.manual_seed(0)
    config = MedusaConfig(num_heads=2, num_layers=1, hidden_size=8, vocab_size=12)
    return save_heads(
        directory,
        method=method,
        head_config=config.to_dict(),
        state_dict=MedusaHeads(config, torch.randn(12, 8)).state_dict(),
        target_fingerprint=STAMP,
        target_name="org/tiny-base",
    )


def test_a_converted_export_reads_as_its_run_did(tmp_path: Path) -> None:
    """A run exported as Medusa's reference layout, converted to vLLM's: the same heads,
    target and name as the run (the converter reads the layout as a run directory)."""
    run = _medusa_run(tmp_path / "run", "medusa1")
    reference = export_medusa(run, tmp_path / "reference")
    read = heads_to_export(reference)
    original = load_heads(run)
    assert (read.method, read.fingerprint, read.target_name) == ("medusa1", STAMP, "org/tiny-base")
    assert read.head_config == original.head_config
    _same_tensors(read.state_dict, original.state_dict)
    vllm = import_medusa(_export(reference, "medusa-vllm", tmp_path / "vllm"))
    _same_tensors(vllm.state_dict, original.state_dict)


def test_medusa2_heads_are_converted_from_their_run_only(tmp_path: Path) -> None:
    """A Medusa-2 export's heads fit the target with the run's adapter merged in, not the
    target it records: converting the export would stamp them with the wrong one."""
    export = export_medusa(_medusa_run(tmp_path / "run", "medusa2"), tmp_path / "reference")
    with pytest.raises(HeadsError, match="export from the run directory instead"):
        heads_to_export(export)


def test_heads_published_by_others_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    foreign = _published(SHIPPED, tmp_path / "foreign")
    with pytest.raises(HeadsError, match="record no target"):
        heads_to_export(foreign)
    command = ["export", str(foreign), "--format", "speculators", "--out", str(tmp_path / "out")]
    assert main(command) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "eagle3-hf heads that record no target" in error
    assert "--target" in error
    assert not (tmp_path / "out").exists()


def _published(export: Path, out: Path) -> Path:
    """``export`` as a drafter published elsewhere: no ``headway`` block in its config."""
    shutil.copytree(export, out)
    config = json.loads((out / "config.json").read_text())
    del config["headway"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_heads_published_by_others_convert_for_the_target_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--target``: the target a published drafter was trained for is loaded for its
    fingerprint, which the export records, and its sizes, which the heads must fit."""
    tokenizer = smollm2_tokenizer()
    model = tiny4("llama", vocab_size=len(tokenizer))
    folder = tmp_path / "tiny-target"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    run = random_run(tmp_path / "run", "eagle3", model)
    published = _published(export_eagle3(run, tmp_path / "export"), tmp_path / "published")
    out = _export_for(published, folder, tmp_path / "speculators")
    converted = import_speculators(out)
    assert converted.fingerprint == fingerprint(model)
    _same_tensors(converted.state_dict, load_heads(run).state_dict)
    shipped = _published(SHIPPED, tmp_path / "shipped")  # SmolLM2's sizes, not the tiny one's
    command = ["export", str(shipped), "--format", "speculators", "--out", str(tmp_path / "no")]
    assert main([*command, "--target", str(folder)]) == 2
    fits = f"do not fit a target of vocabulary {len(tokenizer)} and hidden size 32"
    assert fits in capsys.readouterr().err


def _export_for(source: Path, target: Path, out: Path) -> Path:
    command = ["export", str(source), "--format", "speculators", "--out", str(out)]
    assert main([*command, "--target", str(target)]) == 0
    return out
