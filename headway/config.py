"""Typed configs: dataclass sections read from a YAML file plus ``section.key=value`` overrides.

A run config is a dataclass whose fields are *sections* (``target``, ``data``, ``train``, ...),
each a dataclass of typed fields with their own help text. A YAML recipe and command-line
overrides go through the same path: both become ``--key value`` arguments of one
:class:`transformers.HfArgumentParser` per section, so types, choices and booleans are checked
by one parser, and ``__post_init__`` checks cross-field constraints. Unknown sections and keys
are rejected with the nearest valid name.

Example::

    config = load_config(RunConfig, "configs/medusa1-smollm2.yaml", ["train.lr=3e-4"])
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

import yaml
from transformers import HfArgumentParser

from headway.errors import ConfigError

T = TypeVar("T")
_NULLS = {"null", "none", "~"}


def _help(text: str, **metadata: Any) -> dict[str, Any]:
    return {"help": text, **metadata}


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
    eval_fraction: float = field(
        default=0.02, metadata=_help("fraction of samples held out for evaluation")
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
        if self.features == "offline" and not self.features_dir:
            raise ConfigError("data.features=offline needs data.features_dir (a feature cache)")
        if self.features == "offline" and self.pack:
            raise ConfigError(
                "data.pack=true packs samples for the target's forward, but offline features "
                "were cached per sample; set data.pack=false or data.features=online"
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
    mixed_precision: Literal["no", "bf16", "fp16"] = field(
        default="no", metadata=_help("accelerate mixed precision")
    )
    seed: int = field(default=0, metadata=_help("seed for weights, data order and noise"))
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

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1 or self.ttt_steps < 1:
            raise ConfigError("eagle3.draft_vocab_size and eagle3.ttt_steps must be >= 1")
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


class _SectionParser(HfArgumentParser):
    """HfArgumentParser that raises :class:`ConfigError` instead of exiting the process."""

    def __init__(self, section_type: type[Any], where: str, section: str) -> None:
        super().__init__(typing.cast(Any, section_type), exit_on_error=False, add_help=False)
        self._where = where
        self._section = section

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self._where}: {_readable(message, self._section)}")


def _readable(message: str, section: str) -> str:
    """``argument --lr: invalid float value`` -> ``train.lr: invalid float value``."""
    return re.sub(r"argument --(\w+)(/--[\w-]+)?", lambda m: f"{section}.{m.group(1)}", message)


def _section_types(config_type: type[Any]) -> dict[str, type[Any]]:
    hints = typing.get_type_hints(config_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_type)}


def _field_types(section_type: type[Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(section_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_type) if f.init}


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def _is_optional(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    is_union = origin is typing.Union or origin is types.UnionType
    return is_union and type(None) in typing.get_args(annotation)


def _unknown(kind: str, name: str, valid: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(valid))}"
    return ConfigError(f"{where}: unknown {kind} {name!r}; {hint}")


def _as_argument(value: Any) -> list[str]:
    """One YAML value as argparse tokens: lists become several tokens, booleans 'true'/'false'."""
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, list | tuple):
        return [token for item in value for token in _as_argument(item)]
    if isinstance(value, Mapping):
        raise ConfigError(f"nested mapping {dict(value)!r} where a value was expected")
    return [str(value)]


def parse_section(section_type: type[T], values: Mapping[str, Any], *, where: str, name: str) -> T:
    """Validate `values` (raw YAML values or override strings) into a `section_type` instance.

    Args:
        section_type: a dataclass whose fields carry ``metadata={"help": ...}``.
        values: key -> value; ``None`` (or 'null'/'none') sets an optional field to None.
        where: the file or 'command line', for error messages.
        name: the section name, for error messages.
    """
    fields = _field_types(section_type)
    argv: list[str] = []
    given: dict[str, list[str]] = {}
    nulls: list[str] = []
    empties: list[str] = []
    for key, value in values.items():
        if key not in fields:
            raise _unknown("key", f"{name}.{key}", [f"{name}.{f}" for f in fields], where)
        if value is None or (isinstance(value, str) and value.lower() in _NULLS):
            if not _is_optional(fields[key]):
                raise ConfigError(f"{where}: {name}.{key} cannot be null")
            nulls.append(key)
            continue
        if isinstance(value, str) and _is_list(fields[key]):
            # 'a,b' or YAML-style '[a, b]' ('[]' = empty)
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [item.strip() for item in text.split(",") if item.strip()]
        try:
            tokens = _as_argument(value)
        except ConfigError as error:
            raise ConfigError(f"{where}: {name}.{key}: {error}") from None
        if not tokens:
            if not _is_list(fields[key]):
                raise ConfigError(f"{where}: {name}.{key} has an empty value")
            empties.append(key)  # argparse cannot express an empty list; set it afterwards
            continue
        given[key] = tokens
        # `--key=value` keeps a value that looks like an option ('-inf', '--') a value.
        argv += [f"--{key}={tokens[0]}"] if len(tokens) == 1 else [f"--{key}", *tokens]
    parser = _SectionParser(section_type, where, name)
    try:
        namespace, remaining = parser.parse_known_args(argv)
    except ConfigError:
        raise
    except Exception as error:  # argparse.ArgumentError and type conversion failures
        raise ConfigError(f"{where}: {_readable(str(error), name)}") from error
    if remaining:
        keys = [f"{name}.{key}" for key, tokens in given.items() if set(tokens) & set(remaining)]
        raise ConfigError(
            f"{where}: {', '.join(keys) or name}: could not use {remaining}; give one value per "
            "key (a list only where the key takes one)"
        )
    kwargs = {key: getattr(namespace, key) for key in fields}
    kwargs.update(dict.fromkeys(nulls))
    kwargs.update({key: [] for key in empties})
    for key, value in kwargs.items():
        # argparse's float() takes 'nan' and 'inf'; no hyper-parameter can be either.
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: {name}.{key}={value} must be a finite number")
        # argparse drops a '--' value, leaving [] where one value was expected.
        if isinstance(value, list) and not _is_list(fields[key]):
            raise ConfigError(f"{where}: {name}.{key}: cannot read {given[key]} as one value")
    try:
        return section_type(**kwargs)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from error


def _parse_overrides(overrides: Sequence[str]) -> dict[str, dict[str, str]]:
    """``["train.lr=3e-4"]`` -> ``{"train": {"lr": "3e-4"}}``."""
    nested: dict[str, dict[str, str]] = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            raise ConfigError(
                f"command line: override {override!r} is not of the form section.key=value "
                "(e.g. train.lr=3e-4)"
            )
        nested.setdefault(section, {})[name] = value.strip()
    return nested


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping of sections, with errors naming the file and line."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise ConfigError(f"config file {path} does not exist") from error
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: byte {error.start + 1} is not UTF-8; save the recipe as UTF-8 text"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        # ReaderError (a control character) has no `problem`, and its str() spans two lines.
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path}{line}: invalid YAML ({problem})") from error
    except (ValueError, RecursionError) as error:  # e.g. a date such as 2001-13-01
        raise ConfigError(f"{path}: invalid YAML value ({error})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def load_config(
    config_type: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Build `config_type` from an optional YAML file and ``section.key=value`` overrides.

    Overrides win over the file; both are validated by the same parser. Sections missing from
    both keep their defaults.

    Raises:
        ConfigError: naming the file (or 'command line'), the key and the fix.
    """
    sections = _section_types(config_type)
    from_file = read_yaml(path) if path is not None else {}
    from_cli = _parse_overrides(overrides)
    where_file = str(path) if path is not None else "config"
    for where, source in ((where_file, from_file), ("command line", from_cli)):
        for section, values in source.items():
            if section not in sections:
                raise _unknown("section", str(section), list(sections), where)
            if not isinstance(values, Mapping):
                raise ConfigError(f"{where}: section {section!r} must be a mapping of keys")
    built: dict[str, Any] = {}
    for section, section_type in sections.items():
        values = {**from_file.get(section, {}), **from_cli.get(section, {})}
        where = where_file if section not in from_cli else f"{where_file} + command line"
        built[section] = parse_section(section_type, values, where=where, name=section)
    return config_type(**built)


def to_dict(config: Any) -> dict[str, Any]:
    """A config as plain YAML-able data (for saving beside a run)."""
    return dataclasses.asdict(config)


def describe(config_type: type[Any]) -> str:
    """Every key of `config_type` with its type, default and help, for ``--help`` texts."""
    lines = []
    for section, section_type in _section_types(config_type).items():
        lines.append(f"{section}:")
        defaults = section_type()
        annotations = _field_types(section_type)
        for item in dataclasses.fields(section_type):
            default = getattr(defaults, item.name)
            annotation = annotations[item.name]
            type_name = getattr(annotation, "__name__", None) or str(annotation)
            if typing.get_origin(annotation) is Literal:
                type_name = "|".join(map(str, typing.get_args(annotation)))
            help_text = item.metadata.get("help", "")
            lines.append(f"  {section}.{item.name} ({type_name}, default {default!r}): {help_text}")
    return "\n".join(lines)
