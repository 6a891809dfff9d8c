"""Typed drafter specs: one frozen dataclass per drafter family, the only way to say which
drafter to build and how (:func:`headway.drafters.build.build_drafter` builds any of them).

The command line fills them from ``--drafter``/``--heads`` and ``--draft-option KEY=VALUE``
(:func:`parse_spec`): an unknown key gets the nearest valid name, a bad value a one-line error.
Python users construct them directly::

    spec = EagleSpec(heads="runs/eagle3-smollm2", depth=5, total_tokens=24)

How many nodes a step *sends* is not a drafter option: ``DecodeOptions(sizing="cost")`` makes
the decoding loop size every tree (:mod:`headway.decode.options`).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from headway.config import unknown_name
from headway.errors import ConfigError

__all__ = [
    "DRAFTER_NAMES",
    "SPEC_TYPES",
    "DrafterSpec",
    "EagleSpec",
    "LookupMedusaSpec",
    "MedusaSpec",
    "PromptLookupSpec",
    "RetrievalSpec",
    "describe_specs",
    "parse_spec",
]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def _at_least(spec: object, minimum: float, *names: str) -> None:
    for name in names:
        if getattr(spec, name) < minimum:
            raise ConfigError(f"{name}={getattr(spec, name)} must be >= {minimum}")


def _ngrams(min_ngram: int, max_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")


@dataclass(frozen=True)
class PromptLookupSpec:
    """Prompt lookup: continuations of the longest earlier n-gram match of prompt + output."""

    name: ClassVar[str] = "prompt-lookup"
    max_ngram: int = field(default=4, metadata=_help("longest n-gram matched"))
    min_ngram: int = field(default=2, metadata=_help("shortest n-gram matched"))
    num_draft_tokens: int = field(default=8, metadata=_help("longest continuation drafted"))
    max_nodes: int = field(default=8, metadata=_help("most tree nodes per step"))
    adaptive: bool = field(
        default=True,
        metadata=_help("grow the draft length after full acceptance, shrink it otherwise"),
    )

    def __post_init__(self) -> None:
        _ngrams(self.min_ngram, self.max_ngram)
        _at_least(self, 1, "num_draft_tokens", "max_nodes")


@dataclass(frozen=True)
class RetrievalSpec:
    """Prompt lookup, then continuations of the same n-gram in a corpus of the target's answers."""

    name: ClassVar[str] = "retrieval"
    data: tuple[str, ...] = field(
        default=(), metadata=_help("chat data to index (e.g. `headway data regenerate` output)")
    )
    min_ngram: int = field(default=2, metadata=_help("shortest n-gram matched"))
    max_ngram: int = field(default=4, metadata=_help("longest n-gram matched"))
    num_draft_tokens: int = field(default=6, metadata=_help("longest corpus continuation"))
    max_nodes: int = field(default=8, metadata=_help("most tree nodes per step"))
    min_hits: int = field(default=2, metadata=_help("ignore n-grams seen fewer times"))
    min_share: float = field(
        default=0.3,
        metadata=_help("own sizing: send nodes at least this share of continuations pass"),
    )
    heads: str = field(
        default="",
        metadata=_help(
            "trained heads (EAGLE or Medusa, any layout) that draft, with their defaults, only "
            "on steps where prompt lookup and the corpus find nothing"
        ),
    )
    force: bool = field(default=False, metadata=_help("accept heads trained for another target"))

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError(
                "the retrieval drafter needs a corpus: --draft-option data=PATH (chat data, e.g. "
                "the output of `headway data regenerate`)"
            )
        _ngrams(self.min_ngram, self.max_ngram)
        _at_least(self, 1, "num_draft_tokens", "max_nodes", "min_hits")
        if not 0 <= self.min_share <= 1:
            raise ConfigError(f"min_share={self.min_share} must be in [0, 1]")


@dataclass(frozen=True)
class MedusaSpec:
    """Medusa-1/2 heads (a run directory, a `medusa`/`medusa-vllm` export or published heads)."""

    name: ClassVar[str] = "medusa"
    heads: str = field(default="", metadata=_help("the heads folder"))
    tree: str | tuple[tuple[int, ...], ...] = field(
        default="default",
        metadata=_help("static tree: a name (default, mc_sim_7b_63) or rank paths [[0],[0,0]]"),
    )
    draft_vocab: str = field(
        default="",
        metadata=_help(
            "draft only over the draft_vocab_size most frequent answer tokens of this chat-data "
            "folder or draft-vocabulary file (`headway data vocab`; FR-Spec: every head's LM "
            "head cut to their rows; heads trained over a draft vocabulary keep those of its "
            "tokens that are listed)"
        ),
    )
    draft_vocab_size: int = field(default=4096, metadata=_help("size of that vocabulary"))
    dtype: Literal["target", "int8"] = field(
        default="target",
        metadata=_help(
            "the heads' dtype (the output is the target's either way, only drafts may differ): "
            "target (the target's); int8 (on a CPU: every head's LM head multiplies int8 "
            "weights, the residual blocks stay in the target's dtype; faster, but each input "
            "is quantised per tensor and the target's final states carry outlier channels: "
            "SmolLM2's own LM head in int8 picks its fp32 argmax at 87% of positions)"
        ),
    )
    coupled: bool = field(
        default=True,
        metadata=_help(
            "sampled: each head's candidates ranked with the noise the target draws with (the "
            "host step; the same text either way); false ranks by the heads' top-k"
        ),
    )
    force: bool = field(default=False, metadata=_help("accept heads trained for another target"))

    def __post_init__(self) -> None:
        if not self.heads:
            raise ConfigError("MedusaSpec needs heads=FOLDER")
        _at_least(self, 1, "draft_vocab_size")
        if self.dtype not in ("target", "int8"):
            raise ConfigError(f"dtype={self.dtype!r}: choose target or int8")


@dataclass(frozen=True)
class EagleSpec:
    """EAGLE-1 or EAGLE-3 drafter (a run directory, an `eagle1`/`eagle3-hf` export or a
    published drafter) drafting EAGLE-2 dynamic trees."""

    name: ClassVar[str] = "eagle"
    heads: str = field(default="", metadata=_help("the drafter folder"))
    top_k: int = field(default=8, metadata=_help("children per expanded node (1 = a chain)"))
    depth: int = field(default=4, metadata=_help("deepest tree level"))
    total_tokens: int | Literal["auto"] = field(
        default=16,
        metadata=_help(
            "tree budget counting the root: at most N - 1 nodes; auto: chosen among 4-32 by "
            "timing the target's verify forward on this machine"
        ),
    )
    dtype: Literal["auto", "target", "bfloat16", "int8"] = field(
        default="auto",
        metadata=_help(
            "the draft model's dtype (the output is the target's either way, only drafts may "
            "differ): target (the target's); bfloat16 (half its memory traffic); int8 (EAGLE-3 "
            "on a CPU: its draft layer and LM head multiply int8 weights, fc stays in the "
            "target's dtype); auto: int8 where eager drafting on a CPU multiplies those layers "
            "in at most 0.8 of their fp32 time, timed once on this machine, else target"
        ),
    )
    drafting: Literal["eager", "static", "compiled"] = field(
        default="eager",
        metadata=_help(
            "static: every draft forward of a step in fixed shapes over a static draft cache, "
            "replayed from one CUDA graph per step on CUDA; compiled: static, the whole step "
            "(draft forwards, LM head, top-k, tree masks) through torch.compile as one graph "
            "(the default with --verify compiled; a C++ "
            "compiler off CUDA); eager: the draft cache grows and is cropped each step (the "
            "reference)"
        ),
    )
    draft_vocab: str = field(
        default="",
        metadata=_help(
            "draft only over the draft_vocab_size most frequent answer tokens of this chat-data "
            "folder or draft-vocabulary file (`headway data vocab`; FR-Spec: a narrower LM head "
            "drafts for less, a little less is accepted); EAGLE-3 keeps those of its own "
            "vocabulary, EAGLE-1 a copy of the target head's rows"
        ),
    )
    draft_vocab_size: int = field(default=4096, metadata=_help("size of that vocabulary"))
    coupled: bool = field(
        default=True,
        metadata=_help(
            "sampled: draft with the noise the target draws with (coupled drafting: more of "
            "each text accepted, the same text either way; false drafts by the draft's top-k, "
            "to measure what coupling adds)"
        ),
    )
    force: bool = field(default=False, metadata=_help("accept a drafter for another target"))

    def __post_init__(self) -> None:
        if not self.heads:
            raise ConfigError("EagleSpec needs heads=FOLDER")
        _at_least(self, 1, "top_k", "depth", "draft_vocab_size")
        if self.drafting not in ("eager", "static", "compiled"):
            raise ConfigError(f"drafting={self.drafting!r}: choose 'eager', 'static' or 'compiled'")
        if self.dtype not in ("auto", "target", "bfloat16", "int8"):
            raise ConfigError(f"dtype={self.dtype!r}: choose auto, target, bfloat16 or int8")
        if self.dtype == "int8" and self.drafting == "compiled":
            raise ConfigError(
                "dtype=int8 drafts eagerly or statically, not compiled: drop one of the two"
            )
        if self.total_tokens != "auto":
            _at_least(self, 2, "total_tokens")


@dataclass(frozen=True)
class LookupMedusaSpec:
    """The quickstart's drafter: prompt lookup merged with Medusa heads that draft a chain only
    while their cumulative probability stays above ``confidence``."""

    name: ClassVar[str] = "lookup-medusa"
    heads: str = field(default="", metadata=_help("Medusa heads folder (any Medusa layout)"))
    confidence: float = field(
        default=0.5, metadata=_help("heads draft while their cumulative probability >= this")
    )
    lookup: bool = field(default=True, metadata=_help("merge prompt lookup's drafts first"))
    lookup_min_ngram: int = field(default=2, metadata=_help("prompt lookup: shortest n-gram"))
    lookup_max_ngram: int = field(default=4, metadata=_help("prompt lookup: longest n-gram"))
    lookup_tokens: int = field(default=8, metadata=_help("prompt lookup: draft length"))
    draft_vocab: str = field(
        default="",
        metadata=_help(
            "draft only the most frequent answer tokens of this chat-data folder, or the ids in "
            "this draft-vocabulary file (`headway data vocab`); heads trained over a draft "
            "vocabulary keep only its tokens that are listed"
        ),
    )
    draft_vocab_size: int = field(default=4096, metadata=_help("size of that vocabulary"))
    draft_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata=_help("dtype the heads draft in")
    )
    force: bool = field(default=False, metadata=_help("accept heads trained for another target"))

    def __post_init__(self) -> None:
        if not self.heads:
            raise ConfigError("LookupMedusaSpec needs heads=FOLDER")
        if not 0 < self.confidence <= 1:
            raise ConfigError(f"confidence={self.confidence} must be in (0, 1]")
        _ngrams(self.lookup_min_ngram, self.lookup_max_ngram)
        _at_least(self, 1, "lookup_tokens", "draft_vocab_size")


DrafterSpec = PromptLookupSpec | RetrievalSpec | MedusaSpec | EagleSpec | LookupMedusaSpec
"""Any drafter spec."""

SPEC_TYPES = (PromptLookupSpec, RetrievalSpec, MedusaSpec, EagleSpec, LookupMedusaSpec)
"""Every spec type (for ``isinstance``)."""

DRAFTER_NAMES: dict[str, type[Any]] = {spec.name: spec for spec in SPEC_TYPES}
"""``--drafter`` name -> spec type (``medusa`` and ``eagle`` are picked from a heads folder)."""

_DECODE_OPTIONS = {
    "sizing": "--sizing",
    "gemm": "--gemm",
    "acceptance": "--acceptance",
    "verify": "--verify",
}


def _union_args(annotation: object) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return typing.get_args(annotation)
    return (annotation,)


def _convert(value: object, annotation: object) -> Any:
    """``value`` as ``annotation`` (int, float, bool, str, Literal, tuples, unions of them);
    ``ValueError`` if it is not one."""
    for kind in _union_args(annotation):
        try:
            return _convert_one(value, kind)
        except (TypeError, ValueError):
            continue
    raise ValueError(f"{value!r} is not {_type_name(annotation)}")


def _convert_one(value: object, kind: object) -> Any:
    origin = typing.get_origin(kind)
    if origin is Literal:
        if value in typing.get_args(kind):
            return value
        raise ValueError(value)
    if origin is tuple:
        item = typing.get_args(kind)[0]
        if isinstance(value, str) and value.lstrip().startswith("["):
            value = json.loads(value)
        if isinstance(value, str) and item is str:
            return (value,)
        if not isinstance(value, list | tuple):
            raise TypeError(value)
        return tuple(_convert(element, item) for element in value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(value)
    digits = isinstance(value, str) and value.strip().lstrip("-").isdigit()
    if kind is int and not isinstance(value, bool) and (isinstance(value, int) or digits):
        return int(str(value))
    if kind is float and not isinstance(value, bool) and isinstance(value, int | float | str):
        return float(value)
    if kind is str and isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise TypeError(value)


def _type_name(annotation: object) -> str:
    names = []
    for kind in _union_args(annotation):
        if typing.get_origin(kind) is Literal:
            names.append(" or ".join(repr(v) for v in typing.get_args(kind)))
        elif typing.get_origin(kind) is tuple:
            names.append("a list")
        else:
            names.append(getattr(kind, "__name__", str(kind)))
    return " or ".join(names)


def parse_spec(
    spec_type: type[Any], options: Mapping[str, Any], *, where: str = "--draft-option"
) -> Any:
    """A ``spec_type`` from ``options`` (``--draft-option`` values, already JSON-decoded where
    they were JSON: ``3``, ``0.5``, ``true``, ``[[0],[1]]``, else strings).

    Raises:
        ConfigError: an unknown key (the nearest valid name given; decode options such as
            ``sizing`` point at their flag), a value of the wrong type, or a failed check.
    """
    hints = typing.get_type_hints(spec_type)
    fields = {item.name: hints[item.name] for item in dataclasses.fields(spec_type)}
    values: dict[str, Any] = {}
    for key, value in options.items():
        if key in _DECODE_OPTIONS and key not in fields:
            raise ConfigError(
                f"{where}: {key} is a decoding option, not a drafter one; use "
                f"{_DECODE_OPTIONS[key]} {value}"
            )
        if key == "tree" and "total_tokens" in fields:
            raise ConfigError(
                f"{where} ({spec_type.name}): tree names Medusa trees; an EAGLE tree is sized by "
                "top_k, depth and total_tokens (total_tokens=auto chooses it by timing the target)"
            )
        if key not in fields:
            raise unknown_name("option", key, list(fields), f"{where} ({spec_type.name})")
        try:
            values[key] = _convert(value, fields[key])
        except ValueError as error:
            raise ConfigError(f"{where}: {key}: {error}") from None
    try:
        return spec_type(**values)
    except ConfigError as error:
        raise ConfigError(f"{where} ({spec_type.name}): {error}") from None


def describe_specs() -> str:
    """Every drafter's options with their defaults and help, for ``--help``."""
    lines = []
    for name, spec_type in DRAFTER_NAMES.items():
        lines.append(f"{name}:")
        hints = typing.get_type_hints(spec_type)
        for item in dataclasses.fields(spec_type):
            if item.name == "heads":
                continue
            default = item.default if item.default is not dataclasses.MISSING else None
            kind = _type_name(hints[item.name])
            lines.append(f"  {item.name} ({kind}, default {default!r}): {item.metadata['help']}")
    return "\n".join(lines)
