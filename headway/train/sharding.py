"""The frozen target sharded across processes: each decoder layer's weights split over the
processes with FSDP2 (``torch.distributed.fsdp.fully_shard``, FULL_SHARD), gathered layer by
layer inside the target's forward and freed again after it.

Only the decoder layers are sharded. The token embedding, final norm and LM head stay whole on
every process: the drafters call them outside the target's forward
(:class:`~headway.heads.eagle.TargetHead`), a data-dependent number of times per step, which the
collectives of a sharded module could not follow (every process must gather a sharded layer the
same number of times). The target's forward itself runs once per micro-batch on every process
(accelerate gives each process the same number of batches), so its layers' gathers line up.

The target is frozen: no gradients, no optimizer state, forward under ``no_grad``, so sharding
changes no number it computes (a layer computes on its gathered full weights); the hidden states
``output_hidden_states`` returns are the unsharded model's (``tests/test_fsdp_target.py``).

The drafter keeps its training path: accelerate prepares it alone, under DDP. When a run is
launched for FSDP (``accelerate launch --use_fsdp`` or an accelerate config with
``distributed_type: FSDP``), :func:`take_fsdp_launch` takes that request off the process's
environment before accelerate and transformers read it, because both would act on it: accelerate
would wrap the drafter in FSDP (its exported weights, checkpoint layout and gradient clipping
would change), and transformers loads the weights on the first process only when
``fsdp_cpu_ram_efficient_loading`` is set, expecting FSDP to broadcast them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from headway.errors import TargetError, TrainingError

__all__ = [
    "FSDP_LAUNCH",
    "ShardedTarget",
    "decoder_layers",
    "parameter_bytes",
    "shard_target",
    "should_shard",
    "take_fsdp_launch",
]

logger = logging.getLogger(__name__)

FSDP_LAUNCH = "ACCELERATE_USE_FSDP"
"""What ``accelerate launch`` sets for ``--use_fsdp`` or ``distributed_type: FSDP``."""
LAYER_CLASSES = "FSDP_TRANSFORMER_CLS_TO_WRAP"
"""What it sets for ``fsdp_transformer_layer_cls_to_wrap`` (comma-separated class names)."""


def take_fsdp_launch() -> bool:
    """Whether accelerate launched this process for FSDP; the flag is removed from the
    environment so that accelerate prepares the drafter under DDP and transformers loads the
    target's weights on every process. Call it before the ``Accelerator`` is built."""
    return os.environ.pop(FSDP_LAUNCH, "false").strip().lower() in ("true", "1", "yes")


def should_shard(
    setting: Literal["auto", "fsdp", "no"], *, fsdp_launch: bool, processes: int, method: str
) -> bool:
    """``target.shard`` decided: ``auto`` shards under an FSDP launch, ``fsdp`` always, ``no``
    never; one process has nothing to shard over.

    Raises:
        TrainingError: sharding asked for Medusa-2, which trains LoRA adapters inside the target.
    """
    wanted = setting == "fsdp" or (setting == "auto" and fsdp_launch)
    if wanted and method == "medusa2":
        raise TrainingError(
            "accelerate was launched with FSDP, but medusa2 trains LoRA adapters inside the "
            "target, which headway does not shard; launch with --multi_gpu, or set "
            "target.shard=no to keep the whole target on every process"
        )
    return wanted and processes > 1


@dataclass(frozen=True)
class ShardedTarget:
    """What sharding left on this process, in bytes of parameter storage."""

    layers: int  # decoder layers sharded
    processes: int
    layer_bytes: int  # the decoder layers' parameters, whole
    local_layer_bytes: int  # this process's shards of them
    whole_bytes: int  # every parameter of the target, whole
    local_bytes: int  # what this process holds of the target: its shards + the unsharded rest


def parameter_bytes(parameters: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(whole, local) bytes of ``parameters``: a sharded parameter (a ``DTensor``) counts its
    global size as whole and the storage of its local shard (padding included) as local."""
    whole = local = 0
    for parameter in parameters:
        whole += parameter.numel() * parameter.element_size()  # a DTensor's numel is global
        to_local = getattr(parameter, "to_local", None)
        held = to_local() if to_local is not None else parameter
        local += held.untyped_storage().nbytes()
    return whole, local


def decoder_layers(model: nn.Module, class_names: Iterable[str] = ()) -> list[nn.Module]:
    """The decoder layers of ``model``: modules of the classes named (accelerate's
    ``fsdp_transformer_layer_cls_to_wrap``), else of its ``_no_split_modules`` (transformers'
    list of blocks that must stay whole: ``LlamaDecoderLayer``, ``GPT2Block``, ...), outermost
    first-found only.

    Raises:
        TargetError: no module of those classes.
    """
    names = set(class_names) or set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            found.append(module)
            inside.update(id(child) for child in module.modules())
    if not found:
        raise TargetError(
            f"cannot find the decoder layers of {type(model).__name__} to shard (looked for "
            f"{sorted(names) or 'its _no_split_modules, which it does not declare'}); name their "
            "class in fsdp_transformer_layer_cls_to_wrap, or set target.shard=no"
        )
    return found


def shard_target(model: PreTrainedModel) -> ShardedTarget:
    """Shard every decoder layer of the frozen ``model`` over all processes of the default
    process group (gloo on a CPU, NCCL on GPUs), in place; the modules keep their places and
    names, so ``output_hidden_states`` and the drafters' reads of the target are unchanged.

    Each layer is its own FSDP unit with ``reshard_after_forward=True``: only the layer running
    is whole, every other one holds 1/W of its weights (W processes).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise TrainingError("sharding the target needs a process group; launch with accelerate")
    classes = [name for name in os.environ.get(LAYER_CLASSES, "").split(",") if name.strip()]
    layers = decoder_layers(model, (name.strip() for name in classes))
    layer_whole, _ = parameter_bytes(p for layer in layers for p in layer.parameters())
    whole, _ = parameter_bytes(model.parameters())
    model.requires_grad_(False)  # frozen: nothing to reduce, no gradient hooks
    processes = dist.get_world_size()
    mesh = init_device_mesh(model.device.type, (processes,))
    for layer in layers:
        # Explicit True: a module sharded on its own is a root, which FSDP2 would otherwise keep
        # whole after its forward (it expects the backward to gather it again at once).
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    _, local_layers = parameter_bytes(p for layer in layers for p in layer.parameters())
    _, local = parameter_bytes(model.parameters())
    report = ShardedTarget(
        layers=len(layers),
        processes=processes,
        layer_bytes=layer_whole,
        local_layer_bytes=local_layers,
        whole_bytes=whole,
        local_bytes=local,
    )
    logger.info(
        "target sharded (FSDP2, %d decoder layers over %d processes): this process holds "
        "%.1f of %.1f MB of its parameters (layers %.1f of %.1f MB; embedding, final norm and "
        "LM head whole)",
        report.layers,
        processes,
        report.local_bytes / 2**20,
        whole / 2**20,
        local_layers / 2**20,
        layer_whole / 2**20,
    )
    return report
