"""Medusa-2 through the training loop: heads and adapter saved, eval decodes the merged target,
resume restores the adapter, heads-only scoring on the adapted target, the merged-target export."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import headway
from headway.cli import main
from headway.drafters.build import build_drafter, spec_for
from headway.eval.run import describe_drafter
from headway.heads.export_medusa2 import export_medusa2_target
from headway.heads.io import HeadsError
from headway.heads.medusa2 import ADAPTER_DIR, MERGED_ATTRIBUTE
from headway.target import load_target
from headway.train import loop
from headway.train.heads_accuracy import heads_only
from headway.train.method_medusa2 import Medusa2
from headway.train.methods import build_method
from tests.test_medusa import PROMPT, hf_greedy
from tests.test_medusa2 import LOOP, batch_of, drafted_greedy, logits, lora_parameters, q_proj
from tests.test_train_loop import config_for, workspace  # noqa: F401 (workspace is a fixture)


@pytest.fixture(scope="module")
def loop_run(workspace: Path) -> Path:  # noqa: F811 (the imported fixture)
    config = config_for(workspace, "medusa2", *LOOP)
    return loop.train(config)


def test_loop_saves_heads_and_adapter_and_eval_decodes_the_merged_target(
    loop_run: Path,
    workspace: Path,  # noqa: F811 (the imported fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert (loop_run / "model.safetensors").is_file()
    assert (loop_run / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    saved = [*loop_run.iterdir(), *(loop_run / ADAPTER_DIR).iterdir()]
    assert not [path.name for path in saved if path.suffix in {".bin", ".pt", ".pkl"}]
    evals = [json.loads(line) for line in (loop_run / "eval.jsonl").read_text().splitlines()]
    assert all("eval/backbone/kl" in row for row in evals)

    target = load_target(workspace / "target", device="cpu")
    base = copy.deepcopy(target.model)
    with caplog.at_level(logging.INFO, logger="headway.heads.medusa2"):
        spec = spec_for(heads=loop_run)
        drafter, info = build_drafter(spec, target), describe_drafter(spec)
    assert info["method"] == "medusa2"
    assert [r for r in caplog.records if "merged the Medusa-2 LoRA adapter" in r.message]
    # `headway eval` then decodes both ways with this target: the baseline is the merged model.
    assert getattr(target.model.config, MERGED_ATTRIBUTE)
    assert not torch.equal(q_proj(target.model), q_proj(base))
    assert drafted_greedy(target.model, drafter, PROMPT) == hf_greedy(target.model, PROMPT)


def test_build_method_knows_medusa2(workspace: Path) -> None:  # noqa: F811
    config = config_for(workspace, "unused", *LOOP)
    method = build_method(config, load_target(workspace / "target", device="cpu"))
    assert isinstance(method, Medusa2) and method.feature_layers == ()


def test_resume_restores_the_adapter_too(
    loop_run: Path,
    workspace: Path,  # noqa: F811 (the imported fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def stop_at_step_three(progress: loop.Progress) -> None:
        if progress.step == 3:
            raise KeyboardInterrupt

    config = config_for(workspace, "medusa2-stopped", *LOOP)
    monkeypatch.setattr(loop, "after_checkpoint", stop_at_step_three)
    with pytest.raises(KeyboardInterrupt):
        loop.train(config)
    monkeypatch.setattr(loop, "after_checkpoint", lambda progress: None)
    resumed = loop.train(config, resume=True)
    for name in ("model.safetensors", f"{ADAPTER_DIR}/adapter_model.safetensors"):
        expected, actual = load_file(str(loop_run / name)), load_file(str(resumed / name))
        assert expected.keys() == actual.keys()
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0)


def test_heads_only_scores_the_heads_on_the_adapted_target(
    loop_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--heads-only loads the run's adapter too. Without it the LoRA weights stay at zero: the
    student equals the frozen teacher (KL exactly 0) and the heads read features they were not
    trained on."""
    adapted = heads_only(loop_run, num_samples=None, batch_size=64, progress=False).metrics
    monkeypatch.setattr(Medusa2, "load_adapter", lambda self, run_dir: None)
    bare = heads_only(loop_run, num_samples=None, batch_size=64, progress=False).metrics
    assert bare["backbone/kl"] == 0.0 and adapted["backbone/kl"] > 1e-6
    assert adapted["head1/ce"] != bare["head1/ce"]
    assert adapted["head1/tokens"] == bare["head1/tokens"] > 0


def test_merged_target_export_serves_the_heads(
    loop_run: Path,
    workspace: Path,  # noqa: F811 (the imported fixture)
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--format medusa2-target`` writes the adapted target as a stock HF folder: it speaks like
    the target headway merges at load time, differs from the base, and the run's heads decode on
    it losslessly (loading them onto it merges nothing twice). The heads' own export names it."""
    out = tmp_path / "merged"
    assert main(["export", str(loop_run), "--format", "medusa2-target", "--out", str(out)]) == 0
    heads_out = tmp_path / "heads"
    assert main(["export", str(loop_run), "--format", "medusa-vllm", "--out", str(heads_out)]) == 0
    assert "--format medusa2-target" in capsys.readouterr().out

    exported = load_target(out, device="cpu")
    assert not lora_parameters(exported.model) and not hasattr(exported.model, "peft_config")
    merged_here = load_target(workspace / "target", device="cpu")
    base = copy.deepcopy(merged_here.model)
    headway.load_drafter(loop_run, merged_here)
    batch = batch_of(seed=4)
    torch.testing.assert_close(logits(exported.model, batch), logits(merged_here.model, batch))
    assert not torch.allclose(logits(exported.model, batch), logits(base, batch))

    before = q_proj(exported.model).clone()
    drafter = headway.load_drafter(loop_run, exported)
    assert torch.equal(q_proj(exported.model), before)
    assert drafted_greedy(exported.model, drafter, PROMPT) == hf_greedy(exported.model, PROMPT)


def test_merged_target_export_refuses_other_methods(
    workspace: Path,  # noqa: F811 (the imported fixture)
    tmp_path: Path,
) -> None:
    run = loop.train(config_for(workspace, "medusa1-for-export", "train.max_steps=1"))
    with pytest.raises(HeadsError, match="medusa2-target merges a Medusa-2"):
        export_medusa2_target(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
