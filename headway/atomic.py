"""Crash-safe writes: a file or folder appears complete under its final name, or not at all.

Everything headway writes that a later run reads (checkpoints, shards, regenerated data, exports,
conversion caches) goes through a temporary name in the same folder and an ``os.replace``/rename,
so a kill at any moment leaves either the old complete file or the new complete one.

A SIGKILL cannot clean up, so temporary names carry the writer's process id
(``.NAME.KIND-PID-RANDOM``); the next write of the same path removes those whose writer is no
longer running (:func:`remove_stale`), and restores a folder that a killed :func:`atomic_dir` had
moved aside but not yet replaced.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Temporary names written before the pid was part of them have no owner to ask; they count as
# stale once they are older than this process.
_STARTED = time.time()
_OWNED = re.compile(r"-(\d+)-[0-9a-f]+$")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file, fsync and rename."""
    write_bytes_atomic(path, text.encode("utf-8"))


def temporary_name(path: Path, kind: str) -> Path:
    """``.NAME.KIND-PID-RANDOM`` beside `path`: hidden, unique, and naming its writer."""
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _running(pid: int) -> bool:
    """Whether process `pid` exists on this machine (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def _is_stale(candidate: Path) -> bool:
    owner = _OWNED.search(candidate.name)
    if owner is None:
        return 0.0 < _mtime(candidate) < _STARTED
    pid = int(owner.group(1))
    return pid != os.getpid() and not _running(pid)


def _mtime(candidate: Path) -> float:
    try:
        return candidate.lstat().st_mtime
    except FileNotFoundError:  # removed meanwhile by another writer's cleanup
        return 0.0


def _stale(path: Path, kind: str) -> list[Path]:
    """The ``.NAME.KIND-*`` temporaries of `path` whose writer is gone, newest first."""
    pattern = glob.escape(f".{path.name}.{kind}-") + "*"
    stale = [candidate for candidate in path.parent.glob(pattern) if _is_stale(candidate)]
    return sorted(stale, key=_mtime, reverse=True)


def remove_stale(path: Path, kind: str) -> list[Path]:
    """Remove the ``.NAME.KIND-*`` leftovers of writers of `path` that were killed (their process
    is gone); live writers' temporaries are kept. Returns what was removed.

    Args:
        path: the final file or folder.
        kind: the temporary-name kind, e.g. ``"tmp"``, ``"staging"``, ``"saving"``.
    """
    stale = _stale(path, kind)
    for candidate in stale:
        _remove(candidate)
    return stale


def _remove(candidate: Path) -> None:
    """Delete a temporary file or folder (a link is removed, never followed)."""
    if candidate.is_dir() and not candidate.is_symlink():
        shutil.rmtree(candidate, ignore_errors=True)
    else:
        candidate.unlink(missing_ok=True)


def _temporary_file(path: Path) -> tuple[int, str]:
    """A new temporary file beside `path`, opened for writing, with the permissions a plain
    ``open()`` would give (0o666 less the umask; ``mkstemp``'s owner-only mode would leak into
    the final file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path, "tmp")
    remove_stale(path, "staging")  # what a killed atomic_file of this path left
    temporary = temporary_name(path, "tmp")
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    return handle, str(temporary)


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
    """Yield a temporary path for `path`; on success it is renamed to `path`.

    For writers that insist on a file name (``safetensors.torch.save_file``)::

        with atomic_file(out / "model.safetensors") as temporary:
            save_file(tensors, str(temporary))

    The temporary lies in a private folder beside `path` (``.NAME.staging-PID-RANDOM/NAME``):
    writers with a temporary of their own beside the name they are given (safetensors writes
    ``.tmpXXXXXX`` then renames it) leave it in that folder when killed, and the next write of
    `path`, or a run taking the folder (:func:`remove_dead_writers_leftovers`), removes it whole.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path, "tmp")
    remove_stale(path, "staging")
    staging = temporary_name(path, "staging")
    staging.mkdir()
    temporary = staging / path.name
    try:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        mode = os.fstat(handle).st_mode & 0o777  # what a plain open() gives (0o666 less umask)
        os.close(handle)
        yield temporary
        # The writer may have re-created the file owner-only (safetensors does): restore it.
        temporary.chmod(mode)
        temporary.replace(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def atomic_dir(path: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success it becomes `path`.

    With `overwrite`, an existing `path` is replaced (moved aside, then deleted) only once the new
    folder is complete; without it, an existing `path` raises ``FileExistsError``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists")
    # mkdir, not mkdtemp (which makes it owner-only): the folder gets the usual permissions.
    staging = temporary_name(path, "staging")
    staging.mkdir()
    try:
        yield staging
        if path.exists():
            retired = temporary_name(path, "old")
            retired.mkdir()
            path.rename(retired / "old")
            staging.rename(path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _recover(path: Path) -> None:
    """Undo what killed :func:`atomic_dir` calls on `path` left: a writer killed between moving
    the old folder aside and renaming the new one in left no `path`; the old one comes back.
    Then stale staging and retired folders are removed."""
    if not path.exists():
        for retired in _stale(path, "old"):
            if (retired / "old").is_dir():
                with contextlib.suppress(OSError):  # another process restored it first
                    (retired / "old").rename(path)
                break
    remove_stale(path, "old")
    remove_stale(path, "staging")


_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|staging|saving)-(?P<pid>\d+)-[0-9a-f]+$")


def remove_dead_writers_leftovers(folder: Path) -> list[Path]:
    """Remove every temporary file or folder under `folder` (any depth) that a killed writer
    left: names ``.NAME.KIND-PID-RANDOM`` of kind tmp/staging/saving whose process is gone.

    :func:`remove_stale` cleans a path's temporaries when that same path is written again; this
    sweep runs when a writer takes a folder (:func:`headway.locks.exclusive_folder`), so shards
    or checkpoints a dead run was writing go even if no later run writes those names. Folders a
    killed :func:`atomic_dir` moved aside (kind ``old``) are left for its recovery.
    """
    removed = []
    for candidate in sorted(folder.rglob(".*")):
        match = _TEMPORARY.match(candidate.name)
        if match is None or _running(int(match["pid"])):
            continue  # not a temporary, or its writer (this process included) is still at work
        _remove(candidate)
        removed.append(candidate)
    return removed
