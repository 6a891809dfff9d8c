"""One forward of an EAGLE draft model over a static cache of ``B`` rows (the static drafter's
and the batch's, :mod:`headway.drafters.static_eagle`, :mod:`headway.drafters.batch_eagle`)."""

from __future__ import annotations

from torch import Tensor

from headway.decode.static_cache import StaticCache
from headway.drafters.eagle_drafter import EagleDrafter
from headway.heads.eagle import additive_mask

__all__ = ["draft_forward"]


def draft_forward(
    drafter: EagleDrafter,
    cache: StaticCache,
    features: Tensor,
    tokens: Tensor,
    positions: Tensor,
    columns: Tensor,
    visible: Tensor,
) -> Tensor:
    """One forward of ``drafter``'s draft model over a static ``cache`` of ``B`` rows: pairs
    (``features [B, m, H]``, ``tokens [B, m]``) at ``positions [B, m]``, their keys written at
    ``columns [B, m]``, row ``b``'s entry ``i`` attending to the columns ``visible[b, i]``
    marks (``[B, m, capacity]``); returns the predicted states ``[B, m, H]``."""
    cache.columns[:, : columns.shape[-1]].copy_(columns)
    dtype = drafter.model.fc.weight.dtype
    return drafter.model(
        features,
        drafter.head.embed_tokens(tokens, dtype),
        position_ids=positions,
        attention_mask=additive_mask(visible, dtype)[:, None],
        cache=cache,
    )
