"""``headway eval --heads-only``: how often each head / draft step guesses right, without decoding.

It lives in training, not ``eval/``, because it replays a training method.

It replays the run's own training method on held-out data: the run directory's
``train_config.json`` rebuilds the method (:func:`headway.train.methods.build_method`), the saved
heads are loaded into it, and the target's features are computed online. The figures are the
method's own loss metrics (``head{k}/top1``, ``head{k}/top5`` for Medusa; ``depth1/top1`` ... for
EAGLE), averaged over held-out *tokens*: a metric ``P/x`` is weighted by ``P/tokens`` when the
method reports it, else by ``tokens``, else by batch. Token counts are summed.

The held-out split is the one training evaluated on (same sources, ``data.eval_fraction`` and
``train.seed``), unless other data sources are given, whose held-out fraction is used instead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from headway.atomic import write_text_atomic
from headway.config import load_config
from headway.errors import HeadwayError
from headway.heads.io import load_heads
from headway.run_config import RunConfig
from headway.target import Target, check_fingerprint, fingerprint, load_target
from headway.train.features import OnlineFeatures
from headway.train.loop_data import training_data
from headway.train.methods import build_method

__all__ = [
    "HeadsOnlyResult",
    "heads_only",
    "load_trained_method",
    "run_config_of",
    "weighted_means",
]

logger = logging.getLogger(__name__)
TRAIN_CONFIG = "train_config.json"
HEADS_REPORT = "heads_report.json"


@dataclass
class HeadsOnlyResult:
    """Held-out accuracy of a run's heads.

    Attributes:
        metrics: token-weighted means of the method's metrics (counts summed).
        groups: the same metrics grouped by head / depth prefix, e.g.
            ``{"head1": {"top1": 0.33, "top5": 0.55, "tokens": 812.0}}``; metrics without a
            prefix are under ``""``.
    """

    run_dir: str
    method: str
    samples: int
    metrics: dict[str, float]
    groups: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir,
            "method": self.method,
            "split": "held-out",
            "samples": self.samples,
            "metrics": self.metrics,
            "groups": self.groups,
        }

    def table(self) -> str:
        """A Markdown table: one row per head / depth, one column per metric."""
        columns = sorted({name for group in self.groups.values() for name in group})
        lines = ["| head | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for prefix, values in self.groups.items():
            cells = [f"{values[c]:.4g}" if c in values else "" for c in columns]
            lines.append(f"| {prefix or '(all)'} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def run_config_of(run_dir: Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The training config saved in ``run_dir`` (with ``section.key=value`` overrides)."""
    path = run_dir / TRAIN_CONFIG
    if not path.is_file():
        raise HeadwayError(
            f"{run_dir} has no {TRAIN_CONFIG}: --heads-only needs a run directory written by "
            "`headway train` (exports carry no training config)"
        )
    return load_config(RunConfig, path, overrides)  # JSON is YAML, so the same loader reads it


def _trainable_child(method: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """The submodule of ``method`` whose state-dict keys are exactly the saved heads' keys
    (``Method.export`` saves one such submodule: Medusa's ``heads``, EAGLE's ``draft``)."""
    wanted = set(state)
    for _, child in method.named_children():
        if set(child.state_dict()) == wanted:
            return child
    raise HeadwayError(
        f"the saved weights ({len(wanted)} tensors) fit no part of the {type(method).__name__} "
        "method rebuilt from train_config.json; was the run trained by another headway version?"
    )


def load_trained_method(run_dir: Path, config: RunConfig, target: Target, *, force: bool) -> Any:
    """Rebuild the run's training method for ``target`` and load the saved heads into it."""
    loaded = load_heads(run_dir)
    check_fingerprint(loaded.fingerprint, fingerprint(target.model), force=force)
    method = build_method(config, target, from_init=False)  # the run's own heads replace them
    _trainable_child(method, loaded.state_dict).load_state_dict(loaded.state_dict)
    load_adapter = getattr(method, "load_adapter", None)  # Medusa-2: the heads read the adapted
    if load_adapter is not None:  # target, so its LoRA weights come back too
        load_adapter(run_dir)
    return method.to(target.model.device).eval()


def _weight_key(name: str, metrics: dict[str, float]) -> str | None:
    prefix = name.rsplit("/", 1)[0] if "/" in name else ""
    if prefix and f"{prefix}/tokens" in metrics:
        return f"{prefix}/tokens"
    return "tokens" if "tokens" in metrics else None


def _is_count(name: str) -> bool:
    return name == "tokens" or name.endswith("/tokens")


def weighted_means(batches: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine per-batch metrics: counts (``tokens``, ``P/tokens``) are summed, every other metric
    is averaged with its count as weight (see the module docstring)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics in batches:
        for name, value in metrics.items():
            if _is_count(name):
                sums[name] = sums.get(name, 0.0) + value
                continue
            key = _weight_key(name, metrics)
            weight = metrics[key] if key is not None else 1.0
            sums[name] = sums.get(name, 0.0) + value * weight
            weights[name] = weights.get(name, 0.0) + weight
    return {
        name: total if _is_count(name) else (total / weights[name] if weights[name] else 0.0)
        for name, total in sorted(sums.items())
    }


def _grouped(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    groups: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        prefix, _, metric = name.rpartition("/")
        groups.setdefault(prefix, {})[metric] = value
    return dict(sorted(groups.items(), key=lambda item: (item[0] == "", item[0])))


def heads_only(
    run_dir: Path,
    *,
    overrides: Sequence[str] = (),
    num_samples: int | None = 64,
    batch_size: int = 4,
    force: bool = False,
    out_dir: Path | None = None,
    progress: bool = True,
) -> HeadsOnlyResult:
    """Accuracy of every head / draft step of ``run_dir`` on held-out data (module docstring).

    Args:
        overrides: ``section.key=value`` changes to the saved config, e.g. other
            ``data.sources`` or ``target.device``; features are always computed online.
        num_samples: use at most this many held-out samples (None: all of them).
        out_dir: if given, ``heads_report.json`` is written there.
    """
    online = ["data.features=online", "data.features_dir=null"]
    config = run_config_of(run_dir, [*overrides, *online])
    target = load_target(
        config.target.name,
        dtype=config.target.dtype,
        device=config.target.device,
        trust_remote_code=config.target.trust_remote_code,
        attn_implementation=config.target.attn_implementation,
    )
    _, split, collate = training_data(config, target)
    held_out: Any = split  # a torch Subset, so sized, though typed as a plain Dataset
    if num_samples is not None:
        held_out = Subset(held_out, range(min(num_samples, len(held_out))))
    method = load_trained_method(run_dir, config, target, force=force)
    features = OnlineFeatures(target.model, method.feature_layers)
    loader = DataLoader(held_out, batch_size=batch_size, collate_fn=collate)
    per_batch = []
    with torch.no_grad():
        for batch in tqdm(loader, desc="heads-only", unit="batch", disable=not progress):
            batch = {key: value.to(target.model.device) for key, value in batch.items()}
            per_batch.append(method(batch, features(batch)).metrics)
    metrics = weighted_means(per_batch)
    result = HeadsOnlyResult(
        str(run_dir), config.train.method, len(held_out), metrics, _grouped(metrics)
    )
    if out_dir is not None:
        write_text_atomic(out_dir / HEADS_REPORT, json.dumps(result.to_dict(), indent=2) + "\n")
    return result
