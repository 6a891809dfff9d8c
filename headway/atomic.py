"""Crash-safe writes: a file or folder appears complete under its final name, or not at all.

Everything headway writes that a later run reads (checkpoints, shards, regenerated data, exports,
conversion caches) goes through a temporary name in the same folder and an ``os.replace``/rename,
so a kill at any moment leaves either the old complete file or the new complete one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file, fsync and rename."""
    write_bytes_atomic(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temporary_file(path: Path) -> tuple[int, str]:
    """A temporary file beside `path` with the permissions a plain ``open()`` would give
    (``mkstemp`` makes it owner-only, which would leak into the final file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    Path(temporary).chmod(0o666 & ~_umask())
    return handle, temporary


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file, fsync and rename."""
    handle, temporary = _temporary_file(path)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        Path(temporary).replace(path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed to `path`.

    For writers that insist on a file name (``safetensors.torch.save_file``)::

        with atomic_file(out / "model.safetensors") as temporary:
            save_file(tensors, str(temporary))
    """
    handle, temporary = _temporary_file(path)
    os.close(handle)
    try:
        yield Path(temporary)
        Path(temporary).replace(path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success it becomes `path`.

    With `overwrite`, an existing `path` is replaced (moved aside, then deleted) only once the new
    folder is complete; without it, an existing `path` raises ``FileExistsError``.
    """
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists")
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not mkdtemp (which makes it owner-only): the folder gets the usual permissions.
    staging = path.parent / f".{path.name}.staging-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        yield staging
        if path.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            path.rename(retired / "old")
            staging.rename(path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
