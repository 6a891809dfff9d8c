"""Fine-tuning: a method's trainable heads start from heads trained before (``train.init_from``)
instead of fresh weights — a run directory or any export :func:`~headway.heads.loading.find_heads`
reads (``drafters/smollm2-135m-eagle3`` included).

The heads must be of the run's method and shape: the settings that shape them (``eagle3.
draft_vocab_size``, ``eagle3.feature_layers``, ``medusa.num_heads`` ...) are compared with the
run's, and a difference is refused in one line naming the field. An EAGLE-3 drafter brings its
draft vocabulary (``d2t``/``t2d``): the run trains over it instead of counting its own. A run
resumed with ``--resume`` takes its weights from its checkpoint, after these.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import fields, is_dataclass

from torch import nn

from headway.errors import ConfigError
from headway.heads.loading import FoundHeads, find_heads
from headway.run_config import RunConfig
from headway.target import Target

__all__ = ["check_head_config", "initial_heads", "load_initial"]


def initial_heads(config: RunConfig, target: Target) -> FoundHeads | None:
    """The heads named by ``train.init_from`` (``None`` when unset), read and checked against the
    target's fingerprint and the run's method.

    Raises:
        HeadsError, TargetError: unreadable heads, or heads trained for another target.
        ConfigError: heads of another method.
    """
    path = config.train.init_from
    if path is None:
        return None
    found = find_heads(path, target.model)
    if found.method != config.train.method:
        raise ConfigError(
            f"train.init_from={path} holds {found.method} heads but train.method="
            f"{config.train.method}; name heads of the same method or change train.method"
        )
    return found


def _same(built: object, loaded: object) -> bool:
    if isinstance(built, float) and isinstance(loaded, float):
        return math.isclose(built, loaded, rel_tol=1e-6)  # configs round-trip through float32
    if isinstance(built, tuple | list) and isinstance(loaded, tuple | list):
        return list(built) == list(loaded)
    return bool(built == loaded)


def check_head_config(
    built: object, found: FoundHeads, section: str, settable: Collection[str]
) -> None:
    """Refuse ``found`` when its head config differs from ``built`` (the run's), in one line
    naming the first differing field; ``settable`` names the fields ``section`` sets (the rest
    follow from the target)."""
    assert is_dataclass(built) and is_dataclass(found.config)
    for item in fields(built):
        mine, theirs = getattr(built, item.name), getattr(found.config, item.name, None)
        if not _same(mine, theirs):
            remedy = (
                f"set {section}.{item.name} to match"
                if item.name in settable
                else "they were built for another target's sizes"
            )
            raise ConfigError(
                f"train.init_from={found.directory}: its {item.name} is {theirs!r}, this run's "
                f"{mine!r}; {remedy}, or leave init_from unset"
            )


def load_initial(module: nn.Module, found: FoundHeads) -> None:
    """Copy ``found``'s weights into ``module`` (cast to its dtypes; every tensor must match by
    name and shape)."""
    try:
        module.load_state_dict(found.state_dict, strict=True)
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0:2]
        raise ConfigError(
            f"train.init_from={found.directory}: its tensors do not fit this run's heads "
            f"({' '.join(line.strip() for line in first)})"
        ) from error
