"""Fuzzing the drafter loaders (issue #17, loaders): whatever a run folder's or a medusa /
medusa-vllm export's ``config.json`` says (absurd sizes, wrong types, missing keys), loading it
either works or stops with headway's own one-line error, before allocating what the file claims.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import shutil
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headway.errors import HeadwayError
from headway.heads.eagle import EagleConfig, EagleModel
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.format_eagle1 import export_eagle1
from headway.heads.format_eagle3 import export_eagle3
from headway.heads.format_medusa import export_medusa, export_medusa_vllm
from headway.heads.io import save_heads
from headway.heads.vocab import DraftVocab
from headway.target import fingerprint
from tests.drafting import heads_drafter as load_drafter
from tests.test_eagle3 import tiny4
from tests.test_eagle_drafter import save_run
from tests.test_heads_io import save, trained_like_heads
from tests.tiny import TINY_VOCAB, tiny_model

# Examples per loader test: 60 in the default run; HEADWAY_FUZZ_EXAMPLES=5000 for a long one.
EXAMPLES = int(os.environ.get("HEADWAY_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
values = st.one_of(
    st.sampled_from([10**12, 2**31, 2**63 - 1, 10**30, -(10**12)]),
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**62), max_value=2**62),
    st.sampled_from([0, 1, -1, 2**40, 10**12]),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=3),
)


@lru_cache(maxsize=1)
def folders() -> dict[str, Path]:
    """A run folder and its two Medusa exports, made once."""
    root = Path(tempfile.mkdtemp(prefix="headway-fuzz-heads-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    target = model()
    run = save(root / "run", target, trained_like_heads(target))
    torch.manual_seed(0)
    eagle_run = save_run(root / "eagle-run", target, EagleModel(EagleConfig.from_target(target)))
    draft3 = Eagle3Model(Eagle3Config.from_target(target4(), draft_vocab_size=32))
    draft3.set_vocab(DraftVocab.identity(32, TINY_VOCAB))
    eagle3_run = save_heads(
        root / "eagle3-run",
        method="eagle3",
        head_config=draft3.config.to_dict(),
        state_dict=draft3.state_dict(),
        target_fingerprint=fingerprint(target4()),
        target_name="tiny",
    )
    return {
        "run": run,
        "medusa": export_medusa(run, root / "medusa"),
        "medusa-vllm": export_medusa_vllm(run, root / "medusa-vllm"),
        "eagle1": export_eagle1(eagle_run, root / "eagle1"),
        "eagle3-hf": export_eagle3(eagle3_run, root / "eagle3-hf"),
    }


@lru_cache(maxsize=1)
def target4() -> Any:
    return tiny4("llama")


def target_for(layout: str) -> Any:
    return target4() if layout == "eagle3-hf" else model()


@lru_cache(maxsize=1)
def model() -> Any:
    return tiny_model("llama")


def loads_or_fails_in_one_line(load: Callable[[], object], what: str) -> None:
    """``load()`` works or raises one of headway's one-line errors, and the process grows by
    under 500 MB meanwhile (nothing allocated in proportion to what a file claims)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        load()
    except HeadwayError as error:
        assert "\n" not in str(error), str(error)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 500, f"{grown_mb:.0f} MB allocated for a tiny {what}"


def mutate(config: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``value`` at ``path`` (keys into nested objects), or delete it when value is ...;
    a path through a non-object stops early."""
    node: Any = config
    for key in path[:-1]:
        if not isinstance(node, dict) or not isinstance(node.get(key), dict):
            return
        node = node[key]
    if value is ...:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


def keys_of(config: dict[str, Any], prefix: list[str] | None = None) -> list[list[str]]:
    found = []
    for key, value in config.items():
        found.append([*(prefix or []), key])
        if isinstance(value, dict):
            found += keys_of(value, [*(prefix or []), key])
    return found


@FUZZ
@given(st.data())
def test_any_config_loads_or_fails_in_one_line(data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(sorted(folders())))
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / layout
        shutil.copytree(folders()[layout], folder)
        config = json.loads((folder / "config.json").read_text())
        for _ in range(data.draw(st.integers(1, 3))):
            path = data.draw(st.sampled_from(keys_of(config)))
            mutate(config, path, data.draw(values | st.just(...)))
        (folder / "config.json").write_text(json.dumps(config))
        loads_or_fails_in_one_line(lambda: load_drafter(folder, target_for(layout)), "drafter")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hidden_size", 10**12),  # once a traceback: the meta-device shapes overflowed
        ("num_heads", 2**40),  # once a hang eating 14 GB: 2^40 heads built on the meta device
        ("num_layers", 10**9),
    ],
)
def test_absurd_sizes_in_a_run_config_are_one_line_errors(key: str, value: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "run"
        shutil.copytree(folders()["run"], folder)
        config = json.loads((folder / "config.json").read_text())
        config["head_config"][key] = value
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(HeadwayError, match="invalid head_config") as caught:
            load_drafter(folder, model())
        assert "\n" not in str(caught.value)
