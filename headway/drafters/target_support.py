"""What headway can do with a target: every check it makes, run once, every refusal said at once.

headway refuses a target where it cannot stay lossless, each refusal where the capability is
first used: the cache's layers and the mask probe when decoding starts
(:mod:`headway.decode.kv`, :mod:`headway.decode.probe`), the hidden states when a Medusa or EAGLE
drafter is built or trained (:mod:`headway.heads.hidden_states`), EAGLE-3's feature layers when
its config is made (:func:`~headway.heads.eagle3.default_feature_layers`), local attention when
a batch of prompts is (:class:`~headway.decode.batch_step.BatchVerify`). A person choosing a
target wants all of them before training anything: :func:`target_support` runs those same checks
(no second implementation of any) and reports each as a :class:`Support` row, the reason of a
refusal in the words the point of use would raise it with (``headway check``).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

from transformers import PreTrainedModel

from headway.decode.batch_step import BatchVerify
from headway.decode.captured import StaticForward
from headway.decode.kv import context_limit, recurrent_layer
from headway.decode.local_attention import (
    attention_chunk,
    has_local_attention,
    mask_types,
    mixes_with_one_mask,
    sliding_window,
)
from headway.decode.probe import check_tree_mask
from headway.errors import HeadwayError
from headway.heads.eagle3 import default_feature_layers
from headway.heads.hidden_states import check_final_hidden, final_hidden_layer

__all__ = [
    "ATTENTION",
    "BATCHED",
    "EAGLE3",
    "FEATURES",
    "REGENERATION",
    "STATIC",
    "TREE",
    "Support",
    "regeneration_engine",
    "target_support",
]

TREE, ATTENTION, STATIC, BATCHED = "tree decoding", "attention", "static verify", "batched"
FEATURES, EAGLE3, REGENERATION = "Medusa, EAGLE-1/2", "EAGLE-3", "regeneration"


@dataclass(frozen=True)
class Support:
    """One capability of headway on a target.

    Attributes:
        capability: what it is about (``"tree decoding"``, ``"EAGLE-3"``, ...).
        ok: whether headway does it for this target.
        detail: how it does it, or the one-line reason it refuses.
    """

    capability: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def target_support(model: PreTrainedModel) -> tuple[Support, ...]:
    """Every capability row for ``model`` (in its own dtype and device: the mask probe runs a
    few tiny forwards, the hidden-state check one): tree decoding, what its attention needs,
    the static verify path, batched decoding, Medusa and EAGLE-1/2 drafters, EAGLE-3 drafters,
    regeneration."""
    tree = _tree(model)
    rows = [tree, _attention(model), _static(model, tree), _batched(model, tree)]
    features = _features(model, tree)
    return (*rows, features, _eagle3(model, features), _regeneration(model))


def _tree(model: PreTrainedModel) -> Support:
    try:
        check_tree_mask(model)  # the cache's layers first, then the probe forwards
    except HeadwayError as error:
        return Support(TREE, False, str(error))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    limit = context_limit(model)
    context = (
        "no context limit in its config" if limit == sys.maxsize else f"up to {limit:,} tokens"
    )
    return Support(
        TREE,
        True,
        f"a tree verified in one forward equals each path decoded alone (mask probe, {dtype}); "
        f"prompt lookup and retrieval draft for it; {context}",
    )


def _attention(model: PreTrainedModel) -> Support:
    window, mixed = sliding_window(model)
    chunk = attention_chunk(model)
    if not has_local_attention(model):
        return Support(ATTENTION, True, "every layer attends to the whole prefix")
    local = f"a sliding window of {window:,} tokens" if window else f"chunks of {chunk:,} tokens"
    per_type = len(mask_types(model)) > 1
    if window and not mixed:
        how = "every layer slides: one windowed mask"
    elif per_type:
        how = "one mask per layer type (transformers' causal_mask_mapping)"
    else:
        span = window if window else chunk
        return Support(
            ATTENTION,
            True,
            f"layers with {local} beside full ones, and a forward that takes a single mask: "
            f"decoding is refused past the first {span:,} tokens",
        )
    return Support(ATTENTION, True, f"layers with {local}, masked exactly: {how}")


def _static(model: PreTrainedModel, tree: Support) -> Support:
    if not tree.ok:
        return Support(STATIC, False, "needs tree decoding")
    steps = (
        "trees are checked against the window on the host each step"
        if has_local_attention(model)
        else "trees stay on the device, one host read a step (the device step)"
    )
    return Support(
        STATIC,
        True,
        f"over a static cache (--verify captured or compiled: CUDA graphs on a GPU); {steps}",
    )


def _batched(model: PreTrainedModel, tree: Support) -> Support:
    if not tree.ok:
        return Support(BATCHED, False, "needs tree decoding")
    try:  # what generate --batch builds (no memory until a forward)
        BatchVerify(StaticForward(model, capture=False, batch=2), max_depth=1)
    except HeadwayError as error:
        return Support(BATCHED, False, str(error))
    return Support(
        BATCHED,
        True,
        "generate --batch: several prompts verified in one forward a step (any drafter; "
        "EAGLE and Medusa draft every prompt at once; greedy or sampled; --batch-size)",
    )


def _features(model: PreTrainedModel, tree: Support) -> Support:
    if not tree.ok:
        return Support(FEATURES, False, "needs tree decoding")
    layer = final_hidden_layer(model)
    try:
        check_final_hidden(model, layer)
    except HeadwayError as error:
        return Support(FEATURES, False, str(error))
    return Support(
        FEATURES,
        True,
        f"trained and run on output_hidden_states[{layer}], checked to be the LM head's input",
    )


def _eagle3(model: PreTrainedModel, features: Support) -> Support:
    if not features.ok:
        return Support(EAGLE3, False, f"needs what {FEATURES} needs: {features.detail}")
    layers = int(model.config.get_text_config().num_hidden_layers)
    try:
        low, middle, high = default_feature_layers(layers)
    except HeadwayError as error:
        return Support(EAGLE3, False, str(error))
    return Support(
        EAGLE3,
        True,
        f"fuses output_hidden_states[{low}], [{middle}] and [{high}] of its {layers} layers "
        "(the engines' default)",
    )


def regeneration_engine(model: PreTrainedModel) -> str:
    """The engine ``headway data regenerate --engine auto`` answers with on ``model``: the
    batched decoder (``batch``), or HF ``generate`` for a target the batched steps refuse:
    recurrent layers, whose state no row-by-row cache places, or local and full layers under
    one mask (:func:`~headway.decode.local_attention.mixes_with_one_mask`)."""
    if recurrent_layer(model) is not None or mixes_with_one_mask(model):
        return "generate"
    return "batch"


def _regeneration(model: PreTrainedModel) -> Support:
    if regeneration_engine(model) == "batch":
        how = "the batched decoder of generate --batch (--engine auto)"
    else:
        why = recurrent_layer(model) or "local and full layers under one mask"
        how = f"HF generate in padded batches ({why}; --engine auto)"
    return Support(REGENERATION, True, f"headway data regenerate answers with {how}")
