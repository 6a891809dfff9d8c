"""The native run format: round trip, atomic writes, clear errors, and target fingerprint checks."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import headway.heads.io as heads_io
from headway.drafters.medusa_drafter import MedusaDrafter
from headway.errors import HeadwayError, TargetError
from headway.heads.io import (
    HeadsError,
    load_heads,
    save_heads,
)
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.target import fingerprint
from tests.drafting import heads_drafter as load_drafter
from tests.tiny import TINY_VOCAB, tiny_model

CONFIG = MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def target() -> Any:
    return tiny_model("llama")


def trained_like_heads(target: Any, seed: int = 0) -> dict[str, Tensor]:
    """A Medusa state dict for ``target`` with every tensor non-trivial."""
    torch.manual_seed(seed)
    heads = MedusaHeads(CONFIG, target.get_output_embeddings().weight.detach())
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return heads.state_dict()


def save(directory: Path, target: Any, state: dict[str, Tensor], **overrides: Any) -> Path:
    arguments: dict[str, Any] = {
        "method": "medusa1",
        "head_config": CONFIG.to_dict(),
        "state_dict": state,
        "target_fingerprint": fingerprint(target),
        "target_name": "tiny-llama",
    }
    arguments.update(overrides)
    return save_heads(directory, **arguments)


def test_save_load_round_trip(tmp_path: Path, target: Any) -> None:
    state = trained_like_heads(target)
    run = save(tmp_path / "run", target, state)
    assert sorted(path.name for path in run.iterdir()) == ["config.json", "model.safetensors"]
    assert [path.name for path in tmp_path.iterdir()] == ["run"]  # no staging folder left
    config = json.loads((run / "config.json").read_text())
    assert config["method"] == "medusa1"
    assert config["head_config"] == CONFIG.to_dict()
    assert config["target"] == fingerprint(target).to_dict()
    assert config["target_name"] == "tiny-llama"
    assert config["headway_version"]

    loaded = load_heads(run)
    assert (loaded.method, loaded.head_config, loaded.target_name) == (
        "medusa1",
        CONFIG.to_dict(),
        "tiny-llama",
    )
    assert loaded.fingerprint == fingerprint(target)
    assert loaded.state_dict.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict[name], tensor), name


def test_resave_replaces_files_and_keeps_other_entries(tmp_path: Path, target: Any) -> None:
    run = save(tmp_path / "run", target, trained_like_heads(target, seed=0))
    (run / "training_state").mkdir()
    (run / "training_state" / "step.txt").write_text("100")
    newer = trained_like_heads(target, seed=1)
    save(run, target, newer)
    assert (run / "training_state" / "step.txt").read_text() == "100"
    loaded = load_heads(run)
    assert all(torch.equal(loaded.state_dict[name], tensor) for name, tensor in newer.items())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]


def crash_mid_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the next safetensors write leave half a file behind, then die."""

    def half_then_crash(tensors: dict[str, Tensor], filename: str, metadata: Any = None) -> None:
        Path(filename).write_bytes(b"\x00" * 100)
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(heads_io, "save_file", half_then_crash)


def test_a_crash_during_the_first_save_leaves_nothing(
    tmp_path: Path, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    crash_mid_write(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "run", target, trained_like_heads(target))
    assert list(tmp_path.iterdir()) == []


def test_a_crash_during_a_resave_keeps_the_old_heads(
    tmp_path: Path, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = trained_like_heads(target, seed=0)
    run = save(tmp_path / "run", target, old)
    crash_mid_write(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save(run, target, trained_like_heads(target, seed=1))
    loaded = load_heads(run)
    assert all(torch.equal(loaded.state_dict[name], tensor) for name, tensor in old.items())
    assert [path.name for path in tmp_path.iterdir()] == ["run"]


def test_weights_from_another_save_are_detected(tmp_path: Path, target: Any) -> None:
    """A kill between moving the weights and the config leaves a mixed pair; load refuses it."""
    first = save(tmp_path / "first", target, trained_like_heads(target, seed=0))
    second = save(tmp_path / "second", target, trained_like_heads(target, seed=1))
    (second / "model.safetensors").replace(first / "model.safetensors")
    with pytest.raises(HeadsError, match="not written together"):
        load_heads(first)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_weights_give_one_clear_error(tmp_path: Path, target: Any, damage: str) -> None:
    run = save(tmp_path / "run", target, trained_like_heads(target))
    weights = run / "model.safetensors"
    data = weights.read_bytes()
    damaged = {
        "truncate": data[: len(data) // 2],
        "garbage": b"not a safetensors file",
        "empty": b"",
    }
    weights.write_bytes(damaged[damage])
    with pytest.raises(HeadsError) as error:
        load_heads(run)
    message = str(error.value)
    assert "\n" not in message
    assert str(weights) in message and "corrupt or truncated" in message and "re-save" in message
    assert type(error.value.__cause__).__name__ == "SafetensorError"


def test_missing_folder_config_and_weights(tmp_path: Path, target: Any) -> None:
    with pytest.raises(HeadsError, match="no run directory"):
        load_heads(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsError, match=r"has no config\.json"):
        load_heads(tmp_path / "empty")
    run = save(tmp_path / "run", target, trained_like_heads(target))
    (run / "model.safetensors").unlink()
    with pytest.raises(HeadsError, match=r"model\.safetensors is missing"):
        load_heads(run)
    (run / "config.json").write_text("{not json")
    with pytest.raises(HeadsError, match="not valid JSON"):
        load_heads(run)


def test_unknown_method_is_refused(tmp_path: Path, target: Any) -> None:
    run = save(tmp_path / "run", target, trained_like_heads(target))
    config = json.loads((run / "config.json").read_text())
    config["method"] = "medusa9"
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match="unknown method 'medusa9'"):
        load_heads(run)
    with pytest.raises(HeadsError, match="unknown method"):
        save(tmp_path / "other", target, trained_like_heads(target), method="medusa9")


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path, target: Any) -> None:
    state = trained_like_heads(target)
    incomplete = {
        name: tensor for name, tensor in state.items() if name != "heads.1.lm_head.weight"
    }
    with pytest.raises(HeadsError, match=r"missing tensors \['heads.1.lm_head.weight'\]"):
        save(tmp_path / "a", target, incomplete)
    run = save(tmp_path / "run", target, state)
    config = json.loads((run / "config.json").read_text())
    config["head_config"]["num_heads"] = 3  # the file now lacks head 2
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match=r"missing tensors .*heads\.2\.blocks\.0\.linear\.bias"):
        load_heads(run)
    config["head_config"] = {**CONFIG.to_dict(), "hidden_size": 16}
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match="has shape"):
        load_heads(run)
    assert issubclass(HeadsError, HeadwayError)


def test_load_drafter_checks_the_target_fingerprint(
    tmp_path: Path, target: Any, caplog: pytest.LogCaptureFixture
) -> None:
    run = save(tmp_path / "run", target, trained_like_heads(target))
    drafter = load_drafter(run, target, choices=[[0], [0, 0]])
    assert isinstance(drafter, MedusaDrafter)
    assert drafter.hidden_layers == (target.config.num_hidden_layers,)

    other = tiny_model("llama", seed=7)  # same sizes, different weights
    with pytest.raises(TargetError) as error:
        load_drafter(run, other)
    message = str(error.value)
    assert fingerprint(target).output_embedding_sha256 in message
    assert fingerprint(other).output_embedding_sha256 in message
    with caplog.at_level(logging.WARNING):
        assert isinstance(load_drafter(run, other, force=True), MedusaDrafter)
    assert "--force" in caplog.text

    smaller = tiny_model("llama", vocab_size=64)
    with pytest.raises(HeadsError, match="not even with force"):
        load_drafter(run, smaller, force=True)


def test_weight_files_get_the_users_permissions(tmp_path: Path) -> None:
    import os

    from headway.heads.io import write_safetensors

    before = os.umask(0o022)
    try:
        write_safetensors(tmp_path / "model.safetensors", {"w": torch.zeros(2)})
    finally:
        os.umask(before)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load(bad: float) -> None:
    from headway.heads.io import check_tensors

    tensors = {"w": torch.tensor([1.0, bad]), "ids": torch.tensor([1, 2])}
    with pytest.raises(HeadsError, match="tensor w holds NaN or infinite values"):
        check_tensors(tensors, {"w": (2,), "ids": (2,)}, Path("run"))
    check_tensors(
        {"w": torch.ones(2), "ids": torch.tensor([1, 2])}, {"w": (2,), "ids": (2,)}, Path("run")
    )
