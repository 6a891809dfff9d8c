"""Timings measured on this machine, remembered between runs.

Two decisions are timed rather than guessed: ``--gemm auto``'s route (:mod:`headway.decode.gemm`)
and cost sizing's verify cost table (:mod:`headway.decode.costs`). Each took seconds at the start
of every command (the embedded SmolLM2 on a 2-core EPYC: ~2 s per model for the route, ~7 s for
the table, 2026-11-28), and a timing made while something else loads the machine may choose worse
than one made at rest. So the first measurement is kept in ``$HEADWAY_CACHE/timings.json``
(default ``~/.cache/headway``) under a key naming everything the measurement depends on: this
machine (architecture, CPU model, cores, torch threads, torch version, the device), the code that
measured (a hash of headway's decoding sources), and what the caller adds (the layers' shapes
and dtypes, the route, the verify forward, the sizes).

A timing taken while other processes keep the CPU busy is used by the process that took it (for
every later ask of it too) but not kept (:data:`BUSY_SHARE`): a busy neighbour slows one-token
forwards more than blocks (both are bound by memory bandwidth on small CPUs), and on a 2-core
EPYC such a cost table, kept, had the drafter verify blocks that no longer paid (2026-11-28,
docs/benchmarks.md).

``HEADWAY_TIMINGS``: ``on`` (default) remembers; ``retime`` measures again and replaces what was
kept; ``off`` neither reads nor writes (the test suite runs so). A file that cannot be read or
written is never an error: the value is measured and used.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import nn

from headway.atomic import write_text_atomic
from headway.errors import HeadwayError
from headway.hardware import cpu_model
from headway.version import __version__

__all__ = [
    "BUSY_SHARE",
    "TIMINGS_NAME",
    "cache_dir",
    "code_digest",
    "forget_taken",
    "forget_timings",
    "kept_timings",
    "machine_key",
    "remembered",
    "seconds_table",
    "shapes_digest",
    "timings_mode",
    "timings_path",
]

logger = logging.getLogger(__name__)

TIMINGS_NAME = "timings.json"
SCHEMA = "headway.timings/1"
MODES = ("on", "retime", "off")
_SAID: set[str] = set()  # the kinds this process has logged a kept timing of
_TAKEN: dict[tuple[str, str], Any] = {}
"""What this process measured or read, per timings file and full key's digest: asked again (a
new decoder per ``headway.generate`` call), it neither times again nor rereads the file."""

T = TypeVar("T")

BUSY_SHARE = 0.125
"""The share of this machine's cores other processes may keep busy, on average over a
measurement, for it to be kept (a quarter of a core on 2 cores, two on 16; Linux: ``/proc/stat``
against this process's own CPU time; elsewhere always kept)."""
MIN_JUDGED_S = 0.5
"""Measurements shorter than this are kept without judging the load (the kernel counts CPU time
in 10 ms ticks, too coarse for them)."""


def cache_dir() -> Path:
    """The headway cache: ``$HEADWAY_CACHE``, default ``~/.cache/headway``."""
    return Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway"))


TIMED_CODE = ("decode", "drafters", "generation")
"""The packages of headway whose code the kept timings measure (:func:`code_digest`)."""


def code_digest(root: Path | None = None) -> str:
    """A hash of the source of :data:`TIMED_CODE` under ``root`` (default: this headway's): a
    timing kept by other code (an upgrade, an edit) is timed again. A batched-step cost table
    timed before the static cache's 160x faster bf16 writes, read back after them, had the batch
    engine regenerate at 48 tok/s instead of 61 (2026-11-29, docs/benchmarks.md)."""
    if root is None:
        return _own_code_digest()
    digest = hashlib.sha256()
    for folder in TIMED_CODE:
        for path in sorted((root / folder).glob("*.py")):
            digest.update(f"{folder}/{path.name}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _own_code_digest() -> str:
    try:
        return code_digest(Path(__file__).parent)
    except OSError:  # sources not readable as files (a zipped install): the version decides
        return str(__version__)


def machine_key(device: torch.device) -> dict[str, Any]:
    """What any timing on ``device`` depends on beyond the caller's own key: this machine, and
    the code that times (:func:`code_digest`)."""
    key: dict[str, Any] = {
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device.type,
        "code": code_digest(),
    }
    if device.type == "cuda":
        key["gpu"] = torch.cuda.get_device_name(device)
    return key


def shapes_digest(module: nn.Module) -> str:
    """A hash of ``module``'s class and its parameters' names, shapes and dtypes (what a forward
    costs depends on; the values do not matter)."""
    parts = [type(module).__name__]
    parts += [f"{name}:{list(p.shape)}:{p.dtype}" for name, p in module.named_parameters()]
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()[:16]


def timings_mode() -> str:
    """``HEADWAY_TIMINGS`` as this process reads it: ``on``, ``retime`` or ``off`` (anything else
    reads as ``on``)."""
    mode = os.environ.get("HEADWAY_TIMINGS", "on").strip().lower()
    return mode if mode in MODES else "on"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def remembered(
    kind: str,
    key: Mapping[str, Any],
    measure: Callable[[], T],
    *,
    device: torch.device,
    valid: Callable[[Any], bool],
) -> T:
    """The value ``measure()`` gave when first called for ``kind`` and ``key`` on this machine
    (:func:`machine_key` of ``device``), measured now if none was kept, ``valid`` rejects the
    kept one, or ``HEADWAY_TIMINGS`` says ``retime``; asked again in this process, the value it
    took (:data:`_TAKEN`). The value must be plain JSON (a string, a list of floats)."""
    mode = timings_mode()
    if mode == "off":
        return measure()
    full = {"kind": kind, **machine_key(device), **key}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()
    path = timings_path()
    taken = (str(path), digest)
    if mode == "on" and taken in _TAKEN and valid(_TAKEN[taken]):
        return cast(T, copy.deepcopy(_TAKEN[taken]))  # a copy: a caller may change its own
    value = _kept_or_measured(kind, full, path, digest, measure, mode, valid)
    _TAKEN[taken] = copy.deepcopy(value)
    return value


def _kept_or_measured(
    kind: str,
    full: dict[str, Any],
    path: Path,
    digest: str,
    measure: Callable[[], T],
    mode: str,
    valid: Callable[[Any], bool],
) -> T:
    """:func:`remembered`'s value for the key hashed to ``digest``, read from the timings file
    ``path`` or measured (and kept there unless other processes kept the CPU busy meanwhile)."""
    entry = _read(path).get(digest) if mode == "on" else None
    if isinstance(entry, dict) and valid(entry.get("value")):
        log = logger.debug if kind in _SAID else logger.info  # once a process per kind
        _SAID.add(kind)
        log(
            "%s as timed here on %s (kept in %s; HEADWAY_TIMINGS=retime times it again)",
            kind,
            entry.get("measured", "an earlier run"),
            path,
        )
        return cast(T, entry["value"])
    value, others = _with_load(measure)
    if others is not None and others > BUSY_SHARE * (os.cpu_count() or 1):
        logger.info(
            "%s timed while other processes kept %.1f cores busy: used for this run, not kept",
            kind,
            others,
        )
        return value
    measured = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    try:
        entries = _read(path)  # again: another process may have added its own since
        entries[digest] = {"key": full, "value": value, "measured": measured}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"schema": SCHEMA, "entries": entries}, indent=1))
    except (OSError, TypeError, ValueError) as error:
        logger.debug("could not keep the %s timing in %s: %s", kind, path, error)
    return value


def _busy_seconds() -> float | None:
    """CPU seconds every process on this machine has spent busy since boot (``/proc/stat``:
    user, nice, system, irq, softirq and steal time), or None where that cannot be read."""
    try:
        fields = Path("/proc/stat").read_text(encoding="ascii").split("\n", 1)[0].split()
        ticks = [int(field) for field in fields[1:9]]
        per_second = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    if fields[0] != "cpu" or len(ticks) < 7:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = ticks[:7]
    steal = ticks[7] if len(ticks) > 7 else 0
    return (user + nice + system + irq + softirq + steal) / per_second


def _with_load(measure: Callable[[], T]) -> tuple[T, float | None]:
    """``measure()`` and the cores other processes kept busy meanwhile, on average (None where
    unknown or the measurement took under :data:`MIN_JUDGED_S`)."""
    busy, own, start = _busy_seconds(), time.process_time(), time.perf_counter()
    value = measure()
    wall = time.perf_counter() - start
    busy_after, own_after = _busy_seconds(), time.process_time()
    if busy is None or busy_after is None or wall < MIN_JUDGED_S:
        return value, None
    return value, max(0.0, (busy_after - busy) - (own_after - own)) / wall


def timings_path() -> Path:
    """The file kept timings live in."""
    return cache_dir() / TIMINGS_NAME


def kept_timings() -> list[dict[str, Any]]:
    """Every timing kept on this machine (``headway env --timings``), oldest first: each entry's
    ``key`` (kind, machine and caller key), ``value`` and ``measured`` date."""
    entries = [entry for entry in _read(timings_path()).values() if isinstance(entry, dict)]
    return sorted(entries, key=lambda entry: str(entry.get("measured", "")))


def seconds_table(count: int) -> Callable[[Any], bool]:
    """A ``valid`` for :func:`remembered`: a kept value that is a list of ``count`` positive,
    finite float seconds (a cost table)."""

    def valid(table: Any) -> bool:
        return (
            isinstance(table, list)
            and len(table) == count
            and all(isinstance(t, float) and 0 < t < math.inf for t in table)
        )

    return valid


def forget_taken() -> None:
    """Forget what this process took from the kept timings (the file stays): the next use reads
    it again, as a new process would."""
    _TAKEN.clear()


def forget_timings() -> int:
    """Remove the kept timings (the next command times again); returns how many there were."""
    count = len(_read(timings_path()))
    _TAKEN.clear()
    try:
        timings_path().unlink(missing_ok=True)
    except OSError as error:
        raise HeadwayError(f"cannot remove {timings_path()}: {error.strerror or error}") from None
    return count
