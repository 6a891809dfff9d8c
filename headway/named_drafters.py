"""Drafters named to the Python API, resolved, built and kept between calls.

``headway.generate(target, prompt)`` names its drafter (``"default"``, ``"prompt-lookup"``, a
heads folder...). Resolving and building it each call cost more than short answers do: on a
2-core EPYC, finding the shipped heads, loading them and converting their int8 layers took
~0.3 s a call, as long as a 16-token answer (docs/benchmarks.md, 2026-11-28). So what a name
resolves to is kept per live target and lent to one call at a time (:func:`borrow`):

- the drafter, for the default and drafter names, and for a heads folder while its files are
  unchanged (the key holds each file's size and modification time, so a folder rewritten between
  calls, e.g. by a training run saving into it, is read afresh);
- the :class:`~headway.decode.generate.Decoder` with it, where nothing in the decoder depends
  on the calls before (its trees sized by the drafter, the caller's ``options`` none): on a
  captured path (CUDA's default) it holds the static cache and the CUDA graphs captured for
  its drafter. A cost-sized decoder learns its acceptance calibration as it goes, so a later
  call's trees, and with sampling its tokens for the same seed, would depend on the calls
  before it: such calls get a fresh decoder on the kept drafter.

On a captured or compiled path with the caller's own ``options`` nothing is kept (a static
drafter's graphs belong to the decoder that captured them). A call that raises gives nothing
back; a call made while another holds the spare builds its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from headway.decode.generate import Decoder, Drafter
from headway.decode.options import DecodeOptions, VerifyPath
from headway.drafters.build import build_drafter
from headway.drafters.resolve import NO_DRAFTER, DrafterChoice, resolve_drafter
from headway.drafters.specs import DRAFTER_NAMES
from headway.target import Target

__all__ = ["DEFAULT_DRAFTER", "borrow", "borrow_drafter", "choice_for", "release"]

DEFAULT_DRAFTER = "default"
"""The drafter name that asks :func:`~headway.drafters.resolve.resolve_drafter` for the default."""


@dataclass
class _Made:
    """What a name resolved to: the choice, its drafter and, where kept, its decoder."""

    choice: DrafterChoice
    drafter: Drafter | None
    decoder: Decoder | None = None


_Key = tuple[str, VerifyPath, tuple[tuple[str, int, int], ...]]
"""A name (a heads folder's resolved path), the verify path, and for a heads folder the name,
size and modification time of each of its files (empty for drafter names)."""

_SPARES: dict[int, dict[_Key, _Made]] = {}
"""What :func:`borrow` keeps per live target (by ``id``; an entry goes with its target) and
:data:`_Key`."""


def choice_for(
    name: str,
    target: Target,
    options: Mapping[str, object] | None = None,
    verify: VerifyPath = "eager",
) -> DrafterChoice:
    """:func:`resolve_drafter` for a name the API was given (``"default"``, a drafter name or
    a heads folder), for the ``verify`` path the generation takes."""
    if name == DEFAULT_DRAFTER:
        return resolve_drafter(target.model, options=options, verify=verify)
    if name in DRAFTER_NAMES or name == NO_DRAFTER:
        return resolve_drafter(target.model, drafter=name, options=options, verify=verify)
    return resolve_drafter(target.model, heads=name, options=options, verify=verify)


def borrow(
    name: str, target: Target, verify: VerifyPath, options: DecodeOptions | None
) -> tuple[Decoder, Callable[[], None]]:
    """A decoder running what ``name`` resolves to for ``target`` on the ``verify`` path, with
    ``options`` (``None``: the choice's sizing), and the call that lends what it kept to the next
    generation once this one finished (see the module docstring for what is kept)."""
    key = _key(name, verify)
    if key is None or (verify != "eager" and options is not None):
        made = _made(name, target, verify)
        return _decoder(made, target, verify, options), _nothing
    spares, made = _take(key, name, target)
    keeps_decoder = options is None and made.choice.sizing != "cost"
    if keeps_decoder and made.decoder is not None:
        decoder = made.decoder
    else:
        decoder = _decoder(made, target, verify, options)

    def give_back() -> None:
        spares[key] = _Made(made.choice, made.drafter, decoder if keeps_decoder else None)

    return decoder, give_back


def borrow_drafter(name: str, target: Target) -> tuple[Drafter | None, Callable[[], None]]:
    """The drafter ``name`` resolves to for ``target`` (None: no drafter), kept between calls
    as :func:`borrow` keeps it on the eager path (the same entry), and the call that lends it to
    the next caller once this one finished: for :func:`headway.generate_batch`, whose rows draft
    with its model (an EAGLE drafter's: building the shipped one took ~0.19 s a call on a
    2-core EPYC, 2026-11-29)."""
    key = _key(name, "eager")
    if key is None:
        return _made(name, target, "eager").drafter, _nothing
    spares, made = _take(key, name, target)

    def give_back() -> None:
        spares[key] = made

    return made.drafter, give_back


def _take(key: _Key, name: str, target: Target) -> tuple[dict[_Key, _Made], _Made]:
    """What is kept for ``target`` and what ``key`` resolved to, taken out of it (made now
    where nothing was kept, or where a heads folder's files changed since)."""
    if id(target) not in _SPARES:
        _SPARES[id(target)] = {}
        weakref.finalize(target, _forget, id(target))
    spares = _SPARES[id(target)]
    for stale in [old for old in spares if old[:2] == key[:2] and old != key]:
        del spares[stale]  # the folder's files changed since: its drafter no longer fits them
    kept = spares.pop(key, None)
    return spares, kept if kept is not None else _made(name, target, key[1])


def _key(name: str, verify: VerifyPath) -> _Key | None:
    """Where :func:`borrow` keeps what ``name`` resolves to; ``None`` for a heads folder whose
    files cannot be listed (the build reports why)."""
    if name in (DEFAULT_DRAFTER, NO_DRAFTER) or name in DRAFTER_NAMES:
        return (name, verify, ())
    folder = Path(name)
    try:
        stats = sorted((path.name, path.stat()) for path in folder.iterdir() if path.is_file())
    except OSError:
        return None
    state = tuple((file, stat.st_mtime_ns, stat.st_size) for file, stat in stats)
    return (str(folder.resolve()), verify, state)


def _made(name: str, target: Target, verify: VerifyPath) -> _Made:
    choice = choice_for(name, target, verify=verify)
    return _Made(choice, None if choice.spec is None else build_drafter(choice.spec, target))


def _decoder(
    made: _Made, target: Target, verify: VerifyPath, options: DecodeOptions | None
) -> Decoder:
    options = options or DecodeOptions(sizing=made.choice.sizing, verify=verify)
    return Decoder(target.model, made.drafter, options)


def _forget(target_id: int) -> None:
    """Drop what was kept for a target that is gone."""
    _SPARES.pop(target_id, None)


def release(target: Target | None = None) -> int:
    """Drop what :func:`borrow` kept for ``target`` (every target when ``None``): its drafters and
    decoders, with their static caches and CUDA graphs (GPU memory the target's own weights do
    not need); returns how many were dropped. Later calls build afresh. A call in progress keeps
    what it borrowed until it ends, and then gives it back."""
    held = list(_SPARES.values()) if target is None else [_SPARES.get(id(target), {})]
    dropped = sum(len(spares) for spares in held)
    for spares in held:
        spares.clear()
    return dropped


def _nothing() -> None:
    """Nothing to give back (built for one call)."""
