"""The engine-format protocol: every registered format writes a run, is the only format that
detects what it wrote, reads back the identical tensors, and is found by ``find_heads`` and
``heads_family`` under the method that decodes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from headway.heads.eagle import EagleConfig, EagleModel
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.io import DRAFTER_METHODS, load_heads, save_heads
from headway.heads.loading import ENGINE_FORMATS, detect_format, find_heads, heads_family
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.target import fingerprint
from tests.test_eagle3 import tiny4

RUN_METHOD = {"medusa": "medusa1", "medusa-vllm": "medusa1", "eagle1": "eagle1"}
RUN_METHOD["eagle3-hf"] = RUN_METHOD["speculators"] = "eagle3"


@pytest.fixture(scope="module")
def target() -> Any:
    return tiny4("llama")  # EAGLE-3 fuses three distinct layers: at least 4


def random_run(directory: Path, method: str, target: Any) -> Path:
    """A run directory of ``method`` with random weights sized for ``target``."""
    torch.manual_seed(0)
    text = target.config.get_text_config()
    config: MedusaConfig | EagleConfig | Eagle3Config
    model: Any
    if method == "medusa1":
        config = MedusaConfig(2, 1, int(text.hidden_size), int(text.vocab_size))
        model = MedusaHeads(config)
    elif method == "eagle1":
        config = EagleConfig.from_target(target)
        model = EagleModel(config)
    else:
        config = Eagle3Config.from_target(target, draft_vocab_size=int(text.vocab_size))
        model = Eagle3Model(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter))
    return save_heads(
        directory,
        method=method,
        head_config=config.to_dict(),
        state_dict=model.state_dict(),
        target_fingerprint=fingerprint(target),
        target_name="org/tiny-llama",
    )


def test_the_registry_names_the_five_engine_formats() -> None:
    assert sorted(ENGINE_FORMATS) == ["eagle1", "eagle3-hf", "medusa", "medusa-vllm", "speculators"]
    assert all(engine.method in DRAFTER_METHODS for engine in ENGINE_FORMATS.values())


@pytest.mark.parametrize("name", sorted(RUN_METHOD))
def test_write_detect_read_round_trip(name: str, target: Any, tmp_path: Path) -> None:
    engine = ENGINE_FORMATS[name]
    run = random_run(tmp_path / "run", RUN_METHOD[name], target)
    assert detect_format(run) is None  # a run directory is not an engine format
    out = engine.write(load_heads(run), tmp_path / name)
    assert [other.name for other in ENGINE_FORMATS.values() if other.detect(out)] == [name]
    native = load_heads(run).state_dict
    layers = int(target.config.num_hidden_layers)
    read = engine.read(out, layers)
    assert read.fingerprint == fingerprint(target)
    assert sorted(read.state_dict) == sorted(native)
    for key, tensor in native.items():
        assert torch.equal(read.state_dict[key], tensor), key
    found = find_heads(out, target)
    assert found.method == engine.method
    assert heads_family(out) == DRAFTER_METHODS[engine.method].family == heads_family(run)


def test_an_empty_folder_is_no_format(tmp_path: Path) -> None:
    assert detect_format(tmp_path) is None
