"""``--format speculators``: the config keys and types speculators defines and vLLM reads, the
tensor names of speculators' ``Eagle3DraftModel``, export -> import with identical tensors and
output, folders written the way speculators writes them, and one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from headway.cli import main
from headway.decode.generate import generate
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.errors import TargetError
from headway.heads.eagle import EagleConfig, EagleModel
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.format_speculators import (
    SPECULATORS,
    SPECULATORS_SCHEMA,
    export_speculators,
    import_speculators,
    schema_errors,
    speculators_tensor_names,
)
from headway.heads.io import HeadsError, load_heads, save_heads
from headway.heads.loading import ENGINE_FORMATS, detect_format, heads_family
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.target import fingerprint
from tests.drafting import heads_drafter as load_drafter
from tests.test_eagle3 import PROMPT, TAPS, TREE, target_and_truth, tiny4, trained

H, V, N = 32, 96, 64

# What vLLM requires of a speculators config.json before it serves it (no defaults): vLLM
# vllm/transformers_utils/configs/speculators/base.py, SpeculatorsConfig.validate_speculators_config
# and build_vllm_speculative_config; update_eagle3 in algos.py reads the EAGLE-3 fields.
VLLM_REQUIRED: list[tuple[str | int, ...]] = [
    ("speculators_model_type",),
    ("speculators_config", "proposal_methods", 0, "speculative_tokens"),
    ("speculators_config", "verifier", "name_or_path"),
    ("transformer_layer_config",),
    ("draft_vocab_size",),
    ("norm_before_residual",),  # vLLM reads a missing key as true: it must be written
]

# speculators' Eagle3DraftModel state dict (src/speculators/models/eagle3/core.py, model.py's
# DraftVocabMixin), less what it never saves (verifier_*) or may leave out (embed_tokens).
SPECULATORS_NAMES = sorted(
    [
        "fc.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.post_attention_layernorm.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    ]
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A native run of an EAGLE-3 drafter (draft vocabulary 64 of 96) briefly trained on the
    target's greedy continuation."""
    model, _ = target_and_truth("llama")
    draft = trained("llama")
    return save_heads(
        tmp_path_factory.mktemp("speculators") / "run",
        method="eagle3",
        head_config=draft.config.to_dict(),
        state_dict=draft.state_dict(),
        target_fingerprint=fingerprint(model),
        target_name="org/tiny-llama",
    )


def _value(config: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    value: Any = config
    for step in path:
        value = value[step]
    return value


def test_config_has_every_key_speculators_defines_and_vllm_requires(
    run: Path, tmp_path: Path
) -> None:
    out = export_speculators(run, tmp_path / "export")
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert schema_errors(config) == []
    for path, types in SPECULATORS_SCHEMA.items():  # the same check, spelled out
        value = _value(config, path)
        assert isinstance(value, types) and (isinstance(value, bool) == (bool in types)), path
    for path in VLLM_REQUIRED:
        assert _value(config, path) is not None, path
    assert config["speculators_model_type"] == "eagle3" and config["speculators_version"]
    assert config["architectures"] == ["Eagle3DraftModel"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
         "accept_tolerance": 0.0}
    ]  # fmt: skip
    # SpeculatorsConfig.check_default_proposal_method: the default names one of the methods
    assert spec["default_proposal_method"] in [m["proposal_type"] for m in spec["proposal_methods"]]
    assert spec["verifier"] == {
        "name_or_path": "org/tiny-llama",
        "architectures": ["LlamaForCausalLM"],
    }
    assert config["draft_vocab_size"] == N and config["target_hidden_size"] == H
    assert config["eagle_aux_hidden_state_layer_ids"] == list(TAPS)  # inputs of target layers
    flags = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    assert [config[flag] for flag in (*flags, "embed_requires_grad")] == [False] * 5
    assert config["headway"]["method"] == "eagle3"
    assert config["headway"]["feature_layers"] == list(TAPS)


def test_layer_config_builds_the_llama_config_speculators_builds(run: Path, tmp_path: Path) -> None:
    """Eagle3SpeculatorConfig.validate_transformer_config: AutoConfig.for_model(model_type)."""
    layer = json.loads((export_speculators(run, tmp_path / "e") / "config.json").read_text())[
        "transformer_layer_config"
    ]
    built = type(AutoConfig.for_model(model_type=layer["model_type"]))(**layer)
    assert type(built).__name__ == "LlamaConfig"
    native = Eagle3Config.from_dict(load_heads(run).head_config)
    assert (built.hidden_size, built.intermediate_size, built.num_hidden_layers) == (H, 64, 1)
    assert (built.num_attention_heads, built.num_key_value_heads, built.head_dim) == (4, 2, 8)
    assert built.vocab_size == V and built.rms_norm_eps == native.rms_norm_eps
    assert built.rope_parameters["rope_theta"] == native.rope_theta
    assert not built.attention_bias and not built.mlp_bias and not built.tie_word_embeddings


def test_schema_check_names_missing_and_mistyped_keys(run: Path, tmp_path: Path) -> None:
    config = json.loads((export_speculators(run, tmp_path / "e") / "config.json").read_text())
    del config["speculators_config"]["verifier"]["name_or_path"]
    config["norm_before_residual"] = 0
    config["draft_vocab_size"] = True
    assert schema_errors(config) == [
        "speculators_config.verifier.name_or_path is missing",
        "draft_vocab_size=True is not int",
        "norm_before_residual=0 is not bool",
    ]
    assert schema_errors(config, missing_ok=True)[0].startswith("draft_vocab_size")


def test_tensor_names_and_shapes_are_speculators(run: Path, tmp_path: Path) -> None:
    out = export_speculators(run, tmp_path / "export")
    tensors = load_file(out / "model.safetensors")
    config = Eagle3Config.from_dict(load_heads(run).head_config)
    assert sorted(tensors) == SPECULATORS_NAMES == speculators_tensor_names(config)
    assert tensors["fc.weight"].shape == (H, 3 * H)
    for name in "qkv":  # the attention reads [norm(embedding); norm(feature)]: 2H wide
        assert tensors[f"layers.0.self_attn.{name}_proj.weight"].shape[1] == 2 * H
    assert tensors["layers.0.self_attn.o_proj.weight"].shape == (H, H)
    assert tensors["layers.0.hidden_norm.weight"].shape == (H,)
    assert tensors["lm_head.weight"].shape == (N, H)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (N,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (V,)
    assert int(tensors["t2d"].sum()) == N


def test_round_trip_is_detected_and_decodes_like_the_run(run: Path, tmp_path: Path) -> None:
    model, truth = target_and_truth("llama")
    out = export_speculators(run, tmp_path / "export")
    assert detect_format(out) is SPECULATORS and detect_format(run) is None
    assert [engine.name for engine in ENGINE_FORMATS.values() if engine.detect(out)] == [
        "speculators"
    ]
    assert heads_family(out) == "eagle"
    native, imported = load_heads(run), import_speculators(out)
    assert imported.config == Eagle3Config.from_dict(native.head_config)
    assert imported.fingerprint == native.fingerprint
    assert imported.state_dict.keys() == native.state_dict.keys()
    for name, tensor in native.state_dict.items():
        assert imported.state_dict[name].dtype == tensor.dtype, name
        assert torch.equal(imported.state_dict[name], tensor), name
    from_run, from_export = load_drafter(run, model, **TREE), load_drafter(out, model, **TREE)
    assert isinstance(from_export, Eagle3Drafter)
    results = [
        generate(model, PROMPT, drafter=drafter, max_new_tokens=24, eos_token_ids=())
        for drafter in (from_run, from_export)
    ]
    assert results[0].tokens == results[1].tokens == truth[:24]  # fp32 greedy: lossless
    assert results[0].accept_lengths == results[1].accept_lengths
    assert results[0].tau > 2.0


def test_full_vocabulary_has_no_maps_and_reads_back(tmp_path: Path) -> None:
    """speculators registers d2t/t2d only for a reduced draft vocabulary."""
    model: Any = tiny4("llama")
    config = Eagle3Config.from_target(model, draft_vocab_size=V)
    torch.manual_seed(0)
    native = Eagle3Model(config).state_dict()
    run = save_heads(
        tmp_path / "run",
        method="eagle3",
        head_config=config.to_dict(),
        state_dict=native,
        target_fingerprint=fingerprint(model),
        target_name="org/tiny-llama",
    )
    out = export_speculators(run, tmp_path / "export")
    assert sorted(load_file(out / "model.safetensors")) == speculators_tensor_names(config)
    assert "d2t" not in speculators_tensor_names(config)
    imported = import_speculators(out)
    for name, tensor in native.items():
        assert torch.equal(imported.state_dict[name], tensor), name


def test_a_folder_as_speculators_writes_it_loads(run: Path, tmp_path: Path) -> None:
    """No headway block, an ``embed_tokens`` copy, no ``t2d``, rope as transformers 5 writes it
    (``rope_parameters``), extra keys speculators' to_dict adds."""
    model, truth = target_and_truth("llama")
    out = export_speculators(run, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    del config["headway"]
    layer = config["transformer_layer_config"]
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": layer.pop("rope_theta")}
    del layer["rope_scaling"]
    config.update(dtype="float32", transformers_version="5.0.0")
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    del tensors["t2d"]
    save_file({**tensors, "embed_tokens.weight": torch.zeros(V, H)}, out / "model.safetensors")
    imported = import_speculators(out)
    assert isinstance(imported.config, Eagle3Config) and imported.config.feature_layers == TAPS
    assert imported.fingerprint is None
    assert torch.equal(imported.state_dict["t2d"], load_heads(run).state_dict["t2d"])
    assert "embed_tokens.weight" not in imported.state_dict
    drafter = load_drafter(out, model, **TREE)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=12, eos_token_ids=())
    assert result.tokens == truth[:12]
    del config["eagle_aux_hidden_state_layer_ids"]  # speculators' default for the target's depth
    (out / "config.json").write_text(json.dumps(config))
    assert import_speculators(out, target_layers=4).config == imported.config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"speculators_model_type": "dflash"}, "speculators_model_type 'dflash'"),
        ({"norm_before_residual": True}, "does not implement \\['norm_before_residual'\\]"),
        ({"norm_before_residual": None}, "names no norm_before_residual"),
        ({"norm_before_fc": True}, "does not implement \\['norm_before_fc'\\]"),
        ({"fc_norm": True}, "missing.*fc_norm.0.weight"),  # EAGLE-3.1 reads, if its norms are there
        ({"draft_vocab_size": "64"}, "draft_vocab_size='64' is not int"),
    ],
)
def test_variants_headway_cannot_reproduce_are_refused(
    run: Path, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    out = export_speculators(run, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    config.update(change)
    config = {key: value for key, value in config.items() if value is not None}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match=message):
        import_speculators(out)


def test_qwen3_layers_and_wrong_targets_are_refused(run: Path, tmp_path: Path) -> None:
    out = export_speculators(run, tmp_path / "export")
    with pytest.raises(TargetError, match="another target"):
        load_drafter(out, tiny4("llama", seed=7))
    config = json.loads((out / "config.json").read_text())
    config["transformer_layer_config"]["model_type"] = "qwen3"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match="model_type 'qwen3' is not 'llama'"):
        import_speculators(out)


def _medusa_and_eagle1_runs(tmp_path: Path) -> dict[str, Path]:
    model: Any = tiny4("llama")
    medusa_config, eagle_config = MedusaConfig(1, 1, H, V), EagleConfig.from_target(model)
    made: dict[str, tuple[Any, torch.nn.Module]] = {
        "medusa1": (medusa_config, MedusaHeads(medusa_config)),
        "eagle1": (eagle_config, EagleModel(eagle_config)),
    }
    return {
        method: save_heads(
            tmp_path / method,
            method=method,
            head_config=config.to_dict(),
            state_dict=heads.state_dict(),
            target_fingerprint=fingerprint(model),
            target_name="t",
        )
        for method, (config, heads) in made.items()
    }


def test_other_methods_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = _medusa_and_eagle1_runs(tmp_path)
    expected = {"medusa1": ("medusa", "medusa-vllm"), "eagle1": ("eagle1",)}
    for method, run in runs.items():
        with pytest.raises(HeadsError) as error:
            export_speculators(run, tmp_path / "out")
        text = str(error.value)
        assert "\n" not in text and f"cannot export {method!r} heads as speculators" in text
        assert f"use --format {' or '.join(expected[method])}" in text
        assert all(ENGINE_FORMATS[name].method == method for name in expected[method])
    command = ["export", str(runs["medusa1"]), "--format", "speculators", "--out"]
    assert main([*command, str(tmp_path / "cli")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "EAGLE-3 drafters only" in lines[0]
    assert not (tmp_path / "cli").exists()


def test_cli_export_and_help(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(run), "--format", "speculators", "--out", str(tmp_path / "c")]) == 0
    assert "as speculators" in capsys.readouterr().out
    assert detect_format(tmp_path / "c") is SPECULATORS
    with pytest.raises(SystemExit) as done:
        main(["export", "--help"])
    assert done.value.code == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert f"speculators  {SPECULATORS.summary}" in lines
