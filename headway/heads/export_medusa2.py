"""``headway export RUN --format medusa2-target``: the target with a Medusa-2 run's LoRA adapter
merged in, as a plain Hugging Face model folder (``save_pretrained``: ``config.json``,
``model.safetensors``, tokenizer files).

Medusa-2 heads were trained on the *adapted* target and the adapted target is the model that
speaks (:mod:`headway.heads.medusa2`), so an engine needs both: this folder as the served model,
and the heads exported with ``--format medusa`` / ``medusa-vllm`` as its speculative model. The
merge is peft's ``merge_and_unload``, exactly what headway's own decoder does at load time; the
saved model has stock modules only and loads anywhere the original does. Its ``config.json``
records the heads' ``weights_id`` (``headway_merged_adapter``), so headway recognises it as
merged already when the same run's heads are loaded onto it.
"""

from __future__ import annotations

from pathlib import Path

from headway.heads.io import HeadsError, load_heads, staged_directory
from headway.heads.medusa2 import merge_adapter
from headway.target import check_fingerprint, fingerprint, load_target

__all__ = ["export_medusa2_target"]


def export_medusa2_target(
    run_dir: str | Path, out_dir: str | Path, *, target: str | Path | None = None
) -> Path:
    """Load the run's target (``target``, default: the name it was trained with), check its
    fingerprint, merge the run's adapter into it and save it to ``out_dir`` (atomically) in the
    dtype it was loaded in (float32); returns ``out_dir``.

    Raises:
        HeadsError: ``run_dir`` is not a Medusa-2 run, or its adapter is missing or torn.
        TargetError: the target is not the one the run was trained on.
    """
    run_dir = Path(run_dir)
    loaded = load_heads(run_dir)
    if loaded.method != "medusa2":
        raise HeadsError(
            f"{run_dir} is a {loaded.method} run; --format medusa2-target merges a Medusa-2 "
            "run's LoRA adapter, and other methods leave the target unchanged"
        )
    model_source = loaded.target_name if target is None else target
    base = load_target(model_source, device="cpu")
    check_fingerprint(loaded.fingerprint, fingerprint(base.model))
    merge_adapter(run_dir, base.model)
    with staged_directory(out_dir) as staging:
        base.model.save_pretrained(staging)
        base.tokenizer.save_pretrained(staging)
    return Path(out_dir)
