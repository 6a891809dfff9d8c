"""Medusa-1 heads over a draft vocabulary (``medusa.draft_vocab_size``): the loss on draft ids,
training through the loop, vLLM's ``token_map`` export and its import, and lossless decoding
with the trained heads, alone and cut further to a draft-vocabulary list (FR-Spec)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.decode.generate import generate
from headway.drafters.build import build_drafter, spec_for
from headway.drafters.draft_vocab import narrow_medusa, write_draft_vocabulary
from headway.errors import ConfigError, HeadwayError
from headway.heads.format_medusa import export_medusa, export_medusa_vllm, import_medusa
from headway.heads.io import HeadsError, load_heads
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.heads.vocab import choose_vocab
from headway.run_config import RunConfig
from headway.target import load_target
from headway.train import loop
from headway.train.losses import medusa_loss, medusa_loss_reference
from headway.train.vocab_counts import training_token_counts
from tests.test_eagle3_training import workspace  # noqa: F401 (a fixture)
from tests.test_generate import hf_greedy
from tests.test_init_from import config

SIZE = 48  # of the tiny target's 400 tokens


def run_config(root: Path, run: str, *overrides: str) -> RunConfig:
    """test_init_from's tiny run, as Medusa-1 heads over :data:`SIZE` tokens."""
    medusa = ("train.method=medusa1", f"medusa.draft_vocab_size={SIZE}", "train.max_steps=12")
    return config(root, run, *medusa, "train.eval_every=4", "train.save_every=12", *overrides)


@pytest.fixture(scope="module")
def trained(workspace: Path) -> Path:  # noqa: F811 (the imported fixture)
    return loop.train(run_config(workspace, "medusa-vocab"))


def test_the_loss_scores_draft_ids_and_counts_labels_outside_as_misses() -> None:
    torch.manual_seed(0)
    token_map = torch.tensor([1, 3, 4, 7, 9])
    ids = torch.tensor([[1, 3, 4, 7, 9, 1, 3, 4], [9, 7, 4, 3, 1, 9, 7, 4]])
    mask = torch.ones_like(ids)
    logits = torch.randn(2, 2, 8, 5)  # [K, B, T, D]
    drafted = torch.searchsorted(token_map, ids)  # every label in the map: the draft ids
    got = medusa_loss(logits, ids, mask, token_map=token_map)
    want = medusa_loss_reference(logits, drafted, mask)
    assert torch.allclose(got.loss, want.loss)
    assert got.metrics == pytest.approx(want.metrics)
    outside = ids.clone()
    outside[:, 4] = 2  # a label no row predicts
    partial = medusa_loss(logits, outside, mask, token_map=token_map)
    kept = mask.clone()
    kept[:, 4] = 0
    restricted = medusa_loss_reference(logits, drafted, kept)
    assert torch.allclose(partial.loss, restricted.loss)  # CE over the labels it can score
    assert partial.metrics["head1/tokens"] == got.metrics["head1/tokens"]  # ... counted all
    assert partial.metrics["head1/top1"] <= restricted.metrics["head1/top1"]


def test_config_files_from_before_the_field_load_and_sizes_are_checked() -> None:
    old = {"num_heads": 2, "num_layers": 1, "hidden_size": 8, "vocab_size": 40}
    assert MedusaConfig.from_dict(old).draft_vocab_size == 0
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        MedusaConfig(2, 1, 8, 40, draft_vocab_size=41)
    config = MedusaConfig(2, 1, 8, 40, draft_vocab_size=3)
    with pytest.raises(ValueError, match="ascending"):
        MedusaHeads(config, token_map=torch.tensor([5, 2, 9]))
    heads = MedusaHeads(config, torch.randn(40, 8), token_map=torch.tensor([2, 5, 9]))
    assert heads.heads[0].lm_head.weight.shape == (3, 8)  # type: ignore[union-attr]


def test_training_learns_the_datas_most_frequent_tokens(workspace: Path, trained: Path) -> None:  # noqa: F811
    loaded = load_heads(trained)
    config = MedusaConfig.from_dict(loaded.head_config)
    assert config.draft_vocab_size == SIZE and config.vocab_size == 400
    target = load_target(str(workspace / "target"), dtype="float32", device="cpu")
    counts = training_token_counts(run_config(workspace, "x"), target, (4,))
    want = choose_vocab(counts, SIZE).target_ids
    assert torch.equal(loaded.state_dict["token_map"], want)
    assert loaded.state_dict["heads.1.lm_head.weight"].shape == (SIZE, 32)
    evals = [json.loads(line) for line in (trained / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]


def test_vllm_export_holds_the_token_map_and_loads_back(trained: Path, tmp_path: Path) -> None:
    out = export_medusa_vllm(trained, tmp_path / "vllm")
    engine = json.loads((out / "config.json").read_text())
    assert engine["truncated_vocab_size"] == SIZE and engine["vocab_size"] == 400
    tensors = load_file(out / "model.safetensors")
    assert tensors["token_map"].dtype == torch.int64 and tensors["token_map"].shape == (SIZE,)
    assert tensors["lm_heads.0.weight"].shape == (SIZE, 32)
    back = import_medusa(out)
    native = load_heads(trained).state_dict
    assert back.config.draft_vocab_size == SIZE
    assert all(torch.equal(back.state_dict[name], native[name]) for name in native)
    with pytest.raises(HeadsError, match="medusa-vllm") as refused:
        export_medusa(trained, tmp_path / "reference")
    assert "\n" not in str(refused.value)


def test_vllm_heads_of_the_whole_vocabulary_with_an_unsorted_map_are_cut(
    trained: Path, tmp_path: Path
) -> None:
    """vLLM cuts full-vocabulary LM heads to the ``token_map`` rows on load; so does the import,
    which also sorts a map written in another order."""
    out = export_medusa_vllm(trained, tmp_path / "vllm")
    tensors = load_file(out / "model.safetensors")
    order = torch.randperm(SIZE, generator=torch.Generator().manual_seed(1))
    ids = tensors["token_map"]
    for name in [key for key in tensors if key.startswith("lm_heads.")]:
        whole = torch.zeros(400, 32)
        whole[ids] = tensors[name]
        tensors[name] = whole
    tensors["token_map"] = ids[order]
    save_file(tensors, str(out / "model.safetensors"))
    back = import_medusa(out)
    native = load_heads(trained).state_dict
    assert torch.equal(back.state_dict["token_map"], ids)
    assert torch.equal(back.state_dict["heads.0.lm_head.weight"], native["heads.0.lm_head.weight"])
    engine = json.loads((out / "config.json").read_text())
    del engine["vocab_size"]
    (out / "config.json").write_text(json.dumps(engine))
    with pytest.raises(HeadsError, match="vocab_size"):
        import_medusa(out)


@pytest.mark.parametrize("listed", [False, True], ids=["own-vocab", "and-a-list"])
def test_trained_heads_decode_exactly(
    workspace: Path,  # noqa: F811
    trained: Path,
    tmp_path: Path,
    listed: bool,
) -> None:
    target = load_target(str(workspace / "target"), dtype="float32", device="cpu")
    prompt = target.tokenizer("question 3: what is two plus two?")["input_ids"]
    options: dict[str, object] = {}
    token_map = load_heads(trained).state_dict["token_map"]
    if listed:  # every other token of the heads' own vocabulary, and one they lack
        vocab_file = tmp_path / "vocab.json"
        write_draft_vocabulary(vocab_file, [*token_map[::2].tolist(), 399])
        options = {"draft_vocab": str(vocab_file), "draft_vocab_size": SIZE}
    drafter = build_drafter(spec_for(heads=trained, options=options), target)
    recorder: list[int] = []
    original = drafter.propose

    def propose(*args: object, **kwargs: object) -> object:
        tree = original(*args, **kwargs)  # type: ignore[arg-type]
        recorder.extend(tree.tokens.tolist())
        return tree

    drafter.propose = propose  # type: ignore[method-assign, assignment]
    result = generate(target.model, prompt, drafter=drafter, max_new_tokens=24, eos_token_ids=())
    assert result.tokens == hf_greedy(target.model, torch.tensor(prompt), 24, eos=None)
    allowed = set(token_map[::2].tolist()) if listed else set(token_map.tolist())
    assert recorder and set(recorder) <= allowed


def test_narrowing_refuses_damaged_maps_and_lists_with_nothing_in_common() -> None:
    config = MedusaConfig(1, 0, 4, 10, draft_vocab_size=3)
    heads = MedusaHeads(config, torch.randn(10, 4), token_map=torch.tensor([1, 4, 6]))
    state = heads.state_dict()
    narrowed, cut, ids = narrow_medusa(config, state, torch.tensor([0, 4, 6, 8]))
    assert ids is not None and ids.tolist() == [4, 6] and narrowed.vocab_size == 2
    assert torch.equal(cut["heads.0.lm_head.weight"], state["heads.0.lm_head.weight"][1:])
    assert "token_map" not in cut and narrowed.draft_vocab_size == 0
    with pytest.raises(HeadwayError, match="none of"):
        narrow_medusa(config, state, torch.tensor([0, 2]))
    with pytest.raises(HeadwayError, match="damaged"):
        narrow_medusa(config, {**state, "token_map": torch.tensor([4, 1, 6])}, None)


def test_medusa2_refuses_a_draft_vocabulary(workspace: Path) -> None:  # noqa: F811
    from headway.train.methods import build_method

    config = run_config(workspace, "m2", "train.method=medusa2")
    target = load_target(str(workspace / "target"), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="medusa1"):
        build_method(config, target)


@pytest.mark.parametrize("method", ["medusa1", "eagle3"])
def test_a_method_rebuilt_for_its_own_weights_does_not_count_the_data(
    workspace: Path,  # noqa: F811
    trained: Path,
    method: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A resumed run or ``eval --heads-only`` loads the run's weights, vocabulary included,
    right after building the method: no pass over the data to count tokens first."""
    from headway.train import methods, vocab_counts

    def counted(*args: object) -> None:
        raise AssertionError("the data was counted")

    monkeypatch.setattr(vocab_counts, "training_token_counts", counted)
    target = load_target(str(workspace / "target"), dtype="float32", device="cpu")
    config = run_config(workspace, "rebuilt", f"train.method={method}")
    rebuilt = methods.build_method(config, target, from_init=False)
    if isinstance(rebuilt, methods.Medusa1):
        saved = load_heads(trained).state_dict
        rebuilt.heads.load_state_dict(saved)
        assert rebuilt.heads.token_map is not None
        assert torch.equal(rebuilt.heads.token_map, saved["token_map"])
    with pytest.raises(AssertionError, match="counted"):
        methods.build_method(config, target)  # a new run counts
