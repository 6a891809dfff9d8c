"""A target's fingerprint read from its files (``headway/target_files.py``) is the loaded model's:
tied and untied output embeddings, one safetensors file or shards with an index, fp32 or bf16
on disk; where the files cannot say (no safetensors, other tensor names, a broken index) it
answers None, and ``headway export --target`` then loads the model, which it otherwise does
not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.heads.format_eagle3 import export_eagle3
from headway.heads.format_speculators import import_speculators
from headway.target import fingerprint, load_target
from headway.target_files import fingerprint_from_files
from tests.test_eagle3 import tiny4
from tests.test_export_convert import _published
from tests.test_formats import random_run
from tests.tiny import TINY_FAMILIES
from tests.tokenizers_fixture import smollm2_tokenizer


def _saved(folder: Path, family: str, **save: object) -> Path:
    """A tiny ``family`` target saved to ``folder`` with its tokenizer (``save``:
    ``save_pretrained``'s options)."""
    tokenizer = smollm2_tokenizer()
    model = tiny4(family, vocab_size=len(tokenizer))
    model.save_pretrained(folder, **save)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", TINY_FAMILIES)  # llama's head is untied, the others' tied
@pytest.mark.parametrize("shards", [False, True])
def test_the_fingerprint_from_files_is_the_loaded_models(
    tmp_path: Path, family: str, shards: bool
) -> None:
    folder = _saved(tmp_path / family, family, **({"max_shard_size": "20KB"} if shards else {}))
    assert (folder / "model.safetensors.index.json").is_file() == shards
    loaded = fingerprint(load_target(folder, dtype="bfloat16", device="cpu").model)
    assert fingerprint_from_files(folder) == loaded
    assert fingerprint(load_target(folder, device="cpu").model) == loaded  # fp32: the same


def test_a_bf16_checkpoint_gives_the_same_fingerprint(tmp_path: Path) -> None:
    tokenizer = smollm2_tokenizer()
    model = tiny4("llama", vocab_size=len(tokenizer)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert fingerprint_from_files(tmp_path) == fingerprint(load_target(tmp_path).model)


def test_files_that_cannot_say_answer_none(tmp_path: Path) -> None:
    renamed = _saved(tmp_path / "renamed", "llama")
    from safetensors.torch import load_file, save_file

    tensors = load_file(renamed / "model.safetensors")
    tensors["head.weight"] = tensors.pop("lm_head.weight")  # not the model's name for it
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    assert fingerprint_from_files(renamed) is None

    broken = _saved(tmp_path / "broken", "llama", max_shard_size="20KB")
    (broken / "model.safetensors.index.json").write_text("{not json")
    assert fingerprint_from_files(broken) is None

    pickled = _saved(tmp_path / "pickled", "llama")  # weights as pytorch_model.bin only
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    assert fingerprint_from_files(pickled) is None


def test_export_target_reads_the_fingerprint_without_loading_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _saved(tmp_path / "target", "qwen2")
    expected = fingerprint(load_target(folder).model)
    run = random_run(tmp_path / "run", "eagle3", load_target(folder).model)
    published = _published(export_eagle3(run, tmp_path / "export"), tmp_path / "published")

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr("headway.target.load_target", refused)
    out = tmp_path / "speculators"
    command = ["export", str(published), "--format", "speculators", "--out", str(out)]
    assert main([*command, "--target", str(folder)]) == 0
    assert import_speculators(out).fingerprint == expected
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(folder)


def test_a_model_id_is_read_from_its_snapshot_in_the_hf_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = _saved(repo / "snapshots" / ("0" * 40), "gpt2")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert fingerprint_from_files("org/tiny") == fingerprint(load_target(snapshot).model)
    assert fingerprint_from_files("org/absent") is None  # export then loads it, and says why
