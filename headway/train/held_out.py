"""The held-out evaluation of a training run: mean loss and metrics, with a progress bar."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm.auto import tqdm

from headway.train.features import Batch, FeatureSource

__all__ = ["evaluate", "first_samples"]


def first_samples(dataset: Dataset[Any], limit: int | None) -> Dataset[Any]:
    """The first ``limit`` samples of ``dataset`` (all of them for ``None``, or when fewer)."""
    size = len(dataset)  # type: ignore[arg-type]
    if limit is None or limit >= size:
        return dataset
    return Subset(dataset, range(limit))


@torch.no_grad()
def evaluate(
    method: nn.Module,
    loader: DataLoader[Batch],
    features: FeatureSource,
    accelerator: Accelerator,
) -> dict[str, float]:
    """Mean loss and metrics over the held-out loader (averaged over batches and processes);
    the main process shows a progress bar (a held-out set of a large corpus takes minutes on a
    CPU: ``data.eval_max_samples`` bounds it)."""
    was_training = method.training
    method.eval()
    totals: dict[str, float] = {}
    batches = 0
    shown = tqdm(
        loader,
        desc="held-out eval",
        unit="batch",
        leave=False,
        disable=not accelerator.is_main_process,
    )
    for batch in shown:
        output = method(batch, features(batch))
        values = {"loss": float(output.loss), **output.metrics}
        for name, value in values.items():
            totals[name] = totals.get(name, 0.0) + value
        batches += 1
    method.train(was_training)
    names = sorted(totals)
    local = torch.tensor([totals[n] for n in names] + [batches], device=accelerator.device)
    summed = accelerator.reduce(local, reduction="sum")
    count = max(float(summed[-1]), 1.0)
    return {f"eval/{name}": float(summed[i]) / count for i, name in enumerate(names)}
