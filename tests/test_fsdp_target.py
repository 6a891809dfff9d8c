"""The frozen target sharded across 2 CPU processes (gloo) under an accelerate FSDP launch: an
online EAGLE-3 run computes the losses of the unsharded run, while each process holds half of
the target's decoder-layer weights.

The launch is the one a user writes: an accelerate config with ``distributed_type: FSDP`` (and
``fsdp_cpu_ram_efficient_loading: true``, which would make transformers load the weights on the
first process only if headway left the FSDP flag to it). This module is also the script each
process runs (``python -m tests.test_fsdp_target``): it trains the sharded run, then the
unsharded one (``target.shard=no``) in the same processes, and writes each rank's losses and
parameter bytes to a JSON file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from headway.config import load_config, to_dict
from headway.errors import ConfigError, TargetError, TrainingError
from headway.run_config import RunConfig
from headway.train import loop
from headway.train.sharding import (
    FSDP_LAUNCH,
    ShardedTarget,
    decoder_layers,
    shard_target,
    should_shard,
    take_fsdp_launch,
)
from tests.launching import ENV, accelerate_launch
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parents[1]
REPLIES = ("It is four.", "Hello! How can I help you today?", "The quick brown fox.", "I am fine.")
ACCELERATE_FSDP = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "num_machines": 1,
    "machine_rank": 0,
    "num_processes": 2,
    "mixed_precision": "no",
    "use_cpu": False,
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_reshard_after_forward": True,
        "fsdp_cpu_ram_efficient_loading": True,
    },
}


def recipe(root: Path, run: str, shard: str) -> dict[str, Any]:
    config = load_config(
        RunConfig,
        None,
        [
            f"target.name={root / 'target'}",
            "target.device=cpu",
            f"target.shard={shard}",
            f"data.sources={root / 'chat.jsonl'}",
            "data.max_length=64",
            "data.eval_fraction=0.2",
            "train.method=eagle3",
            f"train.output_dir={root / run}",
            "train.lr=1e-2",
            "train.warmup_steps=1",
            "train.max_steps=4",
            "train.batch_size=2",
            "train.eval_every=2",
            "train.save_every=4",
            "eagle3.draft_vocab_size=64",
            "eagle3.ttt_steps=2",
        ],
    )
    return to_dict(config)


def make_workspace(root: Path) -> None:
    """A tiny 4-layer Llama target (hidden 32, vocab 400, ChatML), 24 conversations, the two
    training recipes and the accelerate FSDP config."""
    from tests.test_eagle3 import tiny4
    from tests.tokenizers_fixture import smollm2_tokenizer

    tiny4("llama", vocab_size=400).save_pretrained(root / "target")
    smollm2_tokenizer().save_pretrained(root / "target")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}: what is two plus two?"},
                {"role": "assistant", "content": REPLIES[i % len(REPLIES)] * (1 + i % 3)},
            ]
        }
        for i in range(24)
    ]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    for run, shard in (("sharded", "auto"), ("whole", "no")):
        text = yaml.safe_dump(recipe(root, run, shard))
        (root / f"{run}.yaml").write_text(text, encoding="utf-8")
    (root / "accelerate.yaml").write_text(yaml.safe_dump(ACCELERATE_FSDP), encoding="utf-8")


def held_bytes(model: torch.nn.Module, names: set[str]) -> dict[str, int]:
    """Bytes of the parameters named in ``names`` (whole) and of what this process holds of them:
    the elements of its local shard, and the storage behind it (FSDP2 pads a shard to an even
    split)."""
    whole = elements = storage = 0
    for name, parameter in model.named_parameters():
        if name not in names:
            continue
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        whole += parameter.numel() * parameter.element_size()
        elements += local.numel() * local.element_size()
        storage += local.untyped_storage().nbytes()
    return {"whole": whole, "local_elements": elements, "local_storage": storage}


def worker(root: Path, run: str) -> None:
    """One process of the launch: train ``run``, record its losses and what the process holds
    of the target after its training steps and evaluations."""
    losses: list[float] = []
    check_finite, shard = loop._check_finite, loop.shard_target
    sharded: list[tuple[Any, ShardedTarget]] = []

    def record_loss(loss: torch.Tensor, progress: loop.Progress) -> None:
        losses.append(loss.item())
        check_finite(loss, progress)

    def keep_target(model: Any) -> ShardedTarget:
        sharded.append((model, shard(model)))
        return sharded[-1][1]

    loop._check_finite = record_loss
    loop.shard_target = keep_target
    loop.train(load_config(RunConfig, root / f"{run}.yaml"))
    result: dict[str, Any] = {"losses": losses}
    for model, report in sharded:
        names = {name for name, _ in model.named_parameters()}
        layers = {name for name in names if name.startswith("model.layers.")}
        result["layers"] = held_bytes(model, layers)
        result["target"] = held_bytes(model, names)
        result["report"] = report.__dict__
    rank = int(os.environ["RANK"])
    (root / f"{run}-rank-{rank}.json").write_text(json.dumps(result), encoding="utf-8")


def launch(root: Path, run: str) -> None:
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    program = ["-m", "tests.test_fsdp_target", str(root), run]
    accelerate_launch(program, config_file=root / "accelerate.yaml", cwd=REPO, env=env)


@pytest.mark.slow
def test_sharded_target_trains_as_the_whole_one_on_half_the_layer_memory(tmp_path: Path) -> None:
    make_workspace(tmp_path)
    for run in ("sharded", "whole"):  # both launched for FSDP; "whole" sets target.shard=no
        launch(tmp_path, run)
    ranks = [json.loads((tmp_path / f"sharded-rank-{r}.json").read_text()) for r in (0, 1)]
    for rank, sharded in enumerate(ranks):
        whole = json.loads((tmp_path / f"whole-rank-{rank}.json").read_text())
        assert "report" not in whole  # target.shard=no left it whole
        # (a) the same losses, micro-step by micro-step on each process (fp32)
        assert len(sharded["losses"]) == 4
        torch.testing.assert_close(
            torch.tensor(sharded["losses"]), torch.tensor(whole["losses"]), rtol=1e-5, atol=1e-6
        )
        # (b) each process holds half of the decoder layers' weights (after steps and evals)
        layers, target = sharded["layers"], sharded["target"]
        assert layers["local_storage"] <= 0.55 * layers["whole"]
        assert layers["local_elements"] * 2 >= layers["whole"] * 0.95  # a half, not less
        unsharded_rest = target["whole"] - layers["whole"]
        assert target["local_storage"] <= unsharded_rest + 0.55 * layers["whole"]
        assert sharded["report"]["local_bytes"] == target["local_storage"]
        assert sharded["report"]["layers"] == 4 and sharded["report"]["processes"] == 2
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each its own batches
    evals = {
        run: (tmp_path / run / "eval.jsonl").read_text().splitlines()
        for run in ("sharded", "whole")
    }
    for sharded_row, whole_row in zip(evals["sharded"], evals["whole"], strict=True):
        sharded_eval, whole_eval = json.loads(sharded_row), json.loads(whole_row)
        assert sharded_eval.keys() == whole_eval.keys()
        for key, value in whole_eval.items():  # held-out evaluations ran the sharded target too
            assert sharded_eval[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    sharded = json.loads((tmp_path / "sharded" / "training_summary.json").read_text())
    whole = json.loads((tmp_path / "whole" / "training_summary.json").read_text())
    assert sharded["num_processes"] == 2
    first, second = sharded["param_checksum_per_process"]
    assert first == second  # the drafter is one DDP model
    torch.testing.assert_close(
        torch.tensor(sharded["param_checksum_per_process"]),
        torch.tensor(whole["param_checksum_per_process"]),
        rtol=1e-6,
        atol=1e-6,
    )


def test_target_shard_setting_decides_with_the_launch() -> None:
    assert should_shard("auto", fsdp_launch=True, processes=2, method="eagle3")
    assert not should_shard("auto", fsdp_launch=False, processes=2, method="eagle3")
    assert should_shard("fsdp", fsdp_launch=False, processes=8, method="eagle1")
    assert not should_shard("no", fsdp_launch=True, processes=2, method="eagle3")
    assert not should_shard("fsdp", fsdp_launch=True, processes=1, method="eagle3")
    with pytest.raises(TrainingError, match="medusa2"):
        should_shard("auto", fsdp_launch=True, processes=2, method="medusa2")
    assert not should_shard("auto", fsdp_launch=False, processes=2, method="medusa2")
    with pytest.raises(ConfigError, match=r"target\.shard"):
        load_config(RunConfig, None, ["target.shard=yes"])
    with pytest.raises(ConfigError, match="medusa2"):
        load_config(RunConfig, None, ["target.shard=fsdp", "train.method=medusa2"])


def test_an_fsdp_launch_is_taken_off_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FSDP_LAUNCH, "true")
    assert take_fsdp_launch()
    assert FSDP_LAUNCH not in os.environ  # accelerate and transformers no longer see it
    assert not take_fsdp_launch()


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_decoder_layers_are_found_by_class(family: str) -> None:
    model = tiny_model(family)
    found = decoder_layers(model)
    assert len(found) == 2 and len({type(layer).__name__ for layer in found}) == 1
    assert decoder_layers(model, [type(found[0]).__name__]) == found  # named, as accelerate's
    with pytest.raises(TargetError, match="fsdp_transformer_layer_cls_to_wrap"):
        decoder_layers(model, ["NoSuchLayer"])
    with pytest.raises(TrainingError, match="process group"):
        shard_target(model)  # one process, no torch.distributed: nothing to shard over


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2])
