"""A target's fingerprint read from its files, without loading the model.

``headway export --target NAME`` needs only the fingerprint of the target a published drafter
was trained for (:func:`headway.target.fingerprint`: architecture, sizes and a hash of the output
embedding). Loading the model for it holds every weight (16 GB for an 8B target in bf16); this
reads the config and the one tensor of the output embedding from the safetensors files (1 GB
there), found by the name the model gives its output embedding, built on the meta device (no
memory). Where the files cannot say (weights not in safetensors, a checkpoint whose tensor names
differ from the model's, a model without an output embedding) it answers None and the caller
loads the model as before. ``tests/test_target_files.py`` holds it equal to the loaded model's
fingerprint for tied and untied heads, one file or shards.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from headway.target import TargetFingerprint, fingerprint, resolve_target_path

__all__ = ["fingerprint_from_files"]

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"


def fingerprint_from_files(
    name_or_path: str | Path, *, trust_remote_code: bool = False
) -> TargetFingerprint | None:
    """The fingerprint :func:`~headway.target.fingerprint` gives the target ``name_or_path``
    (a folder, a model id in the local HF cache, a ``.gguf`` file or the embedded target),
    read from its config and output-embedding tensor only; None where the files cannot say
    (module docstring).

    Raises:
        TargetError: the target cannot be found offline (as :func:`~headway.target.load_target`).
    """
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = _folder(resolve_target_path(name_or_path))
    if folder is None:
        return None
    options = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(folder, **options)
        with torch.device("meta"):  # shapes and names only: no weight is allocated
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as error:
        logger.info("%s: no model built from its config (%s); loading it", folder, error)
        return None
    head = model.get_output_embeddings()
    if head is None:
        return None
    names = [
        name
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if parameter is head.weight
    ]  # a tied head answers to the input embedding's name too, which the checkpoint keeps
    try:
        files = _tensor_files(folder)
        stored = next((name for name in names if name in files), None)
        if stored is None:
            logger.info("%s: none of %s in its safetensors; loading the model", folder, names)
            return None
        with safe_open(str(files[stored]), framework="pt") as handle:
            weight = handle.get_tensor(stored)
    except (OSError, ValueError, SafetensorError) as error:  # loading reports it in one line
        logger.info("%s: its safetensors did not read (%s); loading the model", folder, error)
        return None
    return fingerprint(model, weight)


def _folder(source: Path | str) -> Path | None:
    """The folder holding a resolved target's files: itself, or a hub id's snapshot in the
    local HF cache (None if it is not there)."""
    if isinstance(source, Path):
        return source
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except (OSError, ValueError) as error:  # not in the cache, or not a valid id: load it
        logger.info("%s: no local snapshot (%s); loading the model", source, error)
        return None


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of the folder's safetensors checkpoint -> the file holding it (from the
    shards' index where there is one); empty where there is no safetensors file."""
    from safetensors import safe_open

    index = folder / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: folder / str(file) for name, file in weight_map.items()}
    files: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), path))
    return files
