"""``--format eagle3-hf``: the engines' exact tensor names and config, export -> import with
identical tensors and logits, decoding from a run directory and from an export, reference-style
folders (``pytorch_model.bin``, SGLang-convention layer ids, no ``t2d``), and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.cli import main
from headway.decode.generate import generate
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.errors import TargetError
from headway.heads.eagle3 import Eagle3Config
from headway.heads.format_eagle3 import (
    eagle3_hf_config,
    export_eagle3,
    import_eagle3,
    reference_tensor_names,
)
from headway.heads.io import HeadsError, load_heads, save_heads
from headway.target import fingerprint
from tests.drafting import heads_drafter as load_drafter
from tests.test_eagle3 import ENGINE_NAMES, PROMPT, TAPS, TREE, target_and_truth, tiny4, trained

H, V = 32, 96


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A native run of an EAGLE-3 drafter briefly trained on the target's greedy continuation."""
    model, _ = target_and_truth("llama")
    draft = trained("llama")
    return save_heads(
        tmp_path_factory.mktemp("eagle3") / "run",
        method="eagle3",
        head_config=draft.config.to_dict(),
        state_dict=draft.state_dict(),
        target_fingerprint=fingerprint(model),
        target_name="org/tiny-llama",
    )


def test_layout_names_shapes_and_config(run: Path, tmp_path: Path) -> None:
    out = export_eagle3(run, tmp_path / "export")
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == ENGINE_NAMES == sorted(reference_tensor_names())
    assert tensors["fc.weight"].shape == (H, 3 * H)
    for name in "qkv":  # the attention reads [norm(embedding); norm(feature)]: 2H wide
        assert tensors[f"midlayer.self_attn.{name}_proj.weight"].shape[1] == 2 * H
    assert tensors["midlayer.self_attn.o_proj.weight"].shape == (H, H)
    assert tensors["lm_head.weight"].shape == (64, H)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (64,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (V,)
    assert int(tensors["t2d"].sum()) == 64
    config = json.loads((out / "config.json").read_text())
    block = config.pop("headway")
    assert config == {
        "architectures": ["LlamaForCausalLMEagle3"],
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
        "vocab_size": V,
        "draft_vocab_size": 64,
        "target_hidden_size": H,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],  # vLLM: inputs of these target layers
        "eagle_config": {  # SGLang / SpecForge: outputs of these target layers (the same tensors)
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
        },
    }
    assert block["method"] == "eagle3" and block["feature_layers"] == list(TAPS)
    assert block["target_name"] == "org/tiny-llama"


def test_default_layers_of_a_30_layer_target_in_both_conventions() -> None:
    """SmolLM2 (30 layers): vLLM's default (2, 15, 27) = SpecForge's default (1, 14, 26)."""
    config = Eagle3Config(576, 1536, 9, 3, 64, 49152, 8192, (2, 15, 27))
    engine = eagle3_hf_config(config, torch.bfloat16)
    assert engine["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert engine["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert engine["torch_dtype"] == "bfloat16" and "headway" not in engine


def test_round_trip_gives_identical_tensors_logits_and_output(run: Path, tmp_path: Path) -> None:
    model, truth = target_and_truth("llama")
    out = export_eagle3(run, tmp_path / "export")
    native, imported = load_heads(run), import_eagle3(out)
    assert imported.config == Eagle3Config.from_dict(native.head_config)
    assert imported.fingerprint == native.fingerprint
    assert imported.state_dict.keys() == native.state_dict.keys()
    for name, tensor in native.state_dict.items():
        assert imported.state_dict[name].dtype == tensor.dtype, name
        assert torch.equal(imported.state_dict[name], tensor), name
    from_run, from_export = load_drafter(run, model, **TREE), load_drafter(out, model, **TREE)
    assert isinstance(from_run, Eagle3Drafter) and isinstance(from_export, Eagle3Drafter)
    generator = torch.Generator().manual_seed(0)
    features, embeddings = torch.randn(1, 5, 3 * H, generator=generator), torch.randn(1, 5, H)
    logits = []
    for drafter in (from_run, from_export):
        with torch.no_grad():
            states = drafter.draft3(drafter.draft3.fuse(features), embeddings)
            logits.append(drafter.draft3.logits(states))
    assert torch.equal(logits[0], logits[1])
    results = [
        generate(model, PROMPT, drafter=drafter, max_new_tokens=24, eos_token_ids=())
        for drafter in (from_run, from_export)
    ]
    assert results[0].tokens == results[1].tokens == truth[:24]
    assert results[0].accept_lengths == results[1].accept_lengths
    assert results[0].tau > 2.0  # the trained drafter still works after export


def test_reference_style_folder_loads(run: Path, tmp_path: Path) -> None:
    """A published-style folder: ``pytorch_model.bin`` with an ``embed_tokens`` copy and no
    ``t2d`` (engines ignore it), a config with SGLang-convention ids only, no headway block."""
    model, truth = target_and_truth("llama")
    native = load_heads(run)
    folder = tmp_path / "published"
    folder.mkdir()
    state = {k: v for k, v in native.state_dict.items() if k != "t2d"}
    torch.save({**state, "embed_tokens.weight": torch.zeros(V, H)}, folder / "pytorch_model.bin")
    config = json.loads((export_eagle3(run, tmp_path / "e") / "config.json").read_text())
    del config["headway"], config["eagle_aux_hidden_state_layer_ids"]
    (folder / "config.json").write_text(json.dumps(config))
    imported = import_eagle3(folder)
    assert imported.fingerprint is None and imported.config.feature_layers == TAPS
    assert torch.equal(imported.state_dict["t2d"], native.state_dict["t2d"])  # rebuilt from d2t
    assert "embed_tokens.weight" not in imported.state_dict
    del config["eagle_config"]  # no ids at all: the engines' default for the target's depth
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match="names no feature layers"):
        import_eagle3(folder)
    drafter = load_drafter(folder, model, **TREE)
    assert isinstance(drafter, Eagle3Drafter) and drafter.hidden_layers == TAPS
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=12, eos_token_ids=())
    assert result.tokens == truth[:12]


def test_errors_are_clear(run: Path, tmp_path: Path) -> None:
    out = export_eagle3(run, tmp_path / "export")
    tensors = load_file(out / "model.safetensors")
    broken = dict(tensors)
    broken["t2d"] = broken["t2d"].clone()
    broken["t2d"][int((~broken["t2d"]).nonzero()[0, 0])] = True
    save_file(broken, out / "model.safetensors")
    with pytest.raises(HeadsError, match="different vocabularies"):
        import_eagle3(out)
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(HeadsError, match=r"missing tensors \['midlayer.hidden_norm.weight'\]"):
        import_eagle3(out)
    other = tiny4("llama", seed=7)  # same sizes, another LM head: the fingerprint differs
    with pytest.raises(TargetError, match="another target"):
        load_drafter(run, other)
    with pytest.raises(TargetError, match="another target"):
        load_drafter(export_eagle3(run, tmp_path / "again"), other)
    with pytest.raises(HeadsError, match="not even with force"):
        load_drafter(run, tiny4("llama", vocab_size=64), force=True)


def test_other_methods_do_not_export_as_eagle3(tmp_path: Path) -> None:
    from headway.heads.medusa import MedusaConfig, MedusaHeads

    model: Any = tiny4("llama")
    config = MedusaConfig(1, 1, H, V)
    medusa = save_heads(
        tmp_path / "medusa",
        method="medusa1",
        head_config=config.to_dict(),
        state_dict=MedusaHeads(config).state_dict(),
        target_fingerprint=fingerprint(model),
        target_name="t",
    )
    with pytest.raises(HeadsError, match="cannot export 'medusa1' heads as eagle3-hf"):
        export_eagle3(medusa, tmp_path / "out")


def test_cli_export(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command = ["export", str(run), "--format", "eagle3-hf", "--out", str(tmp_path / "cli")]
    assert main(command) == 0
    assert "eagle3-hf" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model.safetensors").is_file()


def test_cli_export_in_bfloat16_halves_the_weights_and_stays_lossless(
    run: Path, tmp_path: Path
) -> None:
    model, truth = target_and_truth("llama")
    out = tmp_path / "bf16"
    command = ["export", str(run), "--format", "eagle3-hf", "--out", str(out)]
    assert main([*command, "--dtype", "bfloat16"]) == 0
    assert main(["export", str(run), "--format", "eagle3-hf", "--out", str(tmp_path / "fp32")]) == 0
    tensors = load_file(out / "model.safetensors")
    assert {name: t.dtype for name, t in tensors.items() if not t.is_floating_point()} == {
        "d2t": torch.int64,
        "t2d": torch.bool,
    }
    assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    fp32_size = (tmp_path / "fp32" / "model.safetensors").stat().st_size
    assert (out / "model.safetensors").stat().st_size < 0.6 * fp32_size
    drafter = load_drafter(out, model, **TREE)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=24, eos_token_ids=())
    assert result.tokens == truth[:24]
    assert main([*command[:-1], str(tmp_path / "x"), "--dtype", "float16"]) == 0
