"""``train.init_from``: a run starts from heads trained before (a run directory or an engine
export), evaluates them at step 0, keeps an EAGLE-3 drafter's draft vocabulary, and refuses heads
of another method or shape in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headway.config import load_config
from headway.errors import ConfigError, HeadwayError
from headway.heads.io import load_heads
from headway.heads.loading import ENGINE_FORMATS
from headway.run_config import RunConfig
from headway.target import load_target
from headway.train import loop
from headway.train.heads_accuracy import heads_only
from headway.train.method_eagle3 import Eagle3
from headway.train.methods import build_method
from tests.test_eagle3_training import workspace  # noqa: F401 (a fixture)
from tests.test_train_loop import assert_same_weights, train_stopped_at_step_three

OTHER_REPLIES = ("Seven apples.", "Blue, mostly.", "Yes, on Tuesdays.", "No idea, sorry!")


def config(root: Path, run: str, *overrides: str) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            f"target.name={root / 'target'}",
            "target.device=cpu",
            f"data.sources={root / 'chat.jsonl'}",
            "data.max_length=64",
            "data.eval_fraction=0.2",
            f"train.output_dir={root / run}",
            "train.lr=1e-2",
            "train.warmup_steps=1",
            "train.max_steps=6",
            "train.batch_size=4",
            "train.eval_every=3",
            "train.save_every=6",
            "medusa.num_heads=2",
            "eagle3.draft_vocab_size=128",
            "eagle3.ttt_steps=2",
            *overrides,
        ],
    )


def other_data(root: Path) -> Path:
    """Chat data with other replies than the workspace's: counting its tokens would choose
    another draft vocabulary."""
    other = root / "other.jsonl"
    other.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"question {i}: tell me something"},
                        {"role": "assistant", "content": OTHER_REPLIES[i % 4] * (2 + i % 3)},
                    ]
                }
            )
            + "\n"
            for i in range(24)
        ),
        "utf-8",
    )
    return other


def evals(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]


def test_a_run_started_from_heads_evaluates_them_at_step_zero(workspace: Path) -> None:  # noqa: F811
    first = loop.train(config(workspace, "medusa-a", "train.method=medusa1"))
    second = loop.train(
        config(workspace, "medusa-b", "train.method=medusa1", f"train.init_from={first}")
    )
    before, after = evals(first), evals(second)
    assert [row["step"] for row in after] == [0, 3, 6]
    # step 0 scores the heads it was given: the first run's last eval, on the same held-out rows
    assert after[0]["eval/loss"] == pytest.approx(before[-1]["eval/loss"], rel=1e-5)
    assert after[0]["eval/loss"] < before[0]["eval/loss"]  # below the first run's step 3
    assert after[-1]["eval/loss"] < after[0]["eval/loss"]  # and it trains on from there
    config_json = json.loads((second / "train_config.json").read_text())
    assert config_json["train"]["init_from"] == str(first)


def test_eagle3_starts_from_an_export_and_keeps_its_draft_vocabulary(
    workspace: Path,  # noqa: F811
) -> None:
    trained = loop.train(config(workspace, "eagle3-a", "train.method=eagle3"))
    exported = ENGINE_FORMATS["eagle3-hf"].write(load_heads(trained), workspace / "eagle3-export")
    other = other_data(workspace)
    start = load_file(str(trained / "model.safetensors"))
    overrides = ["train.method=eagle3", f"data.sources={other}"]
    target = load_target(workspace / "target", device="cpu")
    fresh = build_method(config(workspace, "unused", *overrides), target)
    assert isinstance(fresh, Eagle3)
    assert not torch.equal(fresh.draft.d2t, start["d2t"])  # this data alone chooses otherwise
    tuned = build_method(
        config(workspace, "unused", *overrides, f"train.init_from={exported}"), target
    )
    assert isinstance(tuned, Eagle3)
    assert torch.equal(tuned.draft.d2t, start["d2t"]) and torch.equal(tuned.draft.t2d, start["t2d"])
    for name, value in tuned.draft.state_dict().items():
        torch.testing.assert_close(value, start[name].to(value.dtype), msg=name)
    run_dir = loop.train(config(workspace, "eagle3-b", *overrides, f"train.init_from={exported}"))
    assert [row["step"] for row in evals(run_dir)] == [0, 3, 6]
    assert torch.equal(load_file(str(run_dir / "model.safetensors"))["d2t"], start["d2t"])


def test_heads_of_another_method_or_shape_are_refused_in_one_line(
    workspace: Path,  # noqa: F811
) -> None:
    medusa = loop.train(config(workspace, "medusa-c", "train.method=medusa1", "train.max_steps=1"))
    target = load_target(workspace / "target", device="cpu")
    with pytest.raises(ConfigError, match=r"holds medusa1 heads but train\.method=eagle3"):
        build_method(
            config(workspace, "x", "train.method=eagle3", f"train.init_from={medusa}"), target
        )
    with pytest.raises(
        ConfigError, match=r"its num_heads is 2, this run's 3; set medusa\.num_heads"
    ):
        build_method(
            config(
                workspace,
                "x",
                "train.method=medusa1",
                "medusa.num_heads=3",
                f"train.init_from={medusa}",
            ),
            target,
        )
    with pytest.raises(ConfigError, match="medusa2 also trains a LoRA adapter"):
        config(workspace, "x", "train.method=medusa2", f"train.init_from={medusa}")
    with pytest.raises(HeadwayError) as missing:
        build_method(
            config(workspace, "x", "train.method=medusa1", f"train.init_from={workspace}/nothing"),
            target,
        )
    assert "\n" not in str(missing.value)


def test_a_fine_tune_resumes_and_evaluates_without_the_folder_it_started_from(
    workspace: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the heads a run started from are gone, ``--resume`` continues from its checkpoint
    (draft vocabulary included) to the weights of a run never stopped, and its heads evaluate."""
    trained = loop.train(config(workspace, "eagle3-c", "train.method=eagle3"))
    start = ENGINE_FORMATS["eagle3-hf"].write(load_heads(trained), tmp_path / "start")
    overrides = [
        "train.method=eagle3",
        f"data.sources={other_data(workspace)}",  # alone, it would choose another vocabulary
        f"train.init_from={start}",
        "train.save_every=3",
    ]
    uninterrupted = loop.train(config(workspace, "tune-full", *overrides))
    train_stopped_at_step_three(config(workspace, "tune-stopped", *overrides), monkeypatch)
    shutil.rmtree(start)
    resumed = loop.train(config(workspace, "tune-stopped", *overrides), resume=True)
    assert_same_weights(uninterrupted, resumed)
    scores = [
        heads_only(run, num_samples=4, progress=False).metrics for run in (uninterrupted, resumed)
    ]
    assert scores[0] == scores[1] and scores[0]["depth1/tokens"] > 0
