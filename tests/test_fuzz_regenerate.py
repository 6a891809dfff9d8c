"""Fuzzing a regeneration folder (issue #17, loaders): whatever is found in a manifest, a
shard, the prompt list or a ShareGPT-style ``.json`` file, resuming either works or stops with
headway's own one-line error naming the file, never a KeyError, TypeError or gzip error."""

from __future__ import annotations

import atexit
import gzip
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from headway.corpus.sources import load_conversations
from headway.errors import DataError
from headway.target import Target
from headway.train.prompts import PromptItem
from headway.train.regenerate import RegenerateOptions, prompts_path, regenerate
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPTIONS = RegenerateOptions(max_new_tokens=4, batch_size=4, shard_size=2)
ITEMS = [PromptItem(f"t/{i}", "test", ["hello there", "and then?"][: 1 + i % 2]) for i in range(4)]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@lru_cache(maxsize=1)
def target() -> Target:
    return Target(tiny_model("llama", vocab_size=400), smollm2_tokenizer(), "tiny")


@lru_cache(maxsize=1)
def finished_folder() -> Path:
    """One complete regeneration, copied before each example (removed at exit)."""
    root = Path(tempfile.mkdtemp(prefix="headway-fuzz-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    regenerate(target(), ITEMS, root / "out", OPTIONS, mix={"test": 4})
    return root / "out"


def resume_with(damage: dict[str, bytes]) -> None:
    """Copy the finished folder, overwrite files with ``damage``, resume: works or DataError."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out"
        shutil.copytree(finished_folder(), out)
        for name, data in damage.items():
            (out / name).write_bytes(data)
        try:
            regenerate(target(), ITEMS, out, OPTIONS, mix={"test": 4})
        except DataError as error:
            assert "\n" not in str(error) and str(out) in str(error), str(error)


def gz(rows: list[Any]) -> bytes:
    return gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode())


@FUZZ
@given(st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_manifest(data: bytes) -> None:
    resume_with({"manifest.json": data})


@FUZZ
@given(
    st.binary(max_size=64)
    | st.lists(json_values, max_size=3).map(gz)
    | st.lists(json_values, max_size=3).map(lambda rows: gz(rows)[: len(gz(rows)) // 2])
)
def test_any_shard(data: bytes) -> None:
    resume_with({"data/part-00001.jsonl.gz": data})


@FUZZ
@given(st.lists(json_values, max_size=4).map(gz) | st.binary(max_size=32))
@example(gz([{"\n": None}]))  # a key with a line break once made a two-line error
def test_any_prompt_list(data: bytes) -> None:
    name = prompts_path(finished_folder()).relative_to(finished_folder())
    resume_with({str(name): data})


@FUZZ
@given(st.lists(json_values, max_size=4), st.integers(min_value=0, max_value=200))
def test_any_cut_json_list(rows: list[Any], cut: int) -> None:
    """A .json list cut anywhere: complete rows kept, or one DataError when none is usable."""
    text = json.dumps(
        [
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ]
            },
            *rows,
        ]
    )
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "chat.json"
        path.write_text(text[: max(1, len(text) - cut)], encoding="utf-8")
        try:
            samples, report = load_conversations(path, skip_bad_rows=True)
        except DataError as error:
            assert "\n" not in str(error)
        else:
            assert samples and "\n" not in report.summary()
