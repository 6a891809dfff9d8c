"""Target features: the frozen target's hidden states that a drafter trains on.

One interface, two sources:

- *online* (:class:`OnlineFeatures`): the frozen target runs inside each training step;
- *offline* (:func:`cache_features` + :class:`CachedFeatureDataset`): one pass writes the hidden
  states a method needs (the last layer for Medusa/EAGLE-1, three tap layers for EAGLE-3) to
  safetensors shards in bf16/fp16, with a manifest (target fingerprint, layers, dtype, dataset
  hash, tokens); a map-style dataset reads them back lazily (memory-mapped), sample by sample.

Either way the training step sees ``hidden: dict[int, Tensor [B, T, H]]`` keyed by index into the
target's ``output_hidden_states`` (0 = embeddings, ``L`` = after the final norm).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from headway.atomic import atomic_file, write_text_atomic
from headway.errors import DataError
from headway.heads.eagle import TargetHead
from headway.heads.hidden_states import final_hidden_layer
from headway.locks import exclusive_folder, rank_lock_name
from headway.target import fingerprint
from headway.train.batching import pad_collate, target_inputs
from headway.train.ranks import Ranks

logger = logging.getLogger(__name__)
MANIFEST = "manifest.json"
__all__ = [
    "MANIFEST",
    "CachedFeatureDataset",
    "OnlineFeatures",
    "cache_features",
    "cached_hidden",
    "dataset_hash",
    "hidden_key",
    "read_manifest",
    "remove_cache",
]


_DTYPES = ("bfloat16", "float16", "float32")
_REWRITE = "delete the folder and rerun `headway data cache-features`"


def _is_count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < 2**40


def read_manifest(directory: Path) -> dict[str, Any]:
    """A feature cache's ``manifest.json``, its settings checked for type and range.

    Raises:
        DataError: missing, not JSON, or a field of the wrong type or out of range (one line
            naming the file and the field).
    """
    path = directory / MANIFEST
    if not path.is_file():
        raise DataError(f"{directory} has no {MANIFEST}; run `headway data cache-features`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise DataError(f"{path} is not valid JSON ({error}); {_REWRITE}") from error
    settings = manifest.get("settings") if isinstance(manifest, dict) else None
    if not isinstance(settings, dict):
        raise DataError(f"{path} has no settings object; {_REWRITE}")
    layers = settings.get("layers")
    checks = {
        "layers": isinstance(layers, list) and all(_is_count(x, 0) for x in layers) and layers,
        "samples": _is_count(settings.get("samples"), 0),
        "shard_samples": _is_count(settings.get("shard_samples"), 1),
        "dtype": settings.get("dtype") in _DTYPES,
        "target": isinstance(settings.get("target"), dict),
        "complete": isinstance(manifest.get("complete"), bool),
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise DataError(f"{path}: {', '.join(bad)} missing or invalid; {_REWRITE}")
    return manifest


def hidden_key(layer: int) -> str:
    return f"hidden.{layer}"


Batch = Mapping[str, Tensor]
"""One collated batch: ``input_ids``, ``loss_mask`` and the rest, each ``[batch, seq, ...]``."""

FeatureSource = Callable[[Batch], dict[int, Tensor]]
"""A batch -> the target's hidden states a method trains on, by ``output_hidden_states`` index
(:class:`OnlineFeatures`, or :func:`cached_hidden` over a feature cache)."""


class OnlineFeatures:
    """Run the frozen target on each batch and return the requested hidden states.

    ``autocast`` (e.g. ``torch.bfloat16``, what ``train.mixed_precision=bf16`` gives) runs the
    forward under autocast: on a CPU with native bf16 it is faster, and the features are
    returned in fp32. The LM head is computed for one position only (the features are what the
    methods read; those that need the target's logits take them from the last hidden state).
    """

    def __init__(
        self, model: PreTrainedModel, layers: Sequence[int], *, autocast: torch.dtype | None = None
    ) -> None:
        self.model = model
        self.layers = tuple(layers)
        self.autocast = autocast
        parameters = inspect.signature(model.forward).parameters
        self.head_rows = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}

    @torch.no_grad()
    def __call__(self, batch: Mapping[str, Tensor]) -> dict[int, Tensor]:
        """``input_ids``/``attention_mask`` ``[B, T]`` (+ packed ``position_ids``/
        ``document_ids``) -> layer -> hidden ``[B, T, H]``."""
        device = batch["input_ids"].device.type
        with torch.autocast(
            device, dtype=self.autocast or torch.float32, enabled=bool(self.autocast)
        ):
            output = self.model(
                **target_inputs(batch, self.model.dtype),
                output_hidden_states=True,
                use_cache=False,
                **self.head_rows,
            )
        if self.autocast is None:
            return {layer: output.hidden_states[layer] for layer in self.layers}
        return {layer: output.hidden_states[layer].float() for layer in self.layers}


def cached_hidden(batch: Mapping[str, Tensor], layers: Sequence[int]) -> dict[int, Tensor]:
    """Hidden states a :class:`CachedFeatureDataset` batch carries, as fp32 layer -> ``[B,T,H]``."""
    return {layer: batch[hidden_key(layer)].float() for layer in layers}


def dataset_hash(dataset: datasets.Dataset) -> str:
    """A hash of every sample's ids and loss mask, to tie a feature cache to its data."""
    digest = hashlib.sha256()
    for row in dataset:
        digest.update(json.dumps([row["input_ids"], row["loss_mask"]]).encode())
    return digest.hexdigest()[:16]


def _write_shard(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    with atomic_file(path) as temporary:
        save_file(tensors, str(temporary), metadata=metadata)


def cache_features(
    model: PreTrainedModel,
    dataset: datasets.Dataset,
    out_dir: Path,
    *,
    layers: Sequence[int],
    dtype: torch.dtype = torch.bfloat16,
    batch_size: int = 8,
    shard_samples: int = 256,
    pad_token_id: int = 0,
    target_argmax: bool = False,
) -> dict[str, Any]:
    """Write the hidden states of `layers` for every sample of `dataset` into shards; resumable.
    ``target_argmax`` also stores the target's argmax per token where the LM head's input (the
    last layer) is cached, for EAGLE-3 (:class:`CachedFeatureDataset`).

    Shard ``k`` holds samples ``[k·S, (k+1)·S)`` and is written under a temporary name and
    renamed, so a rerun after a kill skips complete shards and redoes at most one.

    Returns:
        The manifest (also written to ``out_dir/manifest.json``), with ``bytes_per_token``.

    Raises:
        FolderBusyError: when another process is writing ``out_dir``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_folder(out_dir, what="--out", name=rank_lock_name()):
        return _cache_features(
            model, dataset, out_dir, layers=layers, dtype=dtype, batch_size=batch_size,
            shard_samples=shard_samples, pad_token_id=pad_token_id, target_argmax=target_argmax,
        )  # fmt: skip


def _cache_features(
    model: PreTrainedModel,
    dataset: datasets.Dataset,
    out_dir: Path,
    *,
    layers: Sequence[int],
    dtype: torch.dtype,
    batch_size: int,
    shard_samples: int,
    pad_token_id: int,
    target_argmax: bool,
) -> dict[str, Any]:
    depth = int(model.config.get_text_config().num_hidden_layers)
    if not layers or len(set(layers)) != len(layers) or not all(0 <= x <= depth for x in layers):
        raise DataError(
            f"layers {list(layers)}: list distinct indices into output_hidden_states, 0 to {depth}"
        )
    argmax = target_argmax and depth in layers  # only where the LM head's input is cached
    settings = {
        "target": fingerprint(model).to_dict(),
        "layers": list(layers),
        "dtype": str(dtype).removeprefix("torch."),
        "dataset_hash": dataset_hash(dataset),
        "samples": len(dataset),
        "shard_samples": shard_samples,
        "target_argmax": argmax,
    }
    manifest_path = out_dir / MANIFEST
    if manifest_path.is_file():
        previous = read_manifest(out_dir)["settings"]
        if previous != settings:
            raise DataError(
                f"{out_dir} holds features of other data, target or layers; "
                "use a new folder or delete this one"
            )
    ranks = Ranks.from_accelerate()
    ranks.wait()  # every rank has read the old manifest before rank 0 rewrites it
    if ranks.rank == 0:
        incomplete = {"settings": settings, "complete": False}
        write_text_atomic(manifest_path, json.dumps(incomplete, indent=2))
    online = OnlineFeatures(model, layers)
    started = time.perf_counter()
    starts = list(range(0, len(dataset), shard_samples))
    mine = [index for index in range(len(starts)) if index % ranks.world == ranks.rank]
    for shard_index in tqdm(mine, desc="cache features", unit="shard", disable=ranks.rank > 0):
        path = out_dir / f"shard-{shard_index:05d}.safetensors"
        if not path.is_file():
            _cache_shard(online, dataset, path, starts[shard_index], shard_samples, dtype,
                         batch_size=batch_size, pad_token_id=pad_token_id,
                         argmax=argmax)  # fmt: skip
    ranks.wait()  # every shard is in
    tokens = sum(len(ids) for ids in dataset["input_ids"])
    size = sum(path.stat().st_size for path in out_dir.glob("shard-*.safetensors"))
    manifest = {
        "settings": settings,
        "complete": True,
        "tokens": tokens,
        "bytes": size,
        "bytes_per_token": round(size / max(tokens, 1), 1),
        "seconds_this_run": round(time.perf_counter() - started, 1),
        "processes": ranks.world,
    }
    if ranks.rank == 0:
        write_text_atomic(manifest_path, json.dumps(manifest, indent=2))
    ranks.wait()
    return manifest


def _cache_shard(
    online: OnlineFeatures,
    dataset: datasets.Dataset,
    path: Path,
    start: int,
    shard_samples: int,
    dtype: torch.dtype,
    *,
    batch_size: int,
    pad_token_id: int,
    argmax: bool,
) -> None:
    """Write the features of samples ``[start, start + shard_samples)`` to the shard ``path``."""
    rows = dataset.select(range(start, min(start + shard_samples, len(dataset))))
    device = online.model.device
    final, head = final_hidden_layer(online.model), TargetHead.of(online.model)
    tensors: dict[str, Tensor] = {}
    for offset in range(0, len(rows), batch_size):
        chunk = [rows[i] for i in range(offset, min(offset + batch_size, len(rows)))]
        batch = pad_collate(chunk, pad_token_id=pad_token_id)
        batch = {key: value.to(device) for key, value in batch.items()}
        hidden = online(batch)
        for row_index, row in enumerate(chunk):
            length, key = len(row["input_ids"]), str(start + offset + row_index)
            tensors[f"{key}.input_ids"] = torch.tensor(row["input_ids"], dtype=torch.int32)
            tensors[f"{key}.loss_mask"] = torch.tensor(row["loss_mask"], dtype=torch.int8)
            for layer, states in hidden.items():
                value = states[row_index, :length].to("cpu", dtype).contiguous()
                tensors[f"{key}.{hidden_key(layer)}"] = value
                if argmax and layer == final:  # from the stored (rounded) features
                    best = head.logits(value.to(device)).max(-1).indices  # as argmax, faster
                    tensors[f"{key}.target_argmax"] = best.to("cpu", torch.int32)
    # One metadata key: safetensors writes several in a random order; a resume is byte-identical
    rows_meta = json.dumps({"first": start, "count": len(rows)})
    _write_shard(path, tensors, {"rows": rows_meta})


class CachedFeatureDataset(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Samples of a feature cache: ``input_ids``/``loss_mask`` ``[T]``, ``hidden.L`` ``[T, H]``
    and, where the LM head's input is cached, ``target_argmax`` ``[T]`` (the target's argmax, so
    EAGLE-3 runs the target's head over its draft columns only). Shards are opened lazily with
    safetensors (memory-mapped), so only the samples read are loaded."""

    def __init__(self, directory: Path) -> None:
        manifest = read_manifest(directory)
        if not manifest["complete"]:
            raise DataError(
                f"{directory}: feature caching did not finish; rerun the same "
                "`headway data cache-features` command to complete it"
            )
        self.directory = directory
        self.settings: dict[str, Any] = manifest["settings"]
        self.layers: tuple[int, ...] = tuple(self.settings["layers"])
        self._per_shard = int(self.settings["shard_samples"])
        self._length = int(self.settings["samples"])
        hidden = self.settings["target"].get("hidden_size")
        self._hidden_size = hidden if _is_count(hidden, 1) else None
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return self._length

    def _shard(self, index: int) -> Any:
        if index not in self._open:
            path = self.directory / f"shard-{index:05d}.safetensors"
            try:
                self._open[index] = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own error types
                raise DataError(
                    f"{path} is missing or corrupt ({error}); delete it and rerun "
                    "`headway data cache-features` to rewrite it"
                ) from error
        return self._open[index]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self._length:
            raise IndexError(index)
        shard_index = index // self._per_shard
        shard = self._shard(shard_index)
        names = ["input_ids", "loss_mask", *(hidden_key(layer) for layer in self.layers)]
        names += ["target_argmax"] if self.settings.get("target_argmax") else []
        try:
            row = {name: shard.get_tensor(f"{index}.{name}") for name in names}
        except Exception as error:  # safetensors raises its own error types
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataError(
                f"{self.directory / f'shard-{shard_index:05d}.safetensors'}: sample {index} "
                f"cannot be read ({reason}); {_REWRITE}"
            ) from error
        self._check(row, index, shard_index)
        return row

    def sample_length(self, index: int) -> int:
        """Tokens of sample ``index``, read from its shard's header (no tensor is loaded)."""
        shard_index = index // self._per_shard
        try:
            return int(self._shard(shard_index).get_slice(f"{index}.input_ids").get_shape()[0])
        except Exception as error:  # safetensors raises its own error types
            raise DataError(
                f"{self.directory / f'shard-{shard_index:05d}.safetensors'}: sample {index} "
                f"cannot be read ({type(error).__name__}); {_REWRITE}"
            ) from error

    def _check(self, row: dict[str, Tensor], index: int, shard_index: int) -> None:
        """Shapes and dtypes of one sample against the manifest: ids and mask ``[T]`` (integer),
        hidden states ``[T, H]`` (floating, ``H`` the target's hidden size)."""
        length = row["input_ids"].shape[0] if row["input_ids"].dim() == 1 else -1
        ok = length > 0 and not row["input_ids"].is_floating_point()
        ok = ok and tuple(row["loss_mask"].shape) == (length,)
        ok = ok and tuple(row.get("target_argmax", row["loss_mask"]).shape) == (length,)
        for layer in self.layers:
            states = row[hidden_key(layer)]
            width = states.shape[1] if states.dim() == 2 else -1
            ok = ok and states.is_floating_point() and states.shape[0] == length
            ok = ok and (self._hidden_size is None or width == self._hidden_size)
        if not ok:
            shapes = {name: list(tensor.shape) for name, tensor in row.items()}
            raise DataError(
                f"{self.directory / f'shard-{shard_index:05d}.safetensors'}: sample {index} has "
                f"shapes {shapes} that do not fit its manifest; {_REWRITE}"
            )

    def __getstate__(self) -> dict[str, Any]:
        # Open shard handles do not cross process boundaries (DataLoader workers); reopen there.
        return {**self.__dict__, "_open": {}}


def remove_cache(directory: Path) -> None:
    """Delete a feature cache folder (used by tests and by `--overwrite`)."""
    shutil.rmtree(directory, ignore_errors=True)
