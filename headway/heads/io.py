"""The native run format: save and load trained heads, and turn them into a drafter.

A run directory holds::

    config.json         {"method": "medusa1", "headway_version": "0.1.0",
                         "head_config": {...}, "target": {fingerprint}, "target_name": "...",
                         "weights_id": "<uuid of the model.safetensors written with it>"}
    model.safetensors   the head weights only (never the target's)
    training_state/     optional, owned by the training loop (left untouched here)

Files are written into a staging folder beside the run directory and moved into place with
``rename``/``os.replace`` (atomic on one filesystem): a killed save leaves either the old files or
the new ones, never a half-written file. ``config.json`` moves last and names the ``weights_id``
stored in the safetensors metadata, so a kill between the two moves is detected on load instead
of pairing a config with weights from another save. Nothing is ever unpickled.

:data:`DRAFTER_METHODS` is the one registry of methods (``medusa1``, ``medusa2``, ``eagle1``,
``eagle3``), shared by training and loading: it says which tensors each method's weights hold.
Drafters are built from heads by :func:`headway.drafters.build.build_drafter`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import save_file
from torch import Tensor

from headway.atomic import remove_stale, temporary_name
from headway.errors import HeadwayError
from headway.heads.eagle import EagleConfig, eagle_tensor_shapes
from headway.heads.eagle3 import Eagle3Config, eagle3_tensor_shapes
from headway.heads.medusa import MedusaConfig, medusa_tensor_shapes
from headway.target import TargetFingerprint
from headway.version import __version__

__all__ = [
    "CONFIG_NAME",
    "DRAFTER_METHODS",
    "WEIGHTS_NAME",
    "HeadsError",
    "LoadedHeads",
    "MethodSpec",
    "check_tensors",
    "head_config_of",
    "load_heads",
    "read_safetensors",
    "save_heads",
    "staged_directory",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_CONFIG_KEYS = ("method", "headway_version", "head_config", "target", "target_name", "weights_id")


class HeadsError(HeadwayError):
    """Heads cannot be saved, loaded or exported (missing or corrupt files, unknown method,
    missing tensors, a head config that does not fit its weights)."""


@dataclass
class LoadedHeads:
    """Everything a run directory records (see the module docstring).

    Attributes:
        method: ``"medusa1"``, ``"medusa2"``, ... (a key of :data:`DRAFTER_METHODS`).
        head_config: the method's hyper-parameters, e.g. :meth:`MedusaConfig.to_dict`.
        state_dict: the head weights, on the CPU, in their saved dtype.
        fingerprint: the target the heads were trained for.
        target_name: how that target was named when training (a path, hub id or alias).
    """

    method: str
    head_config: dict[str, Any]
    state_dict: dict[str, Tensor]
    fingerprint: TargetFingerprint
    target_name: str


@dataclass(frozen=True)
class MethodSpec:
    """What the weights of one method must hold.

    Attributes:
        tensor_shapes: ``head_config -> {key: shape}``, every tensor the weights file must hold
            (raises ``ValueError`` for a bad config).
        family: ``"medusa"`` or ``"eagle"``: which drafter spec decodes with it.
    """

    tensor_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    family: str


def _medusa_shapes(head_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return medusa_tensor_shapes(MedusaConfig.from_dict(head_config))


def _eagle_shapes(head_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return eagle_tensor_shapes(EagleConfig.from_dict(head_config))


def _eagle3_shapes(head_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return eagle3_tensor_shapes(Eagle3Config.from_dict(head_config))


DRAFTER_METHODS: dict[str, MethodSpec] = {
    "medusa1": MethodSpec(_medusa_shapes, "medusa"),
    "medusa2": MethodSpec(_medusa_shapes, "medusa"),
    "eagle1": MethodSpec(_eagle_shapes, "eagle"),
    "eagle3": MethodSpec(_eagle3_shapes, "eagle"),
}
"""method name -> :class:`MethodSpec`. New drafter families add one entry."""


def head_config_of(loaded: LoadedHeads) -> MedusaConfig | EagleConfig | Eagle3Config:
    """The typed head config of a run directory's heads."""
    if loaded.method == "eagle1":
        return EagleConfig.from_dict(loaded.head_config)
    if loaded.method == "eagle3":
        return Eagle3Config.from_dict(loaded.head_config)
    return MedusaConfig.from_dict(loaded.head_config)


def _method_spec(method: str, where: Path) -> MethodSpec:
    if method not in DRAFTER_METHODS:
        raise HeadsError(
            f"{where}: unknown method {method!r}; headway {__version__} knows "
            f"{sorted(DRAFTER_METHODS)} (were these heads saved by a newer headway?)"
        )
    return DRAFTER_METHODS[method]


@contextmanager
def staged_directory(directory: str | Path) -> Iterator[Path]:
    """Yield an empty staging folder beside ``directory``; write files there. On success they move
    into ``directory``: the whole folder is renamed into place if ``directory`` does not exist,
    else each file is replaced (``os.replace``), ``config.json`` last. On an exception nothing
    moves and the staging folder is removed; staging folders of killed saves
    (``.NAME.saving-PID-*`` whose process is gone) are removed by the next save."""
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final, "saving")  # left by saves that were killed (SIGKILL cannot clean up)
    # mkdir (not mkdtemp, which makes it 0700) so the folder gets the usual permissions.
    staging = temporary_name(final, "saving")
    staging.mkdir()
    try:
        yield staging
        if not final.exists():
            staging.rename(final)
            return
        if not final.is_dir():
            raise HeadsError(f"{final} exists and is not a directory; choose another path")
        config_last = sorted(staging.iterdir(), key=lambda path: (path.name == CONFIG_NAME, path))
        for path in config_last:
            path.replace(final / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON and flush it to disk."""
    with path.open("w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_safetensors(
    path: Path, tensors: Mapping[str, Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Save ``tensors`` (detached, contiguous, CPU copies) to ``path`` and flush it to disk, with
    the permissions of any file the user writes (0644 under umask 022)."""
    cpu = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    save_file(cpu, str(path), metadata=metadata)
    # safetensors creates the file owner-only (0600): give it what any file the user writes gets.
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def with_dtype(loaded: LoadedHeads, dtype: torch.dtype) -> LoadedHeads:
    """``loaded`` with its floating-point tensors cast to ``dtype`` (integer ones untouched)."""
    cast = {
        name: tensor.to(dtype) if tensor.is_floating_point() else tensor
        for name, tensor in loaded.state_dict.items()
    }
    return dataclasses.replace(loaded, state_dict=cast)


def provenance(loaded: LoadedHeads) -> dict[str, Any]:
    """The ``"headway"`` block an export's ``config.json`` carries, so loading it back can check
    the target (engines ignore unknown keys)."""
    return {
        "method": loaded.method,
        "headway_version": __version__,
        "target": loaded.fingerprint.to_dict(),
        "target_name": loaded.target_name,
    }


def write_export(out: Path, tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> Path:
    """Write ``model.safetensors`` + ``config.json`` into `out` atomically; returns `out`."""
    with staged_directory(out) as staging:
        write_safetensors(staging / WEIGHTS_NAME, dict(tensors), {"format": "pt"})
        write_json(staging / CONFIG_NAME, config)
    return out


def save_heads(
    directory: str | Path,
    *,
    method: str,
    head_config: dict[str, Any],
    state_dict: Mapping[str, Tensor],
    target_fingerprint: TargetFingerprint,
    target_name: str,
) -> Path:
    """Write a run directory's ``config.json`` + ``model.safetensors`` atomically (see the module
    docstring); other entries such as ``training_state/`` are left as they are.

    Raises:
        HeadsError: for an unknown method, or weights that do not match ``head_config``.
    """
    final = Path(directory)
    spec = _method_spec(method, final)
    tensors = dict(state_dict)
    check_tensors(tensors, _shapes(spec, head_config, final), final)
    weights_id = uuid.uuid4().hex
    config = {
        "method": method,
        "headway_version": __version__,
        "head_config": dict(head_config),
        "target": target_fingerprint.to_dict(),
        "target_name": str(target_name),
        "weights_id": weights_id,
    }
    with staged_directory(final) as staging:
        write_safetensors(
            staging / WEIGHTS_NAME, tensors, {"format": "pt", "weights_id": weights_id}
        )
        write_json(staging / CONFIG_NAME, config)
    return final


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file (CPU), or one :class:`HeadsError` line naming the
    file and the fix when it is missing, truncated or corrupt."""
    if not path.is_file():
        raise HeadsError(f"{path} is missing; re-save or re-export the heads")
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (safetensors.SafetensorError, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HeadsError(
            f"{path} is corrupt or truncated ({reason}); re-save or re-export it from the "
            "training run (a copy cut short by a full disk or a killed transfer looks like this)"
        ) from error
    return tensors, metadata


def _read_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise HeadsError(f"no run directory at {directory}; pass the folder that training wrote")
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise HeadsError(
            f"{directory} has no {CONFIG_NAME}: it is not a headway run directory (or its first "
            "save was interrupted); pass the folder that training wrote"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HeadsError(f"{path} is not valid JSON ({error}); re-save the heads") from error
    missing = [key for key in _CONFIG_KEYS if not isinstance(config, dict) or key not in config]
    if missing:
        raise HeadsError(f"{path} lacks {missing}; it was not written by headway's save_heads")
    return dict(config)


def _shapes(spec: MethodSpec, head_config: dict[str, Any], where: Path) -> dict[str, Any]:
    try:
        return spec.tensor_shapes(head_config)
    except (TypeError, ValueError, OverflowError, RuntimeError) as error:
        # RuntimeError: sizes too large even for the meta device ("storage size overflowed")
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HeadsError(f"{where}: invalid head_config: {detail}") from None


def check_tensors(
    tensors: Mapping[str, Tensor], expected: dict[str, tuple[int, ...]], where: Path
) -> None:
    """Raise :class:`HeadsError` naming missing, unexpected or mis-shaped tensors, or a float
    tensor holding NaN or infinite values."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise HeadsError(
            f"{where}: the weights do not match the head_config: missing tensors {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected tensors {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise HeadsError(
                f"{where}: tensor {name} has shape {list(tensors[name].shape)}, the head_config "
                f"needs {list(shape)}"
            )
        tensor = tensors[name]
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise HeadsError(
                f"{where}: tensor {name} holds NaN or infinite values; these weights are broken "
                "(a diverged run or a damaged file): retrain or re-export them"
            )


def load_heads(directory: str | Path) -> LoadedHeads:
    """Read a run directory written by :func:`save_heads` (safetensors only, never pickle).

    Raises:
        HeadsError: missing folder or config, corrupt or truncated weights, weights from another
            save, unknown method, missing / unexpected / mis-shaped tensors.
    """
    root = Path(directory)
    config = _read_config(root)
    spec = _method_spec(str(config["method"]), root / CONFIG_NAME)
    expected = _shapes(spec, config["head_config"], root / CONFIG_NAME)
    tensors, metadata = read_safetensors(root / WEIGHTS_NAME)
    if metadata.get("weights_id") != config["weights_id"]:
        raise HeadsError(
            f"{root / WEIGHTS_NAME} was not written together with {root / CONFIG_NAME} (an "
            "interrupted save, or files copied from two runs); re-save the heads"
        )
    check_tensors(tensors, expected, root / WEIGHTS_NAME)
    try:
        target = TargetFingerprint.from_dict(config["target"])
    except TypeError as error:
        raise HeadsError(f"{root / CONFIG_NAME}: bad target fingerprint ({error})") from error
    return LoadedHeads(
        method=str(config["method"]),
        head_config=dict(config["head_config"]),
        state_dict=tensors,
        fingerprint=target,
        target_name=str(config["target_name"]),
    )
