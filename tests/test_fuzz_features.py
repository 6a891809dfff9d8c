"""Fuzzing the feature-cache reader (issue #17, loaders): whatever a cache's ``manifest.json``
says, and whatever a shard's safetensors header claims, reading every sample either works or
stops with headway's own one-line error, before allocating what the files claim."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import datasets
from hypothesis import given
from hypothesis import strategies as st

from headway.errors import HeadwayError
from headway.train.features import CachedFeatureDataset, cache_features
from headway.train.packed_features import collate_cached
from tests.test_fuzz_heads import FUZZ, keys_of, loads_or_fails_in_one_line, mutate, values
from tests.test_fuzz_safetensors import lie, split
from tests.tiny import tiny_model


@lru_cache(maxsize=1)
def cache() -> Path:
    """A complete cache of five samples in two shards, made once."""
    root = Path(tempfile.mkdtemp(prefix="headway-fuzz-features-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    rows = [
        {"input_ids": list(range(5, 5 + n)), "loss_mask": [0] + [1] * (n - 1)}
        for n in (4, 6, 3, 5, 7)
    ]
    dataset = datasets.Dataset.from_list(rows)
    cache_features(tiny_model("llama"), dataset, root / "cache", layers=(1, 2), shard_samples=3)
    return root / "cache"


def read_all(folder: Path) -> int:
    """Every sample of the cache, collated two at a time; the number of tokens read."""
    dataset = CachedFeatureDataset(folder)
    rows = [dataset[index] for index in range(len(dataset))]
    tokens = 0
    for start in range(0, len(rows), 2):
        batch = collate_cached(rows[start : start + 2], pad_token_id=0)
        tokens += int(batch["input_ids"].numel())
    return tokens


def check(folder: Path) -> None:
    loads_or_fails_in_one_line(lambda: read_all(folder), "cache")


def test_the_untouched_cache_reads_back() -> None:
    assert read_all(cache()) > 0


@FUZZ
@given(st.data())
def test_any_manifest_reads_or_fails_in_one_line(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "cache"
        shutil.copytree(cache(), folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        for _ in range(data.draw(st.integers(1, 3))):
            path = data.draw(st.sampled_from(keys_of(manifest)))
            mutate(manifest, path, data.draw(values | st.just(...)))
        (folder / "manifest.json").write_text(json.dumps(manifest))
        check(folder)


@FUZZ
@given(st.data(), st.sampled_from(["shard-00000.safetensors", "shard-00001.safetensors"]))
def test_any_lying_shard_reads_or_fails_in_one_line(data: st.DataObject, shard: str) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "cache"
        shutil.copytree(cache(), folder)
        header, body = split((folder / shard).read_bytes())
        (folder / shard).write_bytes(lie(data, header, body))
        check(folder)


def test_a_manifest_that_is_not_json_is_one_line() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "cache"
        shutil.copytree(cache(), folder)
        (folder / "manifest.json").write_text('{"settings": ')
        try:
            CachedFeatureDataset(folder)
        except HeadwayError as error:
            assert "is not valid JSON" in str(error) and "\n" not in str(error)
        else:
            raise AssertionError("a cut manifest was read")
