"""One writer per output folder: an OS file lock that dies with its process.

Two runs writing the same folder (two ``headway data regenerate --out X``, say) would interleave
shards and manifests. A writer holds ``flock`` on ``<folder>/.headway-writer.lock`` while it
works; a second writer is refused at once, in one line naming the holder's pid. Taking the lock
also sweeps away the temporaries that killed writers left anywhere in the folder. The kernel drops
the lock when the holder exits for any reason (SIGKILL included), so a crash never leaves a
stale lock, and the holder removes the file when it is done (no leftovers in the folder).

Removing a lock file races with a process that opened it just before: that process would lock
an unlinked inode. So after locking, a writer checks that the path still names the inode it
locked, and starts over if not.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from headway.atomic import remove_dead_writers_leftovers
from headway.errors import FolderBusyError

logger = logging.getLogger(__name__)

LOCK_NAME = ".headway-writer.lock"


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


@contextmanager
def exclusive_folder(
    folder: Path, *, what: str = "output", name: str = LOCK_NAME
) -> Iterator[None]:
    """Hold the writer lock ``name`` of ``folder`` (created if missing) for the block.

    Raises:
        FolderBusyError: when another process holds it: ``"<folder> is being written by another
            headway process (pid N); wait for it to end or choose another <what> folder"``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / name, subject=folder, what=what, sweep=folder):
        yield


@contextmanager
def exclusive_output(path: Path, *, what: str = "--out", wait: bool = False) -> Iterator[None]:
    """Hold the writer lock of an output ``path`` that is written whole and renamed into place
    (an export): the lock file sits beside it, ``.<name>.headway-writer.lock``, so ``path`` itself
    never holds anything but the finished output. The folder around it is not swept (it may be
    the working directory); the writer removes the temporaries of killed writes of ``path``
    itself (:func:`headway.atomic.remove_stale`). With ``wait``, a busy lock is waited for
    instead (a cache entry another process is writing: check for it again once the lock is yours).

    Raises:
        FolderBusyError: another process is writing ``path`` (its pid named), unless ``wait``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.parent / f".{path.name}{LOCK_NAME}"
    with _locked(lock, subject=path, what=what, sweep=None, wait=wait):
        yield


@contextmanager
def _locked(
    path: Path, *, subject: Path, what: str, sweep: Path | None, wait: bool = False
) -> Iterator[None]:
    """``flock`` ``path`` for the block (waiting for it with ``wait``), then sweep temporaries
    of killed writers from ``sweep`` (any depth); the lock file is removed on the way out."""
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                os.close(handle)
                raise FolderBusyError(
                    f"{subject} is being written by another headway process (pid "
                    f"{_holder(path)}); wait for it to end or choose another {what} folder"
                ) from None
            logger.info("waiting for pid %s, writing %s", _holder(path), subject)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            same = os.fstat(handle).st_ino == path.stat().st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(handle)  # the holder removed the file between our open and our lock: retry
    try:
        os.ftruncate(handle, 0)
        os.write(handle, f"{os.getpid()}\n".encode())
        removed = remove_dead_writers_leftovers(sweep) if sweep is not None else []
        if removed:
            logger.info("removed %d temporaries of killed writers in %s", len(removed), sweep)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(handle)  # closing releases the lock


def rank_lock_name() -> str:
    """The writer lock of this process: :data:`LOCK_NAME`, or one per rank under a multi-process
    launch (``RANK``/``WORLD_SIZE`` as ``accelerate launch`` sets them), so the ranks of one run
    share a folder while a second run into it is still refused."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return LOCK_NAME
    return f"{LOCK_NAME}.rank-{int(os.environ.get('RANK', '0'))}"
