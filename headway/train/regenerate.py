"""Self-distillation data: the target answers the prompt mix itself, in resumable shards.

Drafters learn the target's own distribution (the Medusa-2 and EAGLE-3 papers train on
regenerated data), so every assistant turn of the training data is written by the frozen target.

Layout of an output folder::

    manifest.json            settings, target fingerprint, prompt mix, counts (rewritten as it goes)
    prompts.jsonl.gz         the full prompt list (self-instruct prompts included), shuffled with
                             the seed so every shard, and so any finished prefix, mixes all sources
    self-instruct/part-*.jsonl.gz   the target's answers to the self-instruct meta prompts
    data/part-*.jsonl.gz     the training conversations (``messages`` rows, loadable as data)

Shard ``k`` always holds items ``[k·S, (k+1)·S)`` of its list and is written to a temporary name
and renamed when complete, so a killed run resumes by skipping the shards that exist: no row is
lost or written twice, and (with a fixed seed) the resumed output equals an uninterrupted one.

The answers come from the in-process engines (:mod:`headway.train.answering`) or, with a
:class:`~headway.generation.server_client.ServerOptions`, from an OpenAI-compatible server
(:mod:`headway.train.server_answers`); shards, manifest and resuming are the same either way.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from headway.atomic import write_bytes_atomic, write_text_atomic
from headway.corpus.jsonl import DAMAGED as _DAMAGED
from headway.corpus.jsonl import read_jsonl
from headway.errors import DataError
from headway.generation.server_client import ChatServer, ServerOptions
from headway.locks import exclusive_folder, rank_lock_name
from headway.target import Target, fingerprint
from headway.train.answering import (
    SPEED_OPTIONS,
    Answer,
    RegenerateOptions,
    answer_items,
    conversation_messages,
)
from headway.train.prompts import PromptItem, describe_mix
from headway.train.ranks import Ranks
from headway.train.server_answers import server_answerer

__all__ = [
    "RegenerateOptions",
    "ServerOptions",
    "prompts_from_self_instruct",
    "prompts_path",
    "read_jsonl",
    "regenerate",
    "shard_path",
]

logger = logging.getLogger(__name__)

# How a shard's items get their answers: answer_items or answer_items_through_server, bound.
Answerer = Callable[
    [Sequence[PromptItem], RegenerateOptions], Iterator[tuple[PromptItem, list[Answer]]]
]


def _jsonl(rows: Sequence[dict[str, Any]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def shard_path(shard_dir: Path, index: int) -> Path:
    """Where shard `index` lives: ``part-<index>.jsonl.gz`` (gzip with no timestamp, so the
    same rows give the same bytes), or ``part-<index>.jsonl`` written by earlier versions."""
    plain = shard_dir / f"part-{index:05d}.jsonl"
    return plain if plain.is_file() else shard_dir / f"part-{index:05d}.jsonl.gz"


def _row(item: PromptItem, answers: Sequence[Answer]) -> dict[str, Any]:
    """The training row of `item`: its whole conversation; the answers given before
    (:attr:`PromptItem.answered`) are context (``"weight": 0``), `answers` are trained."""
    texts = [answer.text for answer in answers]
    messages: list[dict[str, Any]] = list(
        conversation_messages(item, texts, len(item.user_turns) - 1)
    )
    messages.append({"role": "assistant", "content": texts[-1]})
    context = len(item.answered)
    for message in messages:
        if message["role"] == "assistant" and context > 0:
            message["weight"], context = 0, context - 1
    return {
        "id": item.id,
        "source": item.source,
        "messages": messages,
        "finish_reason": answers[-1].finish_reason,
        "answer_tokens": sum(answer.tokens for answer in answers),
        **item.extra,
    }


_ROW_FIELDS = {"id": str, "messages": list, "finish_reason": str, "answer_tokens": int}


def _checked_shard(path: Path, shard: Sequence[PromptItem]) -> list[dict[str, Any]]:
    """The rows of a finished shard, checked to be the rows of ``shard`` as this module writes
    them (a damaged or foreign file is an error naming it, never a crash later)."""
    done = read_jsonl(path)
    for number, row in enumerate(done, start=1):
        wrong = [key for key, kind in _ROW_FIELDS.items() if not isinstance(row.get(key), kind)]
        if wrong:
            raise DataError(f"{path}:{number}: missing or mistyped {', '.join(wrong)}; {_DAMAGED}")
        last = row["messages"][-1] if row["messages"] else None
        if not isinstance(last, dict) or not isinstance(last.get("content"), str):
            raise DataError(f"{path}:{number}: the last message has no text; {_DAMAGED}")
    if [row["id"] for row in done] != [item.id for item in shard]:
        raise DataError(
            f"{path} does not hold the prompts it should; this folder was written "
            "with another prompt list: use a new --out folder"
        )
    return done


def run_shards(
    answer: Answerer,
    items: Sequence[PromptItem],
    shard_dir: Path,
    options: RegenerateOptions,
    *,
    desc: str,
    ranks: Ranks | None = None,
) -> list[dict[str, Any]]:
    """Answer `items` into ``shard_dir/part-*.jsonl.gz`` with `answer`, skipping complete shards
    (a shard is written only once all its items are answered); return all rows. With several
    processes, rank r answers shards r, r + W, r + 2W, ... and every rank returns all rows once
    all are done."""
    ranks = ranks or Ranks()
    shard_dir.mkdir(parents=True, exist_ok=True)
    shards = [items[k : k + options.shard_size] for k in range(0, len(items), options.shard_size)]
    mine = [index for index in range(len(shards)) if index % ranks.world == ranks.rank]
    total = sum(len(shards[index]) for index in mine)
    with tqdm(
        total=total, desc=desc, unit="conv", dynamic_ncols=True, disable=ranks.rank > 0
    ) as bar:
        for index in mine:
            shard, path = shards[index], shard_path(shard_dir, index)
            if path.is_file():
                _checked_shard(path, shard)
                bar.update(len(shard))
                continue
            # Seed per shard so a resumed run samples exactly what an uninterrupted one would.
            torch.manual_seed(options.seed + index)
            started, shard_rows = time.perf_counter(), []
            for item, answers in answer(shard, options):
                shard_rows.append(_row(item, answers))
                bar.update(1)
            by_position = {item.id: i for i, item in enumerate(shard)}
            shard_rows.sort(key=lambda row: by_position[row["id"]])
            write_bytes_atomic(path, gzip.compress(_jsonl(shard_rows).encode(), mtime=0))
            tokens = sum(row["answer_tokens"] for row in shard_rows)
            seconds = time.perf_counter() - started
            bar.set_postfix(tok_per_s=f"{tokens / seconds:.0f}")
            logger.info(
                "%s: %d rows, %d tokens, %.0f tok/s", path, len(shard), tokens, tokens / seconds
            )
    ranks.wait()
    return [
        row
        for index, shard in enumerate(shards)
        for row in _checked_shard(shard_path(shard_dir, index), shard)
    ]


def _request_text(answer: str) -> str:
    """The request inside a self-instruct answer: its longest quoted passage if it has one
    (small targets often answer 'A user might send: "..."'), else its first paragraph."""
    quoted = re.findall(r'"([^"]{12,})"', answer)
    if quoted:
        return max(quoted, key=len).strip()
    return answer.strip().split("\n\n")[0].strip().strip('"').strip()


def prompts_from_self_instruct(rows: Sequence[dict[str, Any]]) -> list[PromptItem]:
    """Turn the target's answers to meta prompts into user prompts (deduplicated)."""
    items, seen = [], set()
    for row in rows:
        text = _request_text(row["messages"][-1]["content"])
        if len(text) >= 12 and row["finish_reason"] == "eos" and text not in seen:
            seen.add(text)
            extra: dict[str, str] = {k: str(row[k]) for k in ("task", "topic") if k in row}
            items.append(PromptItem(f"{row['id']}/prompt", "self-instruct", [text], extra=extra))
    return items


def prompts_path(out_dir: Path) -> Path:
    """The frozen prompt list of a regeneration folder: ``prompts.jsonl.gz``, or the
    ``prompts.jsonl`` of folders written by earlier versions."""
    plain = out_dir / "prompts.jsonl"
    return plain if plain.is_file() else out_dir / "prompts.jsonl.gz"


def _load_or_write_prompts(out_dir: Path, items: Sequence[PromptItem]) -> list[PromptItem]:
    path = prompts_path(out_dir)
    if path.is_file():
        try:
            prompts = [PromptItem(**row) for row in read_jsonl(path)]
        except TypeError as error:  # a key PromptItem does not take, or one it needs missing
            reason = str(error).encode("unicode_escape").decode("ascii")  # a key may hold "\n"
            raise DataError(f"{path}: a row is not a prompt ({reason}); {_DAMAGED}") from None
        for number, prompt in enumerate(prompts, start=1):
            texts = (prompt.user_turns, prompt.answered)
            if not all(isinstance(t, list) and all(isinstance(x, str) for x in t) for t in texts):
                raise DataError(
                    f"{path}:{number}: user_turns and answered are not lists of text; {_DAMAGED}"
                )
        return prompts
    text = _jsonl([asdict(item) for item in items])
    write_bytes_atomic(path, gzip.compress(text.encode(), mtime=0))
    return list(items)


def _check_manifest(path: Path, settings: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """Refuse to resume a folder written with other `settings`, or answered in-process in
    another `dtype` (greedy answers differ between float32 and bfloat16). A folder from before
    the dtype was recorded (it then records this run's), or answered by a server, resumes in
    any dtype. Returns the folder's manifest so far (empty for a new folder)."""
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        previous = manifest["settings"]
    except (ValueError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as error:
        raise DataError(
            f"{path}: not a regeneration manifest ({type(error).__name__}: {error}); {_DAMAGED}"
        ) from None
    if not isinstance(previous, dict):
        raise DataError(f"{path}: 'settings' is not an object; {_DAMAGED}")
    # An option added after a folder was written is absent from its manifest: it ran as the
    # option's default, so such a folder resumes unchanged under that default.
    defaults = asdict(RegenerateOptions())
    previous = {**{k: defaults[k] for k in settings if k in defaults}, **previous}
    if previous != settings:
        changed = sorted(key for key in settings if previous.get(key) != settings[key])
        raise DataError(
            f"{path.parent} was regenerated with other settings ({', '.join(changed)} differ); "
            "resume with the same settings, or write to a new --out folder"
        )
    before = manifest.get("dtype")
    if dtype is not None and isinstance(before, str) and before != dtype:
        raise DataError(
            f"{path.parent} was regenerated in {before}, this run answers in {dtype}; resume "
            f"with --dtype {before}, or write to a new --out folder"
        )
    return dict(manifest)


def regenerate(
    target: Target | None,
    items: Sequence[PromptItem],
    out_dir: Path,
    options: RegenerateOptions,
    *,
    mix: dict[str, int],
    server: ServerOptions | None = None,
    continued_from: Sequence[str] = (),
) -> dict[str, Any]:
    """Regenerate the assistant turns of `items` with `target` into `out_dir`; resumable.
    The manifest names `continued_from`, the folders whose answers items continue from.

    Self-instruct meta items are answered first and their answers become prompts. Under
    ``accelerate launch`` with W processes, each answers every W-th shard (a disjoint slice of the
    prompts) and rank 0 writes the manifest once all shards are in; a resume may use another W.

    With `server`, an OpenAI-compatible server answers instead of the in-process engine, after
    :func:`~headway.train.server_answers.check_server` (which compares a greedy probe with
    `target`, or only checks the served name when `target` is None); the manifest records the
    server's URL and model name; in-process, it records the dtype the target answers in, and
    a resume in another dtype is refused.

    Returns:
        The final manifest (settings, mix per source, rows, answer tokens, seconds).

    Raises:
        FolderBusyError: when another process is writing `out_dir`.
        ServerError: the server does not serve the target, or a request failed for good.
    """
    if target is None and server is None:
        raise ValueError("regenerate needs a target to answer in-process, or a server")
    ranks = Ranks.from_accelerate()
    out_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_folder(out_dir, what="--out", name=rank_lock_name()):
        return _regenerate(
            target,
            items,
            out_dir,
            options,
            mix=mix,
            ranks=ranks,
            server=server,
            continued_from=[str(folder) for folder in continued_from],
        )


def _answerer(
    target: Target | None, options: RegenerateOptions, server: ServerOptions | None
) -> tuple[Answerer, dict[str, Any]]:
    """How items get answered, and what the manifest says about it."""
    if server is None:
        assert target is not None  # regenerate checked
        return partial(answer_items, target), {}
    client = ChatServer(server)
    return server_answerer(client, target, options), {
        "server": {"url": client.url, "model": server.model}
    }


def _regenerate(
    target: Target | None,
    items: Sequence[PromptItem],
    out_dir: Path,
    options: RegenerateOptions,
    *,
    mix: dict[str, int],
    ranks: Ranks,
    server: ServerOptions | None,
    continued_from: list[str],
) -> dict[str, Any]:
    # What decides the answers; the speed options may change on a resume, and so may the
    # engine: the server's answers are the target's (check_server).
    what = {k: v for k, v in asdict(options).items() if k not in SPEED_OPTIONS}
    identity = (
        fingerprint(target.model).to_dict()
        if target is not None
        else {"served_model": server.model if server else None}
    )
    settings = {**what, "mix": mix, "target": identity}
    manifest_path = out_dir / "manifest.json"
    dtype = None  # what in-process answers are computed in (a server's is not known)
    if target is not None and server is None:
        dtype = str(target.model.dtype).removeprefix("torch.")
    previous = _check_manifest(manifest_path, settings, dtype)
    answer, answered_by = _answerer(target, options, server)
    if dtype is not None:
        answered_by = {**answered_by, "dtype": dtype}
    before = previous.get("continued_from")
    if not continued_from and isinstance(before, list):
        continued_from = [str(folder) for folder in before]
    if continued_from:  # a resume needs not name them again: its prompts hold their answers
        answered_by = {**answered_by, "continued_from": continued_from}
    ranks.wait()  # every rank has read the old manifest before rank 0 rewrites it
    if ranks.rank == 0:
        started_manifest = {"settings": settings, **answered_by, "complete": False}
        write_text_atomic(manifest_path, json.dumps(started_manifest, indent=2))
    started = time.perf_counter()
    meta = [item for item in items if item.meta]
    direct = [item for item in items if not item.meta]
    if meta:
        meta_options = replace(options, max_new_tokens=options.meta_max_new_tokens)
        meta_rows = run_shards(
            answer, meta, out_dir / "self-instruct", meta_options, desc="self-instruct", ranks=ranks
        )
        direct += prompts_from_self_instruct(meta_rows)
    random.Random(options.seed).shuffle(direct)
    if ranks.rank == 0:
        _load_or_write_prompts(out_dir, direct)
    ranks.wait()
    prompts = _load_or_write_prompts(out_dir, direct)
    rows = run_shards(answer, prompts, out_dir / "data", options, desc="regenerate", ranks=ranks)
    manifest = {
        "settings": settings,
        **answered_by,
        "complete": True,
        "sources": describe_mix(prompts),
        "rows": len(rows),
        "answer_tokens": sum(row["answer_tokens"] for row in rows),
        "truncated_answers": sum(row["finish_reason"] == "length" for row in rows),
        "loop_stopped_answers": sum(row["finish_reason"] == "loop" for row in rows),
        "processes": ranks.world,
        "seconds_this_run": round(time.perf_counter() - started, 1),
    }
    if ranks.rank == 0:
        write_text_atomic(manifest_path, json.dumps(manifest, indent=2))
    ranks.wait()
    return manifest
