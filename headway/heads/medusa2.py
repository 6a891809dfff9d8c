"""Medusa-2's LoRA adapter: how a run stores it and how decoding merges it into the target.

Medusa-2 (Cai et al. 2024, "Medusa", arXiv:2401.10774, §2.2.2) fine-tunes the target jointly with
its heads, through a LoRA adapter kept close to the original by self-distillation. The heads then
fit the *adapted* target, and the adapted target is the model that speaks: its outputs differ
from the original's (within the KL it was trained under). A run directory therefore holds, beside
the heads of :mod:`headway.heads.io` (``config.json`` with ``"method": "medusa2"`` and
``model.safetensors``), the adapter as a standard PEFT folder::

    adapter/adapter_config.json        peft LoraConfig (r, lora_alpha, target_modules, ...)
    adapter/adapter_model.safetensors  lora_A / lora_B weights, PEFT key names; its metadata
                                       ``heads_weights_id`` names the heads it was saved with

so ``peft.PeftModel.from_pretrained(base, RUN/adapter)`` loads it too. The adapter is written after
the heads (staged, then moved into place), naming their ``weights_id``: a save killed between the
two, or folders copied from two runs, is refused on load instead of pairing heads with another
adapter.

Decoding (:func:`merge_adapter`, called by :func:`headway.heads.io.load_drafter` for ``medusa2``
runs, after the fingerprint check against the *base* target) merges ``W += (alpha / r) · B A``
into the given target **in place** (peft ``merge_and_unload``: afterwards the model has its stock
modules again, no LoRA layers). From then on that target object is the merged model: the
drafter's verifier decodes with it, and so must any plain-decoding baseline, or the outputs would
be compared against a different model. The merge is recorded in ``model.config`` (attribute
``headway_merged_adapter`` = the heads' ``weights_id``), so loading the same run again is a no-op
and loading another Medusa-2 run onto an already merged target is refused.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor
from transformers import PreTrainedModel

from headway.heads.io import (
    CONFIG_NAME,
    HeadsError,
    check_tensors,
    read_safetensors,
    staged_directory,
    write_safetensors,
)

if TYPE_CHECKING:  # peft is imported where it is used: decoding without Medusa-2 never needs it
    from peft import LoraConfig, PeftModel

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS",
    "MERGED_ATTRIBUTE",
    "add_lora",
    "heads_weights_id",
    "merge_adapter",
    "read_adapter",
    "set_adapter_weights",
    "write_adapter",
]

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"  # peft's names, so peft loads the folder as it is
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PAIRING_KEY = "heads_weights_id"
MERGED_ATTRIBUTE = "headway_merged_adapter"


@contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft 0.21 asks transformers 5 a deprecated question on every wrap; hide only that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def add_lora(model: PreTrainedModel, config: LoraConfig) -> PeftModel:
    """Wrap ``model`` in LoRA adapters *in place* (peft injects them into its modules): the base
    weights are frozen, only ``lora_A`` / ``lora_B`` require grad, and ``lora_B`` starts at zero
    so the adapted model equals the original until it is trained."""
    from peft import PeftModel, get_peft_model

    with _quiet_peft():
        peft_model = get_peft_model(model, config)
    if not isinstance(peft_model, PeftModel):  # get_peft_model(mixed=True) returns another type
        raise TypeError(f"expected a PeftModel, got {type(peft_model).__name__}")
    return peft_model


def heads_weights_id(run_dir: Path) -> str:
    """The ``weights_id`` of the heads saved in ``run_dir`` (its ``config.json``)."""
    path = Path(run_dir) / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        return str(config["weights_id"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise HeadsError(
            f"{path}: cannot read the heads' weights_id ({error}); save the heads first"
        ) from error


def write_adapter(
    run_dir: Path, state_dict: Mapping[str, Tensor], config: LoraConfig, *, weights_id: str
) -> Path:
    """Write ``RUN/adapter/`` (see the module docstring) atomically; returns the folder.

    Args:
        state_dict: peft's adapter state dict (``get_peft_model_state_dict``), PEFT key names.
        config: the adapter's :class:`~peft.LoraConfig`.
        weights_id: the ``weights_id`` of the heads saved beside it (:func:`heads_weights_id`).
    """
    folder = Path(run_dir) / ADAPTER_DIR
    with staged_directory(folder) as staging:
        write_safetensors(
            staging / ADAPTER_WEIGHTS, dict(state_dict), {"format": "pt", PAIRING_KEY: weights_id}
        )
        config.save_pretrained(str(staging))
    return folder


def read_adapter(run_dir: Path, weights_id: str) -> tuple[LoraConfig, dict[str, Tensor]]:
    """The adapter config and weights of a Medusa-2 run (never unpickled, never downloaded).

    Raises:
        HeadsError: the folder or a file is missing or corrupt, or the adapter was not saved with
            the heads whose ``weights_id`` is given.
    """
    from peft import LoraConfig

    folder = Path(run_dir) / ADAPTER_DIR
    if not (folder / ADAPTER_CONFIG).is_file():
        raise HeadsError(
            f"{run_dir} is a medusa2 run without {ADAPTER_DIR}/{ADAPTER_CONFIG}: its heads need "
            "the LoRA adapter they were trained with (an interrupted save, or a copy that left "
            f"{ADAPTER_DIR}/ behind); copy the whole run directory or train again"
        )
    tensors, metadata = read_safetensors(folder / ADAPTER_WEIGHTS)
    if metadata.get(PAIRING_KEY) != weights_id:
        raise HeadsError(
            f"{folder} was not saved with the heads in {run_dir} (an interrupted save, or folders "
            "copied from two runs); re-save the run"
        )
    try:
        config = LoraConfig.from_pretrained(str(folder))  # the file exists: no hub lookup
    except (OSError, ValueError, TypeError) as error:
        raise HeadsError(f"{folder / ADAPTER_CONFIG} is not a LoRA config: {error}") from error
    return config, tensors


def set_adapter_weights(
    peft_model: PeftModel, tensors: Mapping[str, Tensor], run_dir: Path
) -> None:
    """Load ``tensors`` (read from ``run_dir``'s adapter) into ``peft_model``'s LoRA layers.

    Raises:
        HeadsError: missing, unexpected or mis-shaped tensors (another ``lora_r`` or other
            target modules than the model was wrapped with).
    """
    from peft import get_peft_model_state_dict
    from peft.utils import set_peft_model_state_dict

    fresh = get_peft_model_state_dict(peft_model)
    expected = {name: tuple(tensor.shape) for name, tensor in fresh.items()}
    check_tensors(tensors, expected, Path(run_dir) / ADAPTER_DIR / ADAPTER_WEIGHTS)
    set_peft_model_state_dict(peft_model, dict(tensors))


def merge_adapter(run_dir: str | Path, model: PreTrainedModel) -> None:
    """Merge the LoRA adapter of Medusa-2 run ``run_dir`` into ``model`` in place (module
    docstring); a no-op if this run's adapter is merged already.

    Raises:
        HeadsError: see :func:`read_adapter`; the adapter does not fit ``model``; ``model``
            already carries another run's merged adapter. On error ``model`` is left unchanged.
    """
    run_dir = Path(run_dir)
    weights_id = heads_weights_id(run_dir)
    merged = getattr(model.config, MERGED_ATTRIBUTE, None)
    if merged == weights_id:
        logger.debug("the Medusa-2 adapter of %s is already merged into the target", run_dir)
        return
    if merged is not None:
        raise HeadsError(
            f"this target already carries the merged adapter of another Medusa-2 run "
            f"(weights_id {merged}); load the target again before using {run_dir}"
        )
    config, tensors = read_adapter(run_dir, weights_id)
    try:
        peft_model = add_lora(model, config)
    except (ValueError, TypeError) as error:
        raise HeadsError(f"{run_dir / ADAPTER_DIR} does not fit this target: {error}") from error
    try:
        set_adapter_weights(peft_model, tensors, run_dir)
    except BaseException:
        peft_model.unload()  # the stock modules back, weights untouched
        raise
    peft_model.merge_and_unload()
    setattr(model.config, MERGED_ATTRIBUTE, weights_id)
    logger.info(
        "merged the Medusa-2 LoRA adapter of %s into the target (r=%s, %s): tree verification "
        "and any plain-decoding baseline on this target now use the merged weights",
        run_dir,
        config.r,
        ",".join(sorted(config.target_modules or [])),
    )
