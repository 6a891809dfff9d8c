"""``headway plan`` (headway/footprint): estimates held to measured steps, hand arithmetic for a
Llama-3.1-8B-shaped config, the feature cache's real layout, and the command line.

Measured steps (tests/footprint_measure.py): parameter, gradient and optimizer bytes are
exact; activations and the total within 20% (measured: live tensor bytes of a real step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from headway.cli import build_parser, main
from headway.config import load_config
from headway.footprint import RunPlan, build_plan, plan_json
from headway.footprint.disk import feature_cache_size, regeneration_seconds
from headway.footprint.regen_speed import measure_tokens_per_s
from headway.footprint.sizes import feature_layers, meta_target
from headway.run_config import RunConfig
from headway.target import Target
from headway.train.features import cache_features
from tests.footprint_measure import LiveBytes, Measured, measure_step
from tests.tiny import tiny_config, tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EAGLE3_RECIPE = str(ROOT / "configs" / "eagle3-smollm2.yaml")
TINY_STEP = ["train.batch_size=2", "data.max_length=96"]


def _tiny_target(layers: int = 4) -> Any:
    """A 4-layer tiny Llama (EAGLE-3 needs three distinct layer inputs), fp32."""
    config = tiny_config("llama", vocab_size=400)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _rows(plan: RunPlan) -> dict[str, int]:
    return {row.name: row.today for row in plan.memory.rows}


def _check(plan: RunPlan, measured: Measured) -> None:
    rows = _rows(plan)
    assert rows["target weights"] == measured.weights
    assert plan.drafter.parameters * 4 == measured.parameters
    assert rows["gradients"] == measured.gradients
    assert rows["optimizer state"] == measured.optimizer
    assert rows["activations (peak)"] == pytest.approx(measured.activations, rel=0.2)
    assert plan.memory.total == pytest.approx(measured.total, rel=0.2)


def test_live_bytes_counts_what_a_step_allocates_once() -> None:
    weight = torch.randn(100, 100)
    with LiveBytes() as live:
        a = torch.randn(100, 100)  # 40 kB
        view = a[10:]
        del a
        assert live.current == 40_000  # the view keeps the storage
        del view
        assert live.current == 0
        b = weight.t()  # a view of a tensor made before: nothing new
        b.add_(0)  # in place: nothing new
        assert live.current == 0
        c = weight @ weight
        assert live.current == 40_000
        del c
    assert live.peak == 40_000


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("method", ["medusa1", "medusa1:vocab", "medusa2", "eagle1", "eagle3"])
def test_a_tiny_step_measures_as_planned(method: str, autocast: bool) -> None:
    """``medusa1:vocab``: heads over a draft vocabulary (``medusa.draft_vocab_size``)."""
    model = _tiny_target()
    precision = "bf16" if autocast else "no"
    method, _, vocab = method.partition(":")
    overrides = [f"train.method={method}", f"train.mixed_precision={precision}", *TINY_STEP]
    overrides += ["medusa.draft_vocab_size=160"] if vocab else []
    config = load_config(RunConfig, None, overrides)
    plan = build_plan(config, recipe="test", device="cpu", model=meta_target(model.config))
    measured = measure_step(config, model, autocast=torch.bfloat16 if autocast else None)
    _check(plan, measured)


@pytest.mark.slow
def test_the_embedded_eagle3_recipe_measures_as_planned(smollm2: Target) -> None:
    """SmolLM2-135M, configs/eagle3-smollm2.yaml at 1 x 256 tokens, fp32; the plan reads only
    the target's config (headway.target.target_config), never its weights."""
    overrides = ["train.batch_size=1", "data.max_length=256", "train.mixed_precision=no"]
    config = load_config(RunConfig, EAGLE3_RECIPE, overrides)
    plan = build_plan(config, recipe=EAGLE3_RECIPE, device="cpu")
    assert plan.target.parameters == sum(p.numel() for p in smollm2.model.parameters())
    _check(plan, measure_step(config, smollm2.model))


LLAMA_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}


def test_an_8b_config_against_hand_arithmetic() -> None:
    overrides = [
        "train.method=eagle3",
        "target.dtype=bfloat16",
        "train.mixed_precision=bf16",
        "eagle3.draft_vocab_size=32000",
        "train.batch_size=1",
        "data.max_length=2048",
    ]
    config = load_config(RunConfig, EAGLE3_RECIPE, overrides)
    model = meta_target(LlamaConfig(**LLAMA_8B))
    plan = build_plan(config, recipe="8b", processes=8, device="cuda", model=model)
    hidden, vocab, inter, kv_width = 4096, 128256, 14336, 8 * 128
    layer = 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * inter + 2 * hidden
    parameters = 2 * vocab * hidden + 32 * layer + hidden
    assert parameters == plan.target.parameters == 8_030_261_248
    rows = {row.name: row for row in plan.memory.rows}
    rotary = 2 * 64 * 4  # inv_freq and original_inv_freq, fp32
    assert rows["target weights"].today == 2 * parameters + rotary  # 16.06e9 in bf16
    assert rows["target weights"].today / 1e9 == pytest.approx(16.06, abs=0.005)
    whole = 2 * vocab * hidden  # embedding and LM head: whole on every process when sharded
    layers = -(-2 * (parameters - whole) // 8)
    assert rows["target weights"].sharded == layers + 2 * whole + rotary  # 3.85e9 per GPU
    assert rows["gradients"].sharded == rows["gradients"].today  # the drafter stays DDP
    # EAGLE-3: fc [H, 3H], q/k/v reading 2H, o, the MLP, 4 norms, the 32k-row draft LM head
    draft = 3 * hidden * hidden + 2 * hidden * (hidden + 2 * kv_width) + hidden * hidden
    draft += 3 * hidden * inter + 4 * hidden + 32000 * hidden
    assert plan.drafter.parameters == draft == 424_689_664
    assert rows["gradients"].today == 4 * draft
    assert rows["optimizer state"].today == 8 * draft + 4 * 13  # 13 tensors' step counters
    assert rows["DDP gradient buckets"].today == 4 * draft
    terms = plan.memory.activations.terms
    assert terms["target logits (no grad)"] == 2048 * vocab * 2  # bf16 under autocast
    # feature cache: 3 taps + the last layer of H in bf16, token id, loss mask, argmax
    assert plan.cache is not None and plan.cache.layers == (2, 16, 29, 32)
    assert plan.cache.per_token == 4 * hidden * 2 + 4 + 1 + 4 == 32_777
    # speculators documents ~268 MB per 8k-token sample for Llama-3.1-8B
    assert 8192 * plan.cache.per_token / 1e6 == pytest.approx(268.5, abs=0.1)


def test_the_feature_cache_estimate_matches_a_written_cache(tmp_path: Path) -> None:
    model = _tiny_target()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(40, 120, (12,), generator=generator).tolist()
    rows = {
        "input_ids": [torch.randint(3, 400, (n,), generator=generator).tolist() for n in lengths],
        "loss_mask": [[0] * 8 + [1] * (n - 8) for n in lengths],
    }
    layers = feature_layers("eagle3", 4)
    manifest = cache_features(
        model,
        datasets.Dataset.from_dict(rows),
        tmp_path / "cache",
        layers=layers,
        target_argmax=True,
        shard_samples=4,
    )
    tokens = sum(lengths)
    size = feature_cache_size(
        hidden_size=32, layers=layers, argmax=True, tokens=tokens, sample_tokens=-(-tokens // 12)
    )
    assert size.per_token == 4 * 32 * 2 + 4 + 1 + 4
    assert size.samples == 12
    assert size.total == pytest.approx(manifest["bytes"], rel=0.03)


def _plan_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan_cli(capsys, "--config", EAGLE3_RECIPE, "--processes", "2")
    assert code == 0
    for text in ("memory per process", "sharded over 2", "DDP gradient buckets", "optimizer state"):
        assert text in out
    assert "per token 4,617 B" in out  # 4 layers x 576 x bf16 + id, mask, argmax
    assert "--tokens-per-s" in out  # no speed given: says how to give one


def test_the_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", EAGLE3_RECIPE, "--processes", "2", "--tokens-per-s", "400", "--json"]
    code, out, _ = _plan_cli(capsys, *argv)
    assert code == 0
    plan = json.loads(out)
    assert plan["method"] == "eagle3" and plan["processes"] == 2
    names = [row["name"] for row in plan["memory_bytes"]["rows"]]
    assert names[0] == "target weights" and "activations (peak)" in names
    regen = plan["regeneration"]
    assert regen["seconds"] == pytest.approx(regeneration_seconds(regen["tokens"], 400, 2))
    assert plan["feature_cache"]["bytes_per_token"] == 4617


@pytest.mark.parametrize(
    ("recipe", "extra", "message"),
    [
        ("train:\n  lrr: 0.1\n", [], "unknown key 'train.lrr'; did you mean 'train.lr'?"),
        (None, [], "does not exist"),
        ("train:\n  method: eagle3\n", ["data.max_lenght=8"], "unknown key 'data.max_lenght'"),
        ("train:\n  method: eagle3\n", ["target.name=./no/such/folder"], "no such folder"),
    ],
)
def test_bad_recipes_are_one_line_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    recipe: str | None,
    extra: list[str],
    message: str,
) -> None:
    path = tmp_path / "recipe.yaml"
    if recipe is not None:
        path.write_text(recipe, encoding="utf-8")
    code, out, err = _plan_cli(capsys, "--config", str(path), *extra)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("headway plan: error:")
    assert message in err


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    plan = commands.choices["plan"]  # type: ignore[index]
    flags = [a for a in plan._actions if a.option_strings and a.dest != "help"]
    assert {f.option_strings[0] for f in flags} >= {
        "--config", "--processes", "--device", "--tokens", "--feature-dtype",
        "--regen-tokens", "--tokens-per-s", "--measure-speed", "--json",
    }  # fmt: skip
    assert all(action.help and len(action.help) > 20 for action in flags)
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert all(flag.option_strings[0] in out for flag in flags)


def test_measure_speed_times_a_short_regeneration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "target"
    tiny_model("llama", vocab_size=400).save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    speed = measure_tokens_per_s(str(folder), dtype="float32", device="cpu", new_tokens=8)
    assert speed.tokens_per_s > 0 and speed.source.startswith("measured here: 8 prompts")
    recipe = str(ROOT / "configs" / "medusa1-smollm2.yaml")
    argv = ["--config", recipe, f"target.name={folder}", "--measure-speed", "--json"]
    code, out, _ = _plan_cli(capsys, *argv)
    assert code == 0
    assert json.loads(out)["regeneration"]["speed_source"].startswith("measured here")


def test_plan_json_of_medusa2_has_no_feature_cache() -> None:
    config = load_config(RunConfig, None, ["train.method=medusa2", *TINY_STEP])
    model = _tiny_target()
    plan = build_plan(config, recipe="test", device="cpu", model=meta_target(model.config))
    assert plan_json(plan)["feature_cache"] is None
    lora = plan.drafter.lora_parameters
    # 4 layers, r = 16: q and o 32 -> 32, k and v 32 -> 16 (2 key/value heads of 8)
    assert lora == 4 * 16 * (2 * (32 + 32) + 2 * (32 + 16))
