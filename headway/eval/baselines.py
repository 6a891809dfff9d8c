"""Hugging Face's own decoding as the baselines headway is measured against (batch 1, greedy):
``generate`` with its dynamic cache (the CPU baseline), with its prompt-lookup candidates, and over
a ``StaticCache`` (on CUDA transformers compiles its decoding forward there: the best plain
baseline on a GPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import StaticCache

from headway.decode.kv import cache_argument
from headway.eval.speed import EvalSettings, plain_runner
from headway.target import Target

__all__ = ["STATIC_CACHE_COLUMNS", "Runner", "hf_runner"]

Runner = Callable[[Target, torch.Tensor, int], tuple[Callable[[], list[int]], list[Any]]]
"""``(target, ids [P], new tokens) -> (a call that decodes and returns the new ids, the list its
per-generation results land in)``."""

STATIC_CACHE_COLUMNS = 4096
"""Columns of the ``hf greedy, static cache`` row's one cache (prompt + answer), reset between
prompts so transformers compiles its decoding forward once on CUDA."""


def hf_runner(lookup: int | None, *, static: bool = False) -> Runner:
    """HF generate, greedy, optionally with its prompt-lookup candidate generator, or over one
    ``StaticCache`` reset between prompts (``static``: the path on which transformers compiles
    its own decoding forward on CUDA, the best plain baseline there)."""
    settings = EvalSettings(baseline="hf")
    caches: list[Any] = []

    def make(
        target: Target, ids: torch.Tensor, new: int
    ) -> tuple[Callable[[], list[int]], list[Any]]:
        if lookup is None and not static:
            return plain_runner(target, ids, settings, 0, new), []
        model = target.model
        extra: dict[str, Any] = {"prompt_lookup_num_tokens": lookup} if lookup else {}

        def run() -> list[int]:
            batch = ids.to(model.device)[None]
            with torch.inference_mode():  # the cache's tensors are inference tensors
                if static:
                    if not caches:
                        columns = STATIC_CACHE_COLUMNS
                        caches.append(StaticCache(config=model.config, max_cache_len=columns))
                    caches[0].reset()
                    # cache (transformers >= 5.24) or past_key_values (before): the name the
                    # model's forward takes, as for every headway forward
                    extra.update(cache_argument(model, caches[0]))
                out = model.generate(  # type: ignore[operator]
                    batch,
                    attention_mask=torch.ones_like(batch),
                    max_new_tokens=new,
                    do_sample=False,
                    **extra,
                )
            return [int(t) for t in out[0, batch.shape[1] :]]

        return run, []

    return make
