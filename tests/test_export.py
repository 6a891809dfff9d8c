"""Medusa exports: engine key names, shapes and config fields; import of published heads.

Expected layouts are written out by hand from the engines' sources (FasterDecoding/Medusa
``medusa/model/medusa_model.py``; vLLM ``model_executor/models/medusa.py`` and
``transformers_utils/configs/medusa.py``), not derived from headway's own key map.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from headway.heads.format_medusa import export_medusa, export_medusa_vllm, import_medusa
from headway.heads.io import HeadsError, LoadedHeads, load_heads, save_heads
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.target import TargetFingerprint

H, V, K, L = 8, 12, 2, 2
CONFIG = MedusaConfig(num_heads=K, num_layers=L, hidden_size=H, vocab_size=V)


class NotATensor:
    """Anything a pickle could smuggle in; ``weights_only`` loading must refuse it."""

    def __init__(self) -> None:
        self.payload = "arbitrary object"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A native run with K = 2 heads of L = 2 blocks, every tensor random."""
    torch.manual_seed(0)
    heads = MedusaHeads(CONFIG, torch.randn(V, H))
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    stamp = TargetFingerprint("LlamaForCausalLM", H, V, 2, "0" * 64)
    return save_heads(
        tmp_path / "run",
        method="medusa1",
        head_config=CONFIG.to_dict(),
        state_dict=heads.state_dict(),
        target_fingerprint=stamp,
        target_name="org/tiny-base",
    )


def logits_of(state_dict: dict[str, Tensor], config: MedusaConfig) -> Tensor:
    heads = MedusaHeads(config)
    heads.load_state_dict(state_dict)
    torch.manual_seed(1)
    with torch.no_grad():
        return heads(torch.randn(2, 3, config.hidden_size))


def test_reference_layout(run: Path, tmp_path: Path) -> None:
    out = export_medusa(run, tmp_path / "medusa")
    assert sorted(path.name for path in out.iterdir()) == [
        "config.json",
        "medusa_lm_head.safetensors",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config.pop("headway")["method"] == "medusa1"  # provenance; engines ignore it
    assert config == {
        "medusa_num_heads": 2,
        "medusa_num_layers": 2,
        "base_model_name_or_path": "org/tiny-base",
    }
    tensors = load_file(out / "medusa_lm_head.safetensors")
    expected: dict[str, tuple[int, ...]] = {}
    for h in range(K):
        for l in range(L):  # noqa: E741
            expected[f"{h}.{l}.linear.weight"] = (H, H)
            expected[f"{h}.{l}.linear.bias"] = (H,)
        expected[f"{h}.{L}.weight"] = (
            V,
            H,
        )  # the Sequential's last module: Linear(H, V, bias=False)
    assert {name: tuple(tensor.shape) for name, tensor in tensors.items()} == expected
    native = load_heads(run).state_dict
    assert torch.equal(tensors["1.1.linear.bias"], native["heads.1.blocks.1.linear.bias"])
    assert torch.equal(tensors["1.2.weight"], native["heads.1.lm_head.weight"])


def test_vllm_layout(run: Path, tmp_path: Path) -> None:
    out = export_medusa_vllm(run, tmp_path / "vllm")
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config.pop("headway")["target"] == load_heads(run).fingerprint.to_dict()
    assert config == {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": H,
        "vocab_size": V,
        "num_heads": K,
        "num_hidden_layers": L,
        "truncated_vocab_size": V,
        "medusa_fc_bias": True,
    }
    tensors = load_file(out / "model.safetensors")
    expected: dict[str, tuple[int, ...]] = {}
    for h in range(K):
        for l in range(L):  # noqa: E741
            expected[f"blocks.{h}.layers.{l}.weight"] = (H, H)
            expected[f"blocks.{h}.layers.{l}.bias"] = (H,)
        expected[f"lm_heads.{h}.weight"] = (V, H)
    assert {name: tuple(tensor.shape) for name, tensor in tensors.items()} == expected
    native = load_heads(run).state_dict
    assert torch.equal(
        tensors["blocks.0.layers.1.weight"], native["heads.0.blocks.1.linear.weight"]
    )


@pytest.mark.parametrize("exporter", [export_medusa, export_medusa_vllm])
def test_export_import_round_trip(run: Path, tmp_path: Path, exporter: object) -> None:
    out = exporter(run, tmp_path / "out")  # type: ignore[operator]
    imported = import_medusa(out)
    native = load_heads(run).state_dict
    assert imported.config == CONFIG
    assert imported.state_dict.keys() == native.keys()
    assert all(torch.equal(imported.state_dict[name], tensor) for name, tensor in native.items())
    assert torch.equal(logits_of(imported.state_dict, imported.config), logits_of(native, CONFIG))
    assert all(path.suffix in {".json", ".safetensors"} for path in out.iterdir())  # no code
    if exporter is export_medusa:
        assert imported.base_model_name_or_path == "org/tiny-base"


def test_reference_pt_is_read_with_weights_only(run: Path, tmp_path: Path) -> None:
    exported = load_file(export_medusa(run, tmp_path / "medusa") / "medusa_lm_head.safetensors")
    folder = tmp_path / "published"
    folder.mkdir()
    torch.save(exported, folder / "medusa_lm_head.pt")
    imported = import_medusa(folder)
    native = load_heads(run).state_dict
    assert all(torch.equal(imported.state_dict[name], tensor) for name, tensor in native.items())

    torch.save(
        {"0.1.weight": torch.zeros(V, H), "evil": NotATensor()}, folder / "medusa_lm_head.pt"
    )
    with pytest.raises(HeadsError, match="never unpickles arbitrary objects"):
        import_medusa(folder / "medusa_lm_head.pt")


def test_vllm_heads_without_bias_import_as_zero_bias(tmp_path: Path) -> None:
    tensors = {
        "blocks.0.layers.0.weight": torch.randn(H, H),
        "lm_heads.0.weight": torch.randn(V, H),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    imported = import_medusa(tmp_path / "model.safetensors")
    assert imported.config == MedusaConfig(1, 1, H, V)
    assert torch.equal(imported.state_dict["heads.0.blocks.0.linear.bias"], torch.zeros(H))


def test_import_errors_are_clear(run: Path, tmp_path: Path) -> None:
    out = export_medusa(run, tmp_path / "medusa")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "medusa_num_heads": 5}))
    with pytest.raises(HeadsError, match="declares num_heads = 5 but the tensors hold 2"):
        import_medusa(out)
    # a value that is not a number is quoted, so the error stays on one line (found by fuzzing)
    (out / "config.json").write_text(json.dumps({**config, "medusa_num_heads": "\n"}))
    with pytest.raises(HeadsError, match=r"declares num_heads = '\\n' but") as error:
        import_medusa(out)
    assert "\n" not in str(error.value)
    tensors = load_file(out / "medusa_lm_head.safetensors")
    del tensors["1.0.linear.bias"]
    save_file(tensors, out / "medusa_lm_head.safetensors")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match=r"missing \['1\.0\.linear\.bias'\]"):
        import_medusa(out)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(HeadsError, match="holds no Medusa heads"):
        import_medusa(tmp_path / "nothing")


def test_only_medusa_runs_export(run: Path, tmp_path: Path) -> None:
    loaded = load_heads(run)
    eagle = LoadedHeads("eagle1", {}, {}, loaded.fingerprint, loaded.target_name)
    with pytest.raises(HeadsError, match="cannot export 'eagle1'"):
        export_medusa(eagle, tmp_path / "out")
    assert not (tmp_path / "out").exists()
