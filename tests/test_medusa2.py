"""Medusa-2: LoRA + heads trained jointly with a KL to the frozen target; runs save the adapter
beside the heads, and decoding merges it into the target (tiny Llama and Qwen2, CPU, fp32).
Runs through the training loop: tests/test_medusa2_loop.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from peft import PeftModel
from torch import Tensor, nn

import headway
from headway.config import load_config
from headway.decode.generate import generate
from headway.errors import ConfigError, TargetError
from headway.heads.io import HeadsError, load_heads, save_heads
from headway.heads.medusa2 import ADAPTER_DIR, MERGED_ATTRIBUTE
from headway.run_config import RunConfig
from headway.target import Target, fingerprint
from headway.train.method_medusa2 import Medusa2
from tests.test_medusa import NEW_TOKENS, OTHER_PROMPT, PROMPT, hf_greedy
from tests.test_train_loop import config_for, workspace  # noqa: F401 (workspace is a fixture)
from tests.tiny import TINY_VOCAB, tiny_model

FAMILIES = ("llama", "qwen2")
SMALL = ["medusa.num_heads=2", "medusa.lora_r=4", "medusa.lora_alpha=8"]
# Loop runs: no LoRA dropout, so resume is exact. (A resumed run re-creates its DataLoader
# iterator mid-epoch, which draws a seed from the global RNG that the uninterrupted run drew
# before the checkpoint; any method sampling that RNG, dropout or EAGLE's noise, then diverges.)
LOOP = ["train.method=medusa2", "medusa.lora_r=4", "medusa.lora_alpha=8", "medusa.lora_dropout=0"]


def medusa2_config(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["train.method=medusa2", *SMALL, *overrides])


def as_target(model: Any) -> Target:
    """A target without a tokenizer (Medusa-2's training step and the decoder never tokenize)."""
    return Target(model=cast(Any, model), tokenizer=cast(Any, None), source="tiny")


def tiny_target(family: str) -> Target:
    """A tiny random target of ``family`` (fp32, CPU, eval mode)."""
    return as_target(tiny_model(family))


def batch_of(seed: int = 0, batch: int = 3, length: int = 24) -> dict[str, Tensor]:
    """Random ids; the first 6 tokens of every row are prompt, the last row is padded by 5."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY_VOCAB, (batch, length), generator=generator)
    attention = torch.ones_like(ids)
    attention[-1, -5:] = 0
    ids[-1, -5:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :6] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def logits(model: Any, batch: dict[str, Tensor]) -> Tensor:
    with torch.no_grad():
        out: Tensor = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    return out


def q_proj(model: Any) -> Tensor:
    """The first layer's query projection weight (Llama and Qwen2 name it alike)."""
    weight: Tensor = model.model.layers[0].self_attn.q_proj.weight
    return weight


def lora_parameters(model: Any) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def train_steps(method: Medusa2, steps: int, lr: float = 1e-2) -> list[float]:
    optimizer = torch.optim.AdamW(method.parameter_groups(lr, weight_decay=0.1))
    method.train()
    losses = []
    for _ in range(steps):
        output = method(batch_of(), {})
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        losses.append(output.loss.item())
    return losses


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("family", FAMILIES)
def test_at_init_the_adapted_target_is_the_frozen_target(family: str) -> None:
    target = tiny_target(family)
    frozen = copy.deepcopy(target.model)
    method = Medusa2(medusa2_config(), target)  # LoRA dropout on: still exact with B = 0
    method.train()
    batch = batch_of()
    assert torch.equal(logits(target.model, batch), logits(frozen, batch))
    output = method(batch, {})
    assert output.metrics["backbone/kl"] == 0.0
    assert output.metrics["backbone/tokens"] == float(batch["loss_mask"][:, 1:].sum())
    with torch.no_grad():  # an adapter that moves the student, never the teacher
        for name, parameter in lora_parameters(target.model).items():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    method.eval()  # no LoRA dropout: the KL comes from the adapter alone
    assert method(batch, {}).metrics["backbone/kl"] > 1e-4
    with method.backbone.peft_model.disable_adapter():
        assert torch.equal(logits(target.model, batch), logits(frozen, batch))


@pytest.mark.parametrize("family", FAMILIES)
def test_only_lora_and_heads_require_grad(family: str) -> None:
    target = tiny_target(family)
    method = Medusa2(medusa2_config(), target)
    trainable = {name for name, p in target.model.named_parameters() if p.requires_grad}
    lora = lora_parameters(target.model)
    assert trainable == set(lora)
    assert len(lora) == 2 * 2 * 4  # A and B x 2 layers x q, k, v, o
    own = {id(p) for p in method.parameters()}
    assert own == {id(p) for p in lora.values()} | {id(p) for p in method.heads.parameters()}
    assert all(p.requires_grad for p in method.parameters())
    assert {key.split(".")[0] for key in method.state_dict()} == {"heads", "lora"}


def test_optimizer_groups_carry_the_head_lr_multiplier() -> None:
    target = tiny_target("llama")
    method = Medusa2(medusa2_config("medusa.head_lr_multiplier=2.5"), target)
    backbone, heads = method.parameter_groups(1e-3, weight_decay=0.01)
    assert backbone["lr"] == 1e-3 and heads["lr"] == pytest.approx(2.5e-3)
    assert {id(p) for p in backbone["params"]} == {
        id(p) for p in lora_parameters(target.model).values()
    }
    assert {id(p) for p in heads["params"]} == {id(p) for p in method.heads.parameters()}
    assert backbone["weight_decay"] == heads["weight_decay"] == 0.01
    assert Medusa2(medusa2_config(), tiny_target("llama")).head_lr_multiplier == 4.0


@pytest.mark.parametrize("family", FAMILIES)
def test_training_lowers_the_loss_and_leaves_base_weights_bit_identical(family: str) -> None:
    target = tiny_target(family)
    before = [(p, p.detach().clone()) for p in target.model.parameters()]
    method = Medusa2(medusa2_config(), target)
    losses = train_steps(method, steps=12)
    assert losses[-1] < 0.7 * losses[0]
    for parameter, original in before:  # weight decay 0.1 reached none of them
        assert torch.equal(parameter, original) and parameter.grad is None
    assert any(p.abs().max() > 0 for n, p in lora_parameters(target.model).items() if "B" in n)
    method.eval()
    assert method(batch_of(seed=1), {}).metrics["backbone/kl"] > 0  # the adapter did move


def test_offline_features_are_refused_naming_data_features() -> None:
    with pytest.raises(ConfigError, match=r"data\.features") as error:
        medusa2_config("data.features=offline", "data.features_dir=cache")
    assert "\n" not in str(error.value)
    config = medusa2_config()
    config.data.features = "offline"  # built in code, past the config check
    with pytest.raises(ConfigError, match=r"data\.features"):
        Medusa2(config, tiny_target("llama"))


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        ("q_proj,nope_proj", r"no module named 'nope_proj'.*q_proj"),
        ("lm_head", "embedding or LM head"),
        ("embed_tokens", "embedding or LM head"),
        ("self_attn", "not a linear layer"),
    ],
)
def test_lora_target_modules_are_checked(modules: str, message: str) -> None:
    target = tiny_target("llama")
    with pytest.raises(ConfigError, match=message):
        Medusa2(medusa2_config(f"medusa.lora_target_modules={modules}"), target)
    assert not lora_parameters(target.model)  # refused before anything was injected


# ----------------------------------------------------------------------------- save and load


def save_run(method: Medusa2, base: Any, run_dir: Path) -> Path:
    """What the loop does at the end of a run: the heads, then the method's extra files."""
    head_config, state = method.export()
    save_heads(
        run_dir,
        method="medusa2",
        head_config=head_config,
        state_dict=state,
        target_fingerprint=fingerprint(base),
        target_name="tiny",
    )
    method.save_extra(run_dir)
    return run_dir


def drafted_greedy(model: Any, drafter: Any, prompt: Tensor) -> list[int]:
    result = generate(model, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    return list(result.tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_run_decodes_the_merged_target_greedily(family: str, tmp_path: Path) -> None:
    target = tiny_target(family)
    base = copy.deepcopy(target.model)
    method = Medusa2(medusa2_config(), target)
    train_steps(method, steps=8)
    run_dir = save_run(method, base, tmp_path / "run")
    assert json.loads((run_dir / "config.json").read_text())["method"] == "medusa2"
    assert set(load_heads(run_dir).state_dict) == set(method.heads.state_dict())
    assert sorted(p.name for p in (run_dir / ADAPTER_DIR).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    decoding = as_target(copy.deepcopy(base))
    drafter = headway.load_drafter(run_dir, decoding)
    merged = decoding.model
    assert not lora_parameters(merged) and not hasattr(merged, "peft_config")  # stock modules
    batch = batch_of(seed=2)
    method.eval()
    torch.testing.assert_close(logits(merged, batch), logits(target.model, batch))
    assert not torch.allclose(logits(merged, batch), logits(base, batch))
    for prompt in (PROMPT, OTHER_PROMPT):
        assert drafted_greedy(merged, drafter, prompt) == hf_greedy(merged, prompt)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing")  # peft 0.21 on transformers 5
def test_adapter_folder_is_a_standard_peft_adapter(tmp_path: Path) -> None:
    target = tiny_target("qwen2")
    base = copy.deepcopy(target.model)
    method = Medusa2(medusa2_config(), target)
    train_steps(method, steps=3)
    run_dir = save_run(method, base, tmp_path / "run")
    merged = as_target(copy.deepcopy(base))
    headway.load_drafter(run_dir, merged)
    with_peft = PeftModel.from_pretrained(copy.deepcopy(base), str(run_dir / ADAPTER_DIR))
    batch = batch_of(seed=3)
    torch.testing.assert_close(logits(merged.model, batch), logits(with_peft, batch))


def test_merge_happens_once_and_only_after_the_checks(tmp_path: Path) -> None:
    target = tiny_target("llama")
    base = copy.deepcopy(target.model)
    method = Medusa2(medusa2_config(), target)
    train_steps(method, steps=3)
    run_dir = save_run(method, base, tmp_path / "run")

    other = copy.deepcopy(base)  # another target: its LM head differs, so does its fingerprint
    with torch.no_grad():
        other.get_output_embeddings().weight.add_(0.01)
    with pytest.raises(TargetError):
        headway.load_drafter(run_dir, as_target(other))
    assert not hasattr(other.config, MERGED_ATTRIBUTE) and not lora_parameters(other)
    assert torch.equal(q_proj(other), q_proj(base))

    decoding = as_target(copy.deepcopy(base))
    headway.load_drafter(run_dir, decoding)
    once = logits(decoding.model, batch_of())
    headway.load_drafter(run_dir, decoding)  # `headway generate` loads once per prompt
    assert torch.equal(logits(decoding.model, batch_of()), once)

    save_run(method, base, tmp_path / "other-run")
    with pytest.raises(HeadsError, match="another Medusa-2 run"):
        headway.load_drafter(tmp_path / "other-run", decoding)

    head_config, state = method.export()  # heads re-saved, adapter not: a torn save
    save_heads(
        run_dir,
        method="medusa2",
        head_config=head_config,
        state_dict=state,
        target_fingerprint=fingerprint(base),
        target_name="tiny",
    )
    fresh = copy.deepcopy(base)
    with pytest.raises(HeadsError, match="not saved with the heads"):
        headway.load_drafter(run_dir, as_target(fresh))
    assert torch.equal(logits(fresh, batch_of()), logits(base, batch_of()))


# ----------------------------------------------------------------------------- the loop
