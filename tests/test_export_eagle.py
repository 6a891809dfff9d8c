"""``--format eagle1``: the reference layout's exact names and config, export -> import round trip
with identical tensors and identical drafts, decoding from a run directory and from an export,
reference-style folders (``pytorch_model.bin``, an ``embed_tokens`` copy), and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.cli import main
from headway.decode.generate import generate
from headway.drafters.eagle_drafter import EagleDrafter
from headway.errors import TargetError
from headway.heads.eagle import EagleConfig, EagleModel
from headway.heads.format_eagle1 import (
    export_eagle1,
    import_eagle1,
    reference_tensor_names,
)
from headway.heads.io import HeadsError, load_heads, save_heads
from headway.target import fingerprint
from tests.drafting import heads_drafter as load_drafter
from tests.test_eagle_drafter import PROMPT, TREE, fit_drafter, hf_greedy, save_run
from tests.tiny import TINY_VOCAB, tiny_model

H = 32
LAYER_NAMES = [
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
]


@pytest.fixture(scope="module")
def target() -> Any:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def truth(target: Any) -> list[int]:
    return hf_greedy(target, PROMPT, 24, eos=None)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, target: Any, truth: list[int]) -> Path:
    """A native run of a draft model briefly trained on the target's greedy continuation."""
    draft = fit_drafter(target, torch.cat([PROMPT, torch.tensor(truth)])[None], steps=120)
    return save_run(tmp_path_factory.mktemp("eagle") / "run", target, draft)


def test_layout_names_and_config(run: Path, tmp_path: Path) -> None:
    out = export_eagle1(run, tmp_path / "export")
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted(["fc.weight", "fc.bias", *LAYER_NAMES])
    assert tensors["fc.weight"].shape == (H, 2 * H) and tensors["fc.bias"].shape == (H,)
    assert tensors["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, H)  # 2 kv heads of 8
    assert tensors["layers.0.mlp.down_proj.weight"].shape == (H, 64)
    for absent in ("layers.0.input_layernorm.weight", "lm_head.weight", "embed_tokens.weight"):
        assert absent not in tensors
    config = json.loads((out / "config.json").read_text())
    headway_block = config.pop("headway")
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": H,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 256,
        "vocab_size": TINY_VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bias": True,
    }
    assert headway_block["method"] == "eagle1"
    assert headway_block["target_name"] == "org/tiny-llama"


def test_without_fc_bias(target: Any, tmp_path: Path) -> None:
    config = EagleConfig.from_target(target, fc_bias=False)
    run = save_run(tmp_path / "run", target, EagleModel(config))
    out = export_eagle1(run, tmp_path / "export")
    assert sorted(load_file(out / "model.safetensors")) == sorted(["fc.weight", *LAYER_NAMES])
    assert json.loads((out / "config.json").read_text())["bias"] is False
    assert reference_tensor_names(config) == ["fc.weight", *LAYER_NAMES]
    assert import_eagle1(out).config == config


def test_round_trip_gives_identical_tensors_and_drafts(
    run: Path, target: Any, truth: list[int], tmp_path: Path
) -> None:
    out = export_eagle1(run, tmp_path / "export")
    native = load_heads(run)
    imported = import_eagle1(out)
    assert imported.config == EagleConfig.from_dict(native.head_config)
    assert imported.fingerprint == native.fingerprint and imported.target_name == "org/tiny-llama"
    assert imported.state_dict.keys() == native.state_dict.keys()
    for name, tensor in native.state_dict.items():
        assert torch.equal(imported.state_dict[name], tensor), name
    from_run = load_drafter(run, target, **TREE)
    from_export = load_drafter(out, target, **TREE)  # an eagle1 folder loads directly
    assert isinstance(from_run, EagleDrafter) and isinstance(from_export, EagleDrafter)
    sequence = torch.cat([PROMPT, torch.tensor(truth[:4])])
    features = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    logits = []  # identical logits of the two drafters' draft models on the same pairs
    for drafter in (from_run, from_export):
        with torch.no_grad():
            predicted = drafter.model(
                features[None],
                drafter.head.embed_tokens(sequence[:3], torch.float32)[None],
                position_ids=torch.arange(3)[None],
                attention_mask=None,
            )
        logits.append(drafter.head.logits(predicted))
    assert torch.equal(logits[0], logits[1])
    results = [
        generate(target, PROMPT, drafter=drafter, max_new_tokens=24, eos_token_ids=())
        for drafter in (from_run, from_export)
    ]
    assert results[0].tokens == results[1].tokens == truth
    assert results[0].accept_lengths == results[1].accept_lengths
    assert results[0].tau > 2.0  # the trained drafter works after export


def test_reference_style_folder_loads(run: Path, target: Any, tmp_path: Path) -> None:
    """A published-style folder: ``pytorch_model.bin`` (read with weights_only) holding a copy of
    the embedding, a config without the ``bias`` key (reference default: true) and without a
    headway block (no fingerprint: sizes are still checked)."""
    native = load_heads(run)
    folder = tmp_path / "published"
    folder.mkdir()
    state = {**native.state_dict, "embed_tokens.weight": torch.zeros(TINY_VOCAB, H)}
    torch.save(state, folder / "pytorch_model.bin")
    config = json.loads((export_eagle1(run, tmp_path / "e") / "config.json").read_text())
    del config["bias"], config["headway"], config["head_dim"]
    (folder / "config.json").write_text(json.dumps(config))
    imported = import_eagle1(folder)
    assert imported.fingerprint is None and imported.config.fc_bias is True
    assert imported.config.head_dim == 8  # hidden / heads
    assert "embed_tokens.weight" not in imported.state_dict
    drafter = load_drafter(folder, target, **TREE)
    assert drafter.propose(PROMPT).size == 0  # a working drafter, nothing observed yet
    with pytest.raises(HeadsError, match="not even with force"):
        load_drafter(folder, tiny_model("llama", vocab_size=64))


def test_errors_are_clear(run: Path, target: Any, tmp_path: Path) -> None:
    out = export_eagle1(run, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "bias": False}))
    with pytest.raises(HeadsError, match=r"bias=false but fc\.bias is present"):
        import_eagle1(out)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    (out / "config.json").write_text(json.dumps({**config, "rope_scaling": rope}))
    assert import_eagle1(out).config.rope_scaling == rope  # a scaled target's drafter (#16)
    (out / "config.json").write_text(
        json.dumps({**config, "rope_scaling": {"rope_type": "llama3"}})
    )
    with pytest.raises(HeadsError, match=r"not a layer transformers can build .*rope_parameters"):
        import_eagle1(out)
    (out / "config.json").write_text(
        json.dumps({**config, "rope_scaling": None, "rope_parameters": {"rope_type": None}})
    )
    with pytest.raises(HeadsError, match="rope_type 'None', which transformers does not build"):
        import_eagle1(out)  # the fuzzer's find: a KeyError deep in the rotary layer before
    (out / "config.json").write_text(json.dumps({**config, "rope_scaling": "llama3"}))
    with pytest.raises(HeadsError, match="rope_scaling 'llama3' is not an object"):
        import_eagle1(out)
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(HeadsError, match=r"missing tensors \['layers.0.mlp.up_proj.weight'\]"):
        import_eagle1(out)
    other = tiny_model("llama", seed=7)  # same sizes, another LM head: the fingerprint differs
    with pytest.raises(TargetError, match="another target"):
        load_drafter(run, other)
    with pytest.raises(TargetError, match="another target"):
        load_drafter(export_eagle1(run, tmp_path / "again"), other)


def test_medusa_runs_do_not_export_as_eagle1(target: Any, tmp_path: Path) -> None:
    from headway.heads.medusa import MedusaConfig, MedusaHeads

    config = MedusaConfig(1, 1, H, TINY_VOCAB)
    medusa = save_heads(
        tmp_path / "medusa",
        method="medusa1",
        head_config=config.to_dict(),
        state_dict=MedusaHeads(config).state_dict(),
        target_fingerprint=fingerprint(target),
        target_name="t",
    )
    with pytest.raises(HeadsError, match="cannot export 'medusa1' heads as eagle1"):
        export_eagle1(medusa, tmp_path / "out")


def test_cli_export(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(run), "--format", "eagle1", "--out", str(tmp_path / "cli")]) == 0
    assert "eagle1" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model.safetensors").is_file()
