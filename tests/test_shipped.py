"""Shipped drafters: the default for the target whose fingerprint they record, nothing for any
other target; likewise a shipped regenerated corpus makes retrieval ``headway generate``'s default
for the target that wrote it; the shipped SmolLM2 drafter (when the checkout has one) loads and
decodes exactly as the target's own greedy decoding (slow: the real embedded model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from headway.drafters.shipped import (
    DEFAULTS,
    SHIPPED_DIR,
    default_corpus,
    default_heads,
    shipped_heads,
    shipped_names,
)
from headway.errors import HeadwayError
from headway.heads.io import load_heads
from headway.heads.loading import ENGINE_FORMATS
from headway.target import fingerprint
from tests.test_eagle3 import tiny4
from tests.test_formats import random_run

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target() -> Any:
    return tiny4("llama")


def test_a_default_drafter_is_found_by_its_target_fingerprint(target: Any, tmp_path: Path) -> None:
    run = random_run(tmp_path / "run", "eagle3", target)
    ENGINE_FORMATS["eagle3-hf"].write(load_heads(run), tmp_path / "shipped" / "tiny-eagle3")
    shipped = tmp_path / "shipped"
    assert default_heads(target, shipped_dir=shipped, names=["tiny-eagle3"]) == (
        shipped / "tiny-eagle3"
    )
    assert default_heads(target, shipped_dir=shipped, names=[]) is None  # not a default
    assert default_heads(target, shipped_dir=shipped, names=["missing"]) is None
    other = tiny4("llama", seed=1)
    assert default_heads(other, shipped_dir=shipped, names=["tiny-eagle3"]) is None
    # Shipped but not a default: listed for its target only.
    assert shipped_names(shipped) == ["tiny-eagle3"]
    assert shipped_heads(target, shipped_dir=shipped) == [shipped / "tiny-eagle3"]
    assert shipped_heads(other, shipped_dir=shipped) == []
    assert shipped_names(tmp_path / "nowhere") == []


def test_every_default_is_shipped_and_every_shipped_drafter_fits_the_checkout() -> None:
    """Defaults name shipped folders; each shipped export is an eagle3-hf/medusa layout the
    loaders detect, in bf16, at most 25 MB (issue #13: binaries that travel with every clone)."""
    from safetensors import safe_open

    from headway.heads.loading import detect_format

    assert set(DEFAULTS) <= set(shipped_names())
    for name in shipped_names():
        folder = SHIPPED_DIR / name
        assert detect_format(folder) is not None, name
        weights = folder / "model.safetensors"
        assert weights.stat().st_size <= 25 * 10**6, name
        with safe_open(weights, "pt") as file:
            names = file.keys()  # a safe_open handle is not iterable
            floats = {file.get_slice(k).get_dtype() for k in names} - {"I64", "BOOL"}
        assert floats == {"BF16"}, name


@pytest.mark.slow
@pytest.mark.parametrize("name", shipped_names())
def test_each_shipped_drafter_decodes_losslessly(name: str) -> None:
    from headway.decode.generate import generate
    from headway.drafters.build import build_drafter, spec_for
    from headway.target import load_target
    from tests.test_generate import hf_greedy

    target = load_target("smollm2-135m", dtype="float32", device="cpu")
    assert SHIPPED_DIR / name in shipped_heads(target.model)
    if name in DEFAULTS:
        assert default_heads(target.model) == SHIPPED_DIR / name
    drafter = build_drafter(spec_for(heads=SHIPPED_DIR / name), target)
    messages = [{"role": "user", "content": "Explain what a hash table is in two sentences."}]
    prompt = target.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
    )[0]
    assert isinstance(prompt, torch.Tensor)
    truth = hf_greedy(target.model, prompt, 64, eos=None)
    result = generate(target.model, prompt, drafter=drafter, max_new_tokens=64, eos_token_ids=())
    assert result.tokens == truth
    assert result.tau > 1.5  # a trained drafter accepts more than one token per step
    ranked = SHIPPED_DIR / name / "draft_vocab.json"
    if ranked.is_file():  # narrowed to its 2,048 most frequent answer tokens (FR-Spec)
        options = {"draft_vocab": str(ranked), "draft_vocab_size": 2048}
        narrow = build_drafter(spec_for(heads=SHIPPED_DIR / name, options=options), target)
        assert 1800 < narrow.draft3.config.draft_vocab_size <= 2048
        result = generate(target.model, prompt, drafter=narrow, max_new_tokens=64, eos_token_ids=())
        assert result.tokens == truth and result.tau > 1.5


def _corpus(root: Path, name: str, target: Any) -> Path:
    """A regenerated-corpus folder whose manifest records ``target``'s fingerprint."""
    folder = root / name
    (folder / "data").mkdir(parents=True)
    manifest = {"settings": {"target": fingerprint(target).to_dict()}, "complete": True}
    (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return folder


def test_a_corpus_the_target_regenerated_is_found_by_its_fingerprint(
    target: Any, tmp_path: Path
) -> None:
    folder = _corpus(tmp_path, "tiny-chat", target)
    assert default_corpus(target, corpus_dir=tmp_path, names=["tiny-chat"]) == folder / "data"
    assert default_corpus(target, corpus_dir=tmp_path, names=[]) is None  # not a default
    assert default_corpus(target, corpus_dir=tmp_path, names=["missing"]) is None
    assert default_corpus(tiny4("llama", seed=1), corpus_dir=tmp_path, names=["tiny-chat"]) is None
    (folder / "manifest.json").write_text('{"settings": {"target": {"hidden_size": 1}}}')
    assert default_corpus(target, corpus_dir=tmp_path, names=["tiny-chat"]) is None


def test_generate_without_a_drafter_retrieves_from_the_default_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from headway.cli.common import drafter_from_flags
    from headway.drafters import shipped
    from headway.drafters.specs import PromptLookupSpec, RetrievalSpec
    from headway.target import load_target
    from tests.test_eval import _tiny_target

    target = load_target(_tiny_target(tmp_path), device="cpu")
    folder = _corpus(tmp_path / "corpora", "tiny-chat", target.model)
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]}
    (folder / "data" / "chat.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    monkeypatch.setattr(shipped, "CORPUS_DIR", tmp_path / "corpora")
    monkeypatch.setattr(shipped, "DEFAULT_CORPORA", ("tiny-chat",))
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    flags: dict[str, Any] = {"drafter": None, "heads": None, "draft_option": [], "tree": "default"}
    args = argparse.Namespace(**flags, force=False)
    _, choice = drafter_from_flags(args, target)
    assert choice.spec == RetrievalSpec(data=(str(folder / "data"),))
    with pytest.raises(HeadwayError, match="name what to decode with"):
        drafter_from_flags(args, target, default=None)  # eval: it names its drafter
    args.drafter = "prompt-lookup"  # named: as asked
    assert isinstance(drafter_from_flags(args, target)[1].spec, PromptLookupSpec)
    monkeypatch.setattr(shipped, "DEFAULT_CORPORA", ())
    args.drafter = None
    assert isinstance(drafter_from_flags(args, target)[1].spec, PromptLookupSpec)


def test_a_default_drafter_runs_cost_sized_unless_sizing_is_given(
    target: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No drafter named: the shipped default is taken, sized as its figures were measured
    unless --sizing is given; a drafter named is sized by itself. The flags are not changed."""
    from headway.cli.common import decode_options, drafter_from_flags
    from headway.drafters import shipped
    from headway.drafters.specs import EagleSpec
    from headway.target import Target

    run = random_run(tmp_path / "run", "eagle3", target)
    ENGINE_FORMATS["eagle3-hf"].write(load_heads(run), tmp_path / "shipped" / "tiny-eagle3")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(shipped, "DEFAULTS", ("tiny-eagle3",))
    wrapped = Target(model=target, tokenizer=None, source="tiny")  # type: ignore[arg-type]

    def flags(**given: Any) -> argparse.Namespace:
        values: dict[str, Any] = {"drafter": None, "heads": None, "draft_option": []}
        values |= {"tree": "default", "force": False, "sizing": None}
        values |= {"acceptance": "lossless", "verify": "eager"}
        return argparse.Namespace(**(values | given))

    args = flags()
    _, choice = drafter_from_flags(args, wrapped)
    assert isinstance(choice.spec, EagleSpec)
    assert Path(choice.spec.heads) == tmp_path / "shipped" / "tiny-eagle3"
    assert decode_options(args, CPU, choice).sizing == shipped.DEFAULT_SIZING
    assert args.sizing is None  # nothing written back
    args = flags(sizing="drafter")
    assert decode_options(args, CPU, drafter_from_flags(args, wrapped)[1]).sizing == "drafter"
    args = flags(drafter="prompt-lookup")
    assert decode_options(args, CPU, drafter_from_flags(args, wrapped)[1]).sizing == "drafter"
