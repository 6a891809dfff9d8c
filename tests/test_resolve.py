"""One resolver decides the drafter and its sizing for the CLI and the Python API alike, and
changes nothing it is given."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from headway.cli import build_parser
from headway.cli.common import decode_options, drafter_from_flags
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions, verify_path
from headway.decode.sampling import SamplingParams
from headway.drafters import resolve
from headway.drafters.build import build_drafter
from headway.drafters.resolve import STATIC_TREE, resolve_drafter
from headway.drafters.specs import EagleSpec, PromptLookupSpec, RetrievalSpec
from headway.errors import HeadwayError
from headway.named_drafters import choice_for
from headway.target import Target
from tests.test_eagle3 import tiny4
from tests.test_formats import random_run

CPU = torch.device("cpu")


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    """A tiny target whose "shipped" drafter is a random EAGLE-3 run."""
    model = tiny4("llama")
    run = random_run(tmp_path / "shipped", "eagle3", model)
    monkeypatch.setattr(resolve, "default_heads", lambda target_model: run)
    return model, run


def test_nothing_named_takes_the_shipped_drafter_cost_sized(shipped: tuple[Any, Path]) -> None:
    model, run = shipped
    choice = resolve_drafter(model)
    assert isinstance(choice.spec, EagleSpec) and choice.spec.heads == str(run)
    assert choice.sizing == "cost" and "shipped" in choice.reason
    assert resolve_drafter(model, sizing="drafter").sizing == "drafter"  # a named sizing wins
    tuned = resolve_drafter(model, options={"depth": 3})
    assert isinstance(tuned.spec, EagleSpec) and tuned.spec.depth == 3


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_static_verify_path_keeps_the_shipped_drafters_trees_on_the_device(
    shipped: tuple[Any, Path],
) -> None:
    """With --verify captured/compiled the default drafter drafts in fixed shapes (compiled
    with the compiled verify), sized by itself, which is what the device step takes, over the
    tree measured best on a GPU; a named drafting, sizing or tree option still wins."""
    model, _ = shipped
    for verify in ("captured", "compiled"):
        choice = resolve_drafter(model, verify=verify)
        drafting = "compiled" if verify == "compiled" else "static"  # as the verify forward
        assert isinstance(choice.spec, EagleSpec) and choice.spec.drafting == drafting
        assert choice.sizing == "drafter" and verify in choice.reason
        tree = {name: getattr(choice.spec, name) for name in STATIC_TREE}
        assert tree == STATIC_TREE  # the tree measured best on a GPU
    eager = resolve_drafter(model)  # the CPU's tree is the drafter's own
    assert isinstance(eager.spec, EagleSpec) and eager.spec.total_tokens != 32
    deeper = resolve_drafter(model, verify="captured", options={"depth": 3})
    assert isinstance(deeper.spec, EagleSpec)  # a named tree option keeps the drafter's tree
    assert (deeper.spec.depth, deeper.spec.total_tokens) == (3, eager.spec.total_tokens)
    named = resolve_drafter(model, verify="captured", options={"drafting": "eager"}, sizing="cost")
    assert isinstance(named.spec, EagleSpec) and named.spec.drafting == "eager"
    assert named.sizing == "cost"
    target = Target(model=model, tokenizer=None, source="tiny")  # type: ignore[arg-type]
    assert choice.spec is not None
    decoder = Decoder(model, build_drafter(choice.spec, target), DecodeOptions(verify="captured"))
    assert decoder._device_step(SamplingParams()) is not None


def test_named_eagle_heads_draft_in_fixed_shapes_on_a_static_verify_path(
    shipped: tuple[Any, Path],
) -> None:
    """--heads named with --verify captured/compiled drafts static (compiled with compiled), so
    its trees stay on the device, over its own tree; eager verification keeps eager drafting;
    a named drafting wins."""
    model, run = shipped
    for verify, drafting in (("eager", "eager"), ("captured", "static"), ("compiled", "compiled")):
        choice = resolve_drafter(model, heads=str(run), verify=verify)  # type: ignore[arg-type]
        assert isinstance(choice.spec, EagleSpec) and choice.spec.drafting == drafting
        assert choice.spec.total_tokens != STATIC_TREE["total_tokens"]  # the drafter's tree
    named = resolve_drafter(model, heads=str(run), verify="captured", options={"drafting": "eager"})
    assert isinstance(named.spec, EagleSpec) and named.spec.drafting == "eager"


def test_named_drafters_are_sized_by_themselves_and_none_is_plain(
    shipped: tuple[Any, Path],
) -> None:
    model, run = shipped
    named = resolve_drafter(model, drafter="prompt-lookup")
    assert isinstance(named.spec, PromptLookupSpec) and named.sizing == "drafter"
    heads = resolve_drafter(model, heads=str(run))
    assert isinstance(heads.spec, EagleSpec) and heads.sizing == "drafter"
    plain = resolve_drafter(model, drafter="none")
    assert plain.spec is None
    with pytest.raises(HeadwayError, match="drop --heads"):
        resolve_drafter(model, drafter="none", heads=str(run))


def test_without_anything_shipped_a_corpus_then_the_fallback_then_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tiny4("llama")
    monkeypatch.setattr(resolve, "default_heads", lambda target_model: None)
    monkeypatch.setattr(resolve, "default_corpus", lambda target_model: None)
    assert isinstance(resolve_drafter(model).spec, PromptLookupSpec)
    with pytest.raises(HeadwayError, match="name what to decode with"):
        resolve_drafter(model, fallback=None)
    monkeypatch.setattr(resolve, "default_corpus", lambda target_model: tmp_path / "corpus")
    corpus = resolve_drafter(model)
    assert isinstance(corpus.spec, RetrievalSpec)
    assert corpus.spec.data == (str(tmp_path / "corpus"),)


def test_the_cli_and_the_api_run_the_default_drafter_alike(shipped: tuple[Any, Path]) -> None:
    model, _ = shipped
    target = Target(model=model, tokenizer=None, source="tiny")  # type: ignore[arg-type]
    args = build_parser().parse_args(["generate", "--device", "cpu", "hi"])
    before = copy.deepcopy(vars(args))
    drafter, choice = drafter_from_flags(args, target)
    assert vars(args) == before  # nothing written back into the flags
    assert drafter is not None and choice == choice_for("default", target)
    assert decode_options(args, CPU, choice).sizing == "cost"
    explicit = build_parser().parse_args(["generate", "--sizing", "drafter", "hi"])
    named = drafter_from_flags(explicit, target)[1]
    assert decode_options(explicit, CPU, named).sizing == "drafter"


def test_verify_auto_is_captured_on_cuda_and_eager_elsewhere() -> None:
    """``--verify auto`` (the default) picks by the target's device: CUDA graphs only pay, and
    only exist, on CUDA; a named path is kept; a wrong name is refused in one line. The API
    takes the same path when given no options."""
    assert verify_path("auto", torch.device("cuda")) == "captured"
    assert verify_path("auto", CPU) == "eager"
    assert verify_path("compiled", CPU) == "compiled"
    assert verify_path("auto", torch.nn.Linear(2, 2)) == "eager"  # a model on the CPU
    one, spread = _OnDevices("cuda:0", "cuda:0"), _OnDevices("cuda:0", "cuda:1")
    assert verify_path("auto", one) == "captured"
    assert verify_path("auto", spread) == "eager"  # device_map over two GPUs: never captured
    with pytest.raises(ValueError, match="choose 'auto' or one of 'eager'"):
        verify_path("graphs", CPU)


class _OnDevices(torch.nn.Module):
    """A model whose parameters say they live on ``devices`` (no CUDA needed to name them)."""

    def __init__(self, *devices: str) -> None:
        super().__init__()
        self.devices = [torch.device(name) for name in devices]

    def parameters(self, recurse: bool = True) -> Iterator[Any]:
        return iter(SimpleNamespace(device=device) for device in self.devices)
