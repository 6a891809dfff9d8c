"""``build_drafter(spec, target)``: the one place a drafter is built, whoever asks
(``headway generate``, ``headway eval``, the quickstart, ``scripts/compare.py``, the Python API).

    spec = spec_for("prompt-lookup", options={"num_draft_tokens": 6})
    drafter = build_drafter(spec, target)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from headway.decode.gemm import apply_gemm, gemm_choice
from headway.decode.generate import Drafter
from headway.decode.int8_linear import int8_available, int8_pays, to_int8
from headway.drafters.draft_vocab import (
    draft_vocabulary,
    narrow_eagle3,
    narrow_head,
    narrow_medusa,
)
from headway.drafters.eagle3_drafter import Eagle3Drafter, eagle3_model
from headway.drafters.eagle_drafter import EagleDrafter, eagle_model
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.lookup_medusa import lookup_medusa_drafter
from headway.drafters.medusa_drafter import MedusaDrafter, medusa_tree
from headway.drafters.merged import FirstDrafter
from headway.drafters.retrieval import retrieval_drafter
from headway.drafters.specs import (
    DRAFTER_NAMES,
    DrafterSpec,
    EagleSpec,
    LookupMedusaSpec,
    MedusaSpec,
    PromptLookupSpec,
    RetrievalSpec,
    parse_spec,
)
from headway.drafters.static_eagle import StaticDrafting, StaticEagle3Drafter, StaticEagleDrafter
from headway.drafters.tree_budget import auto_total_tokens
from headway.errors import ConfigError
from headway.heads.eagle import EagleConfig, TargetHead
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.hidden_states import check_final_hidden, final_hidden_layer
from headway.heads.io import HeadsError
from headway.heads.loading import FoundHeads, find_heads, heads_family
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.heads.medusa2 import merge_adapter
from headway.target import Target
from headway.timings import remembered, shapes_digest

__all__ = ["build_drafter", "describe_spec", "spec_for"]

logger = logging.getLogger(__name__)


def spec_for(
    name: str | None = None,
    *,
    heads: str | Path | None = None,
    options: Mapping[str, object] | None = None,
) -> DrafterSpec:
    """The spec of a drafter named on the command line: ``name`` (``prompt-lookup``,
    ``retrieval``, ``lookup-medusa``) and/or a ``heads`` folder, whose own method picks
    ``medusa`` or ``eagle`` when no name is given; ``options`` are ``--draft-option`` values.

    Raises:
        ConfigError: an unknown drafter or option, or a bad value (one line).
        HeadsError: ``heads`` holds no heads headway can read.
    """
    if name is None:
        if heads is None:
            raise ConfigError("name a drafter (--drafter NAME) or a heads folder (--heads DIR)")
        name = heads_family(heads)
    if name not in DRAFTER_NAMES:
        valid = ", ".join(sorted(DRAFTER_NAMES))
        raise ConfigError(f"unknown drafter {name!r}; choose one of {valid}, or --heads DIR")
    spec_type = DRAFTER_NAMES[name]
    fields = {item.name for item in dataclasses.fields(spec_type)}
    values = dict(options or {})
    if heads is not None:
        if "heads" not in fields:
            raise ConfigError(f"the {name} drafter takes no heads folder; drop --heads {heads}")
        values["heads"] = str(heads)
    return parse_spec(spec_type, values)


def build_drafter(spec: DrafterSpec, target: Target) -> Drafter:
    """The drafter ``spec`` describes, on ``target``'s device and dtype. A trained drafter's own
    layers multiply their few-row inputs on the GEMM choice applied to the target
    (:func:`~headway.decode.gemm.apply_gemm`; ``"auto"`` where none was).

    A Medusa-2 run merges its LoRA adapter into ``target.model`` in place (logged) once the
    drafter is built: decode and compare with this same, now merged, target.

    Raises:
        HeadwayError: (HeadsError, TargetError, ConfigError) heads that do not fit the target,
            missing files, a corpus without answers, ... in one line.
    """
    if isinstance(spec, PromptLookupSpec):
        return PromptLookupDrafter(
            max_ngram=spec.max_ngram,
            min_ngram=spec.min_ngram,
            num_draft_tokens=spec.num_draft_tokens,
            max_nodes=spec.max_nodes,
            adaptive=spec.adaptive,
        )
    if isinstance(spec, RetrievalSpec):
        retrieval = retrieval_drafter(target, spec)
        if not spec.heads:
            return retrieval
        options = {"force": True} if spec.force else {}
        behind = build_drafter(spec_for(heads=spec.heads, options=options), target)
        return FirstDrafter([*retrieval.drafters, behind], self_sized=retrieval.self_sized)
    found = find_heads(spec.heads, target.model, force=spec.force)
    if isinstance(spec, LookupMedusaSpec):
        return lookup_medusa_drafter(target, spec, found)
    drafter: Drafter
    if isinstance(spec, MedusaSpec):
        drafter = _medusa(found, target, spec)
    else:
        drafter = _eagle(found, target, spec)
    if found.merges_adapter:
        merge_adapter(found.directory, target.model)
    return drafter


def _medusa(found: FoundHeads, target: Target, spec: MedusaSpec) -> Drafter:
    config = found.config
    if not isinstance(config, MedusaConfig):
        raise HeadsError(f"{spec.heads} holds {found.method} weights, not Medusa heads")
    model = target.model
    lm_head = model.get_output_embeddings().weight
    if tuple(lm_head.shape) != (config.vocab_size, config.hidden_size):
        raise HeadsError(
            f"heads of hidden size {config.hidden_size} and vocabulary {config.vocab_size} cannot "
            f"run on a target whose LM head is {list(lm_head.shape)}, not even with force"
        )
    config, state, vocab = narrow_medusa(config, found.state_dict, _draft_vocab(spec, target))
    heads = MedusaHeads.trained(config, state, device=lm_head.device, dtype=lm_head.dtype)
    layer = final_hidden_layer(model)
    check_final_hidden(model, layer)
    try:
        tree = medusa_tree(spec.tree, config)
    except ValueError as error:  # a tree these heads or this vocabulary cannot fill
        raise HeadsError(f"Medusa drafter: {error}; change the tree (--tree)") from error
    if _drafts_in_int8(heads, spec):
        count = to_int8(heads, int8_layers(heads) or ())
        logger.info("drafting with %d int8 LM heads (dtype=%s)", count, spec.dtype)
    apply_gemm(heads, gemm_choice(model))  # the target's choice, for the layers left
    drafter = MedusaDrafter(heads, hidden_layer=layer, choices=tree.choices, vocab=vocab)
    drafter.couples = spec.coupled
    return drafter


def _eagle(found: FoundHeads, target: Target, spec: EagleSpec) -> Drafter:
    model = target.model
    total_tokens = spec.total_tokens
    if total_tokens == "auto":
        total_tokens = auto_total_tokens(model)
    config = found.config
    static = spec.drafting in ("static", "compiled")
    try:
        if isinstance(config, Eagle3Config):
            check_final_hidden(model, final_hidden_layer(model))  # the target's logits: final
            state, keep = found.state_dict, _draft_vocab(spec, target)
            if keep is not None:
                config, state = narrow_eagle3(config, state, keep)
            eagle3 = (StaticEagle3Drafter if static else Eagle3Drafter)(
                _draft(eagle3_model(config, state, model), spec, model),
                _head(model),
                top_k=spec.top_k,
                depth=spec.depth,
                total_tokens=total_tokens,
            )
            return _compiled(eagle3, spec)
        if isinstance(config, EagleConfig):
            layer = final_hidden_layer(model)
            check_final_hidden(model, layer)
            vocab = _draft_vocab(spec, target)
            eagle1 = (StaticEagleDrafter if static else EagleDrafter)(
                _draft(eagle_model(config, found.state_dict, model), spec, model),
                _head(model, vocab),
                hidden_layer=layer,
                top_k=spec.top_k,
                depth=spec.depth,
                total_tokens=total_tokens,
                vocab=vocab,
            )
            return _compiled(eagle1, spec)
    except ValueError as error:
        raise HeadsError(f"{spec.heads}: {error}") from error
    raise HeadsError(f"{spec.heads} holds {found.method} weights, not an EAGLE drafter")


def _compiled(drafter: EagleDrafter, spec: EagleSpec) -> EagleDrafter:
    """``drafter``, its static steps' forwards compiled where ``spec.drafting`` says so, and
    coupled to a sampled sequence's noise where ``spec.coupled`` says so."""
    drafter.couples = spec.coupled
    if spec.drafting == "compiled":
        assert isinstance(drafter, StaticDrafting)
        drafter.compile_steps()
    return drafter


def _draft_vocab(spec: MedusaSpec | EagleSpec, target: Target) -> Tensor | None:
    """The sorted target ids ``spec.draft_vocab`` names (FR-Spec), or ``None`` for all."""
    if not spec.draft_vocab:
        return None
    ids = draft_vocabulary(Path(spec.draft_vocab), target.tokenizer, spec.draft_vocab_size)
    logger.info("drafting over the %d most frequent tokens of %s", ids.numel(), spec.draft_vocab)
    return ids


DraftModel = TypeVar("DraftModel", bound=nn.Module)


INT8_LAYERS: dict[type[nn.Module], tuple[str, ...]] = {Eagle3Model: ("midlayer", "lm_head")}
"""The draft layers int8 drafting converts, per draft model: those whose inputs are normalised.
EAGLE-3's ``fc`` reads the raw target states (outlier channels) and stays as it is: converting it
too cut the shipped drafter's MT-bench tau from 2.39 to 1.88 (docs/benchmarks.md). EAGLE-1's
layer reads ``fc``'s output unnormalised, so it drafts in the target's dtype. Medusa heads:
:func:`int8_layers`."""


def int8_layers(draft: nn.Module) -> tuple[str, ...] | None:
    """The layers int8 drafting converts in ``draft``: :data:`INT8_LAYERS`, and for Medusa heads
    (``dtype=int8`` only: no ``auto``) every head's LM head (``[V, H]``, nearly all of their
    weights). Those read the target's final state through the residual blocks, whose outlier
    channels a per-tensor input scale rounds away: SmolLM2's own LM head in int8 picks its fp32
    argmax at 86.8% of 1,288 MT-bench positions (docs/benchmarks.md). ``None`` where none are."""
    if isinstance(draft, MedusaHeads):
        return tuple(f"heads.{index}.lm_head" for index in range(len(draft.heads)))
    return INT8_LAYERS.get(type(draft))


def _draft(draft: DraftModel, spec: EagleSpec, target_model: nn.Module) -> DraftModel:
    """``draft`` in the spec's dtype (int8 layers where :func:`_drafts_in_int8` says so), the
    target's GEMM choice applied to its other layers."""
    draft = _in_dtype(draft, spec.dtype)
    if _drafts_in_int8(draft, spec):
        count = to_int8(draft, INT8_LAYERS[type(draft)])
        logger.info("drafting with %d int8 layers (dtype=%s)", count, spec.dtype)
    apply_gemm(draft, gemm_choice(target_model))
    return draft


def _drafts_in_int8(draft: nn.Module, spec: EagleSpec | MedusaSpec) -> bool:
    """``dtype=int8``: yes, where it can run (else a one-line error); ``auto``: where eager
    drafting on a CPU multiplies the layers faster in int8 (:func:`int8_pays`, timed once per
    machine and layer shapes, :mod:`headway.timings`)."""
    names = int8_layers(draft)
    on_cpu = all(p.device.type == "cpu" for p in draft.parameters())
    drafting = spec.drafting if isinstance(spec, EagleSpec) else "eager"
    instead = "dtype=auto" if isinstance(spec, EagleSpec) else "dtype=target"
    if spec.dtype == "int8":
        if names is None:
            raise HeadsError(
                f"{spec.heads}: dtype=int8 is for EAGLE-3 drafters and Medusa heads; this "
                "EAGLE-1 drafter reads unnormalised states: use dtype=target"
            )
        if not on_cpu:
            raise HeadsError(f"{spec.heads}: dtype=int8 drafts on a CPU; use {instead} here")
        if not int8_available():
            raise HeadsError(
                f"{spec.heads}: dtype=int8: this machine's torch has no working int8 linear "
                f"kernels (`headway env` says so); use {instead}"
            )
        return True
    if spec.dtype != "auto" or names is None or drafting != "eager" or not on_cpu:
        return False
    layers = nn.ModuleList([draft.get_submodule(name) for name in names])
    return bool(
        remembered(
            "int8 drafting",
            {"layers": shapes_digest(layers)},
            lambda: int8_pays(draft, names),
            device=torch.device("cpu"),
            valid=lambda value: isinstance(value, bool),
        )
    )


def _head(target_model: PreTrainedModel, vocab: Tensor | None = None) -> TargetHead:
    """The target's embedding and LM head (only the rows of ``vocab`` if given, a copy:
    :func:`~headway.drafters.draft_vocab.narrow_head`), the head on the target's GEMM choice."""
    head = TargetHead.of(target_model)
    if vocab is not None:
        head = narrow_head(head, vocab)
    apply_gemm(head.lm_head, gemm_choice(target_model))
    return head


def _in_dtype(draft: DraftModel, dtype: str) -> DraftModel:
    """``draft`` cast to ``EagleSpec.dtype`` (``target``: left in the target's dtype; integer
    buffers such as EAGLE-3's vocabulary maps stay integer)."""
    if dtype == "bfloat16":
        draft.to(torch.bfloat16)
    return draft


def describe_spec(spec: DrafterSpec) -> dict[str, Any]:
    """The spec as report data: ``{"name": ..., every option}``."""
    return {"name": spec.name, **dataclasses.asdict(spec)}
