"""The training run's config: :class:`RunConfig` and its sections, each a dataclass of typed,
documented fields, read by :func:`headway.config.load_config` (``headway train --help`` lists
every key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from headway.config import field_help as _help
from headway.errors import ConfigError

__all__ = [
    "MEDUSA2_NEEDS_ONLINE",
    "DataConfig",
    "Eagle3Section",
    "EagleSection",
    "MedusaSection",
    "RunConfig",
    "TargetConfig",
    "TrainConfig",
]


@dataclass
class TargetConfig:
    """The frozen model the drafter serves."""

    name: str = field(
        default="smollm2-135m",
        metadata=_help("HF folder, model id in the local HF cache, .gguf file, or 'smollm2-135m'"),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata=_help("dtype of the frozen target's weights")
    )
    device: str = field(default="auto", metadata=_help("'auto' (CUDA if present), 'cpu', 'cuda:0'"))
    attn_implementation: Literal["auto", "sdpa", "eager"] = field(
        default="auto",
        metadata=_help("attention kernel: auto (sdpa where supported, else eager), sdpa, eager"),
    )
    trust_remote_code: bool = field(
        default=False, metadata=_help("run the model repository's own code (only if you trust it)")
    )
    shard: Literal["auto", "fsdp", "no"] = field(
        default="auto",
        metadata=_help(
            "split the frozen target's decoder layers across the processes (FSDP2 full shard; "
            "embedding and LM head stay whole): auto under an accelerate FSDP launch (--use_fsdp "
            "or distributed_type: FSDP), fsdp under any multi-process launch, no: every process "
            "holds the whole target; the drafter trains under DDP either way"
        ),
    )


@dataclass
class DataConfig:
    """Where the chat data comes from and how it is tokenized."""

    sources: list[str] = field(
        default_factory=lambda: ["chitchat"],
        metadata=_help(
            "embedded corpora ('chitchat', 'sharegpt') and/or .jsonl/.jsonl.gz/.json/.parquet "
            "files (ShareGPT, messages, text)"
        ),
    )
    max_length: int = field(default=1024, metadata=_help("tokens per sample; the tail is dropped"))
    limit: int | None = field(default=None, metadata=_help("use at most this many conversations"))
    skip_bad_rows: bool = field(
        default=False, metadata=_help("skip malformed rows and report them instead of stopping")
    )
    pack: bool = field(
        default=False,
        metadata=_help(
            "pack whole samples into max_length blocks (positions restart and attention stays "
            "inside each sample), so a step trains on tokens rather than padding; online only"
        ),
    )
    loop_repeats: int = field(
        default=0,
        metadata=_help(
            "take an answer's repetition loops out of the samples after their first N periods "
            "(what followed the loop follows them): greedy self-distilled answers of small "
            "targets often end in loops; 0 keeps every token"
        ),
    )
    eval_fraction: float = field(
        default=0.02, metadata=_help("fraction of samples held out for evaluation")
    )
    eval_max_samples: int | None = field(
        default=None,
        metadata=_help(
            "evaluate on at most this many of the held-out samples (the first of the fixed "
            "split; null = all): a held-out 2% of a large corpus is thousands of samples, "
            "minutes per evaluation on a CPU"
        ),
    )
    features: Literal["online", "offline"] = field(
        default="online",
        metadata=_help("online: run the target in each step; offline: read features_dir"),
    )
    features_dir: str | None = field(
        default=None, metadata=_help("feature cache from `headway data cache-features`")
    )

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("data.sources is empty; name at least one dataset")
        if self.max_length < 8:
            raise ConfigError(f"data.max_length={self.max_length} is too small; use >= 8")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"data.limit={self.limit} must be >= 1 (or null for all)")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if self.eval_max_samples is not None and self.eval_max_samples < 1:
            raise ConfigError(
                f"data.eval_max_samples={self.eval_max_samples} must be >= 1 (or null for all)"
            )
        if self.features == "offline" and not self.features_dir:
            raise ConfigError("data.features=offline needs data.features_dir (a feature cache)")
        if self.loop_repeats < 0:
            raise ConfigError(f"data.loop_repeats={self.loop_repeats} must be >= 0 (0 = off)")
        if self.features == "offline" and self.loop_repeats:
            raise ConfigError(
                "data.loop_repeats applies when samples are tokenized; offline features were "
                "cached already: pass --loop-repeats to `headway data cache-features` instead"
            )


@dataclass
class TrainConfig:
    """The optimisation loop (accelerate)."""

    method: Literal["medusa1", "medusa2", "eagle1", "eagle3"] = field(
        default="medusa1", metadata=_help("which drafter to train")
    )
    output_dir: str = field(default="runs/headway", metadata=_help("run directory"))
    lr: float = field(default=1e-3, metadata=_help("peak learning rate (AdamW)"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay"))
    warmup_steps: int = field(default=50, metadata=_help("linear warm-up steps before cosine"))
    max_steps: int = field(default=1000, metadata=_help("optimizer steps in total"))
    batch_size: int = field(default=4, metadata=_help("samples per device per micro-batch"))
    grad_accum: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping (0 = off)"))
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = field(
        default="no",
        metadata=_help(
            "accelerate mixed precision, also for the frozen target's forward (default no); auto "
            "is bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 or AMX), no elsewhere "
            "(on an AVX2-only CPU bf16 is emulated, many times slower than fp32); "
            "`headway env` says what auto picks here"
        ),
    )
    seed: int = field(default=0, metadata=_help("seed for weights, data order and noise"))
    init_from: str | None = field(
        default=None,
        metadata=_help(
            "fine-tune: start the drafter from these heads (a run directory or an export headway "
            "reads) instead of fresh weights; EAGLE-3 keeps their draft vocabulary"
        ),
    )
    eval_every: int = field(default=200, metadata=_help("steps between held-out evaluations"))
    save_every: int = field(default=200, metadata=_help("steps between checkpoints"))
    log_with: list[str] = field(
        default_factory=list, metadata=_help("accelerate trackers: tensorboard, wandb")
    )

    def __post_init__(self) -> None:
        positive = {
            "lr": self.lr,
            "max_steps": self.max_steps,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "eval_every": self.eval_every,
            "save_every": self.save_every,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"train.{name}={value} must be > 0")
        if self.warmup_steps < 0 or self.warmup_steps > self.max_steps:
            raise ConfigError(
                f"train.warmup_steps={self.warmup_steps} must be in [0, max_steps={self.max_steps}]"
            )
        if self.init_from is not None and self.method == "medusa2":
            raise ConfigError(
                "train.init_from starts medusa1, eagle1 and eagle3 heads; medusa2 also trains a "
                "LoRA adapter on the target: leave init_from unset"
            )
        if self.max_grad_norm < 0:
            raise ConfigError(f"train.max_grad_norm={self.max_grad_norm} must be >= 0")
        unknown = set(self.log_with) - {"tensorboard", "wandb"}
        if unknown:
            raise ConfigError(f"train.log_with has {sorted(unknown)}; use tensorboard and/or wandb")


@dataclass
class MedusaSection:
    """Medusa heads (Cai et al. 2024): used when train.method is medusa1 or medusa2."""

    num_heads: int = field(default=4, metadata=_help("heads; head k predicts token t+k+1"))
    num_layers: int = field(default=1, metadata=_help("residual blocks per head"))
    loss_decay: float = field(default=0.8, metadata=_help("head k's loss weight is decay^k"))
    draft_vocab_size: int = field(
        default=0,
        metadata=_help(
            "medusa1: each head predicts over the N most frequent trained tokens (vLLM's "
            "truncated_vocab_size and token_map), N rows instead of the target's whole "
            "vocabulary at every step; 0 (or N >= the vocabulary) = the whole vocabulary"
        ),
    )
    lora_r: int = field(default=16, metadata=_help("medusa2: LoRA rank on the target"))
    lora_alpha: int = field(default=32, metadata=_help("medusa2: LoRA alpha"))
    head_lr_multiplier: float = field(
        default=4.0, metadata=_help("medusa2: heads' learning rate / backbone's")
    )
    heads_loss_weight: float = field(
        default=0.2, metadata=_help("medusa2: weight of the heads' loss beside the backbone KL")
    )
    lora_dropout: float = field(
        default=0.05, metadata=_help("medusa2: dropout on the LoRA branch's input")
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata=_help("medusa2: names (suffixes) of the target's linear layers that get LoRA"),
    )
    backbone_weight: float = field(
        default=1.0,
        metadata=_help("medusa2: weight of KL(frozen target || LoRA-tuned target) in the loss"),
    )

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ConfigError("medusa.num_heads must be >= 1 and medusa.num_layers >= 0")
        if not 0 < self.loss_decay <= 1:
            raise ConfigError(f"medusa.loss_decay={self.loss_decay} must be in (0, 1]")
        if self.draft_vocab_size < 0:
            raise ConfigError(f"medusa.draft_vocab_size={self.draft_vocab_size} must be >= 0")
        if self.lora_r < 1 or self.head_lr_multiplier <= 0 or self.heads_loss_weight <= 0:
            raise ConfigError("medusa.lora_r, head_lr_multiplier, heads_loss_weight must be > 0")
        if self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1 or self.backbone_weight < 0:
            raise ConfigError(
                "medusa.lora_alpha must be > 0, medusa.lora_dropout in [0, 1) and "
                "medusa.backbone_weight >= 0"
            )
        if not self.lora_target_modules:
            raise ConfigError("medusa.lora_target_modules is empty; name e.g. q_proj,v_proj")


@dataclass
class EagleSection:
    """EAGLE-1 drafter (Li et al. 2024): used when train.method is eagle1."""

    fc_bias: bool = field(
        default=True,
        metadata=_help("bias in fc (reference default; vLLM's loader drops it, SGLang needs it)"),
    )
    feature_loss_weight: float = field(
        default=1.0, metadata=_help("weight of SmoothL1(predicted feature, target feature)")
    )
    ce_loss_weight: float = field(
        default=0.1, metadata=_help("weight of the soft cross-entropy to the target's next token")
    )
    feature_noise: float = field(
        default=0.1,
        metadata=_help("a: training adds U(-a, a) noise to the input features (0 = off)"),
    )

    def __post_init__(self) -> None:
        if self.feature_loss_weight < 0 or self.ce_loss_weight < 0:
            raise ConfigError("eagle.feature_loss_weight and eagle.ce_loss_weight must be >= 0")
        if self.feature_loss_weight == 0 and self.ce_loss_weight == 0:
            raise ConfigError("eagle.feature_loss_weight and eagle.ce_loss_weight are both 0")
        if self.feature_noise < 0:
            raise ConfigError(f"eagle.feature_noise={self.feature_noise} must be >= 0")


@dataclass
class Eagle3Section:
    """EAGLE-3 drafter (Li et al. 2025): used when train.method is eagle3."""

    draft_vocab_size: int = field(
        default=8192,
        metadata=_help(
            "draft vocabulary: the most frequent trained tokens (capped at the target's); the "
            "draft LM head is [this, H], one pass per draft level"
        ),
    )
    feature_layers: list[int] = field(
        default_factory=list,
        metadata=_help(
            "low,mid,high output_hidden_states indices (= inputs of those target layers); "
            "empty = the reference's 2,L//2,L-3"
        ),
    )
    ttt_steps: int = field(
        default=7, metadata=_help("training-time test: draft steps unrolled per position")
    )
    loss_decay: float = field(default=0.8, metadata=_help("step j's loss weight is decay^j"))
    lm_head_init: Literal["target", "random"] = field(
        default="target",
        metadata=_help("init the draft LM head from the target's rows, or randomly (reference)"),
    )
    fc_norm: bool = field(
        default=False,
        metadata=_help(
            "EAGLE-3.1: an RMSNorm on each feature layer's states before fc (fc_norm.{0,1,2} "
            "weights, as vLLM and speculators load them); exports as speculators only"
        ),
    )
    norm_output: bool = field(
        default=False,
        metadata=_help(
            "EAGLE-3.1: hand norm(s), not s, to the next draft step (training-time test and "
            "deeper tree levels; the LM head reads norm(s) either way); exports as speculators "
            "only"
        ),
    )
    loss: Literal["soft_ce", "lk_alpha", "lk_lambda"] = field(
        default="soft_ce",
        metadata=_help(
            "per-step loss: soft_ce (the reference's); LK losses (arXiv:2602.23881) on the "
            "acceptance rate a = sum_v min(p_v, q_v): lk_alpha = -log a, lk_lambda = "
            "w*soft_ce + (1-w)*(1-a) with w = lk_scale*exp(-lk_decay*a)"
        ),
    )
    lk_scale: float = field(
        default=1.0,
        metadata=_help("lk_lambda: the soft cross-entropy's weight at a = 0, in [0, 1]"),
    )
    lk_decay: float = field(
        default=3.0,
        metadata=_help("lk_lambda: how fast the soft cross-entropy's weight falls as a grows"),
    )

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1 or self.ttt_steps < 1:
            raise ConfigError("eagle3.draft_vocab_size and eagle3.ttt_steps must be >= 1")
        if not 0 <= self.lk_scale <= 1 or self.lk_decay < 0:
            raise ConfigError(
                f"eagle3.lk_scale={self.lk_scale} must be in [0, 1] and eagle3.lk_decay="
                f"{self.lk_decay} >= 0"
            )
        if not 0 < self.loss_decay <= 1:
            raise ConfigError(f"eagle3.loss_decay={self.loss_decay} must be in (0, 1]")
        layers = self.feature_layers
        if layers and (len(layers) != 3 or not 1 <= layers[0] < layers[1] < layers[2]):
            raise ConfigError(
                f"eagle3.feature_layers={layers} must be three increasing indices >= 1 "
                "(low,mid,high), or empty for the default"
            )


MEDUSA2_NEEDS_ONLINE = (
    "data.features=offline cannot train medusa2: its heads read the LoRA-tuned target's hidden "
    "states, recomputed with gradients in every step; set data.features=online"
)


@dataclass
class RunConfig:
    """A training run: target, data, loop, and the drafter's own section."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    medusa: MedusaSection = field(default_factory=MedusaSection)
    eagle: EagleSection = field(default_factory=EagleSection)
    eagle3: Eagle3Section = field(default_factory=Eagle3Section)

    def __post_init__(self) -> None:
        if self.train.method == "medusa2" and self.data.features != "online":
            raise ConfigError(MEDUSA2_NEEDS_ONLINE)
        if self.train.method == "medusa2" and self.target.shard == "fsdp":
            raise ConfigError(
                "target.shard=fsdp cannot train medusa2: it trains LoRA adapters inside the "
                "target, which headway does not shard; set target.shard=no"
            )
