"""The training loop, on accelerate: one process or many, CPU or GPU, one code path.

``headway train --config X`` and ``accelerate launch -m headway.train --config X`` both land in
:func:`train`. It does gradient accumulation, mixed precision where the device supports it, AdamW
with linear warm-up and cosine decay, gradient clipping, periodic held-out evaluation, trackers
(tensorboard / wandb through accelerate), and checkpoints with ``accelerator.save_state`` that
hold weights, optimizer, scheduler, RNG states and the data position, so ``--resume`` continues
exactly where the run stopped. Checkpoints are written to a temporary folder and renamed.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch import Tensor, nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from headway.atomic import write_text_atomic
from headway.config import to_dict
from headway.errors import TrainingError
from headway.hardware import mixed_precision
from headway.heads.io import save_heads
from headway.locks import exclusive_folder, rank_lock_name
from headway.run_config import RunConfig
from headway.target import fingerprint, load_target
from headway.train.curves import CURVE_FILE, record_eval, simulated_tau, write_learning_curve
from headway.train.data_stats import steps_line
from headway.train.features import Batch, FeatureSource
from headway.train.held_out import evaluate, first_samples
from headway.train.loop_data import feature_source, training_data
from headway.train.methods import build_method, feature_layers
from headway.train.ranks import end_training
from headway.train.schedule import cosine_with_warmup
from headway.train.sharding import shard_target, should_shard, take_fsdp_launch

logger = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"
KEEP_CHECKPOINTS = 2


@dataclass
class Progress:
    """Where the run is: optimizer steps done, epoch, micro-batches consumed in this epoch.

    Registered with accelerate so it is saved and restored with every checkpoint.
    """

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    trained_tokens: int = 0  # over all processes

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "trained_tokens": self.trained_tokens,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        self.trained_tokens = int(state.get("trained_tokens", 0))  # older checkpoints lack it


def _accelerator(config: RunConfig, run_dir: Path) -> Accelerator:
    # accelerate trains on CUDA where there is one, else on the CPU
    mixed = mixed_precision(
        config.train.mixed_precision, "cuda" if torch.cuda.is_available() else "cpu"
    )
    # Several processes without CUDA must be told to use CPU DDP (gloo); accelerate otherwise
    # runs each of them as an independent single-process job.
    multi_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(
        cpu=multi_cpu,
        gradient_accumulation_steps=config.train.grad_accum,
        mixed_precision=mixed,
        log_with=list(config.train.log_with) or None,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir)),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        step_scheduler_with_optimizer=False,
    )


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of `run_dir` (incomplete ones are never renamed in)."""
    found = sorted((run_dir / CHECKPOINTS).glob("step-*"), key=lambda p: int(p.name[5:]))
    return found[-1] if found else None


def _save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int) -> None:
    """``save_state`` into a temporary folder, then rename it to ``checkpoints/step-N``."""
    final = run_dir / CHECKPOINTS / f"step-{step:07d}"
    staging = final.with_name(f".{final.name}.partial")
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        for old in sorted((run_dir / CHECKPOINTS).glob("step-*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _remove_partial_checkpoints(run_dir: Path) -> None:
    """Remove ``checkpoints/.step-N.partial`` folders that killed runs left: this run holds the
    folder's writer lock, so no live process is writing them."""
    for partial in sorted((run_dir / CHECKPOINTS).glob(".step-*.partial")):
        logger.info("removing %s, a checkpoint a killed run did not finish", partial)
        shutil.rmtree(partial, ignore_errors=True)


def _epochs(
    loader: DataLoaderShard, accelerator: Accelerator, progress: Progress
) -> Iterator[Batch]:
    """Batches forever, epoch after epoch, starting at the saved position of the saved epoch.

    Fetching batches leaves the global RNG untouched (:func:`_rng_neutral`): a DataLoader draws a
    seed from it whenever an epoch's iterator starts, and a resumed run starts its iterator at
    another moment than the uninterrupted run did, so any randomness of the training step
    (dropout, feature noise) would otherwise differ after ``--resume``. The order itself comes
    from accelerate's sampler, seeded by ``train.seed`` and the epoch.
    """
    while True:
        loader.set_epoch(progress.epoch)
        skip = progress.batches_in_epoch
        epoch_loader = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in _rng_neutral(epoch_loader):
            progress.batches_in_epoch += 1
            yield batch
        progress.epoch += 1
        progress.batches_in_epoch = 0


def _rng_neutral(loader: Iterable[Batch]) -> Iterator[Batch]:
    """Iterate ``loader`` with the global CPU RNG restored after every fetch."""
    state = torch.get_rng_state()
    iterator = iter(loader)
    torch.set_rng_state(state)
    while True:
        state = torch.get_rng_state()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        finally:
            torch.set_rng_state(state)
        yield batch


def _check_finite(loss: Tensor, progress: Progress) -> None:
    if not torch.isfinite(loss).all():
        raise TrainingError(
            f"loss is {loss.item()} at step {progress.step + 1} (epoch {progress.epoch}, batch "
            f"{progress.batches_in_epoch}); the last good checkpoint is kept. Lower train.lr, "
            "check the data of that batch, or use mixed_precision=no"
        )


def train(config: RunConfig, *, resume: bool = False) -> Path:
    """Train ``config.train.method`` and save the heads to ``config.train.output_dir``.

    Returns:
        The run directory (``config.json`` + ``model.safetensors`` + ``checkpoints/``).

    Raises:
        FolderBusyError: when another run is writing ``train.output_dir``.
    """
    run_dir = Path(config.train.output_dir)
    with exclusive_folder(run_dir, what="train.output_dir", name=rank_lock_name()):
        return _train(config, run_dir, resume=resume)


def _train(config: RunConfig, run_dir: Path, *, resume: bool) -> Path:
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        raise TrainingError(f"--resume: {run_dir}/{CHECKPOINTS} has no checkpoint to resume from")
    if not resume and latest_checkpoint(run_dir) is not None:
        raise TrainingError(
            f"{run_dir} already holds checkpoints; pass --resume to continue it, or choose "
            "another train.output_dir"
        )
    fsdp_launch = take_fsdp_launch()  # before accelerate reads it: the drafter stays DDP
    accelerator = _accelerator(config, run_dir)
    set_seed(config.train.seed)
    target = load_target(
        config.target.name,
        dtype=config.target.dtype,
        device=accelerator.device,
        trust_remote_code=config.target.trust_remote_code,
        attn_implementation=config.target.attn_implementation,
    )
    train_set, eval_set, collate = training_data(config, target)
    eval_set = first_samples(eval_set, config.data.eval_max_samples)
    method = build_method(config, target, from_init=checkpoint is None)  # resumed: checkpoint
    processes, name = accelerator.num_processes, config.train.method
    if should_shard(config.target.shard, fsdp_launch=fsdp_launch, processes=processes, method=name):
        shard_target(target.model)  # its decoder layers split across the processes
    batch = config.train.batch_size
    train_loader = DataLoader(train_set, batch_size=batch, shuffle=True, collate_fn=collate)
    eval_loader = DataLoader(eval_set, batch_size=batch, collate_fn=collate)
    logger.info("%s", steps_line(config, len(train_set), processes))  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(
        method.parameter_groups(config.train.lr, config.train.weight_decay)  # type: ignore[operator]
    )
    scheduler = cosine_with_warmup(optimizer, config.train.warmup_steps, config.train.max_steps)
    layers = feature_layers(method)
    prepared = accelerator.prepare(method, optimizer, train_loader, eval_loader, scheduler)
    method, optimizer, train_loader, eval_loader, scheduler = prepared
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        logger.info("resumed from %s at step %d", checkpoint, progress.step)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        _remove_partial_checkpoints(run_dir)
        write_text_atomic(run_dir / "train_config.json", json.dumps(to_dict(config), indent=2))
    if config.train.log_with:
        # wandb writes its run folder inside the run directory (not the working directory);
        # WANDB_MODE=offline keeps it off the network.
        accelerator.init_trackers(
            "headway",
            config=_flat(to_dict(config)),
            init_kwargs={"wandb": {"dir": str(run_dir)}},
        )
    features = feature_source(config, target, layers)
    started = time.perf_counter()
    _run_steps(
        config,
        accelerator,
        method,
        optimizer,
        scheduler,
        train_loader,
        eval_loader,
        features,
        progress,
        run_dir,
    )
    summary = _summary(accelerator, method, time.perf_counter() - started)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_text_atomic(run_dir / "training_summary.json", json.dumps(summary, indent=2))
        trained = accelerator.unwrap_model(method)
        head_config, state = trained.export()
        save_heads(
            run_dir,
            method=config.train.method,
            head_config=head_config,
            state_dict=state,
            target_fingerprint=fingerprint(target.model),
            target_name=config.target.name,
        )
        save_extra = getattr(trained, "save_extra", None)  # optional Method hook (methods.py)
        if save_extra is not None:
            save_extra(run_dir)
    accelerator.wait_for_everyone()  # every rank leaves together, after the heads are saved
    del method, optimizer, scheduler, train_loader, eval_loader, prepared  # see end_training
    end_training(accelerator)
    return run_dir


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, else the resident-set high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _summary(accelerator: Accelerator, method: nn.Module, seconds: float) -> dict[str, Any]:
    """Time, memory and a per-process checksum of the trained weights (equal on every rank when
    the processes trained one model)."""
    checksum = sum(float(p.detach().double().sum()) for p in method.parameters() if p.requires_grad)
    local = torch.tensor([checksum, peak_memory_mb(accelerator.device)], device=accelerator.device)
    gathered = accelerator.gather(local.unsqueeze(0)).reshape(-1, 2).tolist()
    return {
        "num_processes": accelerator.num_processes,
        "seconds_this_run": round(seconds, 1),
        "param_checksum_per_process": [row[0] for row in gathered],
        "peak_memory_mb_per_process": [round(row[1], 1) for row in gathered],
    }


def _run_steps(
    config: RunConfig,
    accelerator: Accelerator,
    method: nn.Module,
    optimizer: AcceleratedOptimizer,
    scheduler: AcceleratedScheduler,
    train_loader: DataLoaderShard,
    eval_loader: DataLoader[Batch],
    features: FeatureSource,
    progress: Progress,
    run_dir: Path,
) -> None:
    """Optimizer steps from ``progress.step`` to ``train.max_steps``, with eval and checkpoints."""
    settings = config.train
    method.train()
    bar = tqdm(
        total=settings.max_steps,
        initial=progress.step,
        desc=f"train {settings.method}",
        disable=not accelerator.is_main_process,
        dynamic_ncols=True,
    )
    batches = _epochs(train_loader, accelerator, progress)
    if progress.step == 0 and settings.init_from is not None:  # the heads it starts from
        _evaluate_and_record(method, eval_loader, features, accelerator, progress, run_dir)
    while progress.step < settings.max_steps:
        with accelerator.accumulate(method):
            batch = next(batches)
            tokens = batch["loss_mask"].sum().to(accelerator.device)
            progress.trained_tokens += int(accelerator.reduce(tokens, reduction="sum"))
            output = method(batch, features(batch))
            _check_finite(output.loss, progress)
            accelerator.backward(output.loss)
            if accelerator.sync_gradients and settings.max_grad_norm > 0:
                accelerator.clip_grad_norm_(method.parameters(), settings.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        scheduler.step()
        progress.step += 1
        logs = {"loss": output.loss.item(), "lr": scheduler.get_last_lr()[0], **output.metrics}
        bar.update(1)
        bar.set_postfix({k: f"{v:.3g}" for k, v in logs.items() if k in _SHOWN})
        accelerator.log(logs, step=progress.step)
        if progress.step % settings.eval_every == 0 or progress.step == settings.max_steps:
            _evaluate_and_record(method, eval_loader, features, accelerator, progress, run_dir)
        if progress.step % settings.save_every == 0 or progress.step == settings.max_steps:
            _save_checkpoint(accelerator, run_dir, progress.step)
            after_checkpoint(progress)
    bar.close()


_SHOWN = {"loss", "head1/top1", "depth1/top1"}


def _evaluate_and_record(
    method: nn.Module,
    eval_loader: DataLoader[Batch],
    features: FeatureSource,
    accelerator: Accelerator,
    progress: Progress,
    run_dir: Path,
) -> None:
    """Held-out metrics and tau_sim at ``progress.step``: logged, added to ``eval.jsonl`` and
    drawn into the learning curve."""
    logs = evaluate(method, eval_loader, features, accelerator)
    tau = simulated_tau(logs)
    if tau is not None:
        logs["eval/tau_sim"] = tau
    accelerator.log(logs, step=progress.step)
    if accelerator.is_main_process:
        row = {"step": progress.step, "trained_tokens": progress.trained_tokens, **logs}
        record_eval(run_dir / "eval.jsonl", row)
        write_learning_curve(run_dir / "eval.jsonl", run_dir / CURVE_FILE)


def after_checkpoint(progress: Progress) -> None:
    """Called after every checkpoint; a seam for tests that stop a run there."""


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> flat ``section.key`` mapping of scalars (trackers want flat configs)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, int | float | str | bool) else str(value)
    return flat
