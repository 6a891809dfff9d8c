"""The EAGLE-1 draft model (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty", arXiv:2401.15077, §3-4), also the drafter of EAGLE-2 (Li et al. 2024,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", arXiv:2406.16858).

EAGLE drafts at the *feature* level. ``f_t`` is the target's last hidden state at position t (the
input of its LM head, ``output_hidden_states[num_hidden_layers]``) and ``x_t`` the token there.
The draft model reads the pair (``f_t``, ``x_{t+1}``), the feature together with the token that
feature's LM head sampled, and predicts the next feature::

    z_t      = fc([E x_{t+1} ; f_t])           # fc: Linear(2H, H), bias on by default (reference)
    f̂_{t+1}  = Layer(z_{≤t})                   # ONE decoder layer without its input norm, causal
    q(x_{t+2}) = softmax(lm_head(f̂_{t+1}))    # the target's frozen LM head, no extra norm

``E`` (``embed_tokens``) and ``lm_head`` are the target's own, frozen, and never stored in the
draft weights (:class:`TargetHead` borrows them). The pair (``f_t``, ``x_{t+1}``) sits at position
t. Tokens are drafted autoregressively by feeding f̂ back in as the next pair's feature.

Layer class. The draft layer is transformers' stock ``LlamaDecoderLayer`` (built from a 1-layer
``LlamaConfig`` copying the target's hidden / intermediate / head sizes, rotary embeddings from
``LlamaRotaryEmbedding``) with ``input_layernorm`` replaced by ``nn.Identity``, for *every*
target family. The issue suggested the target's own layer class where possible; Llama's is used
because (1) the EAGLE-1/2 engine formats (SafeAILab/EAGLE ``cnets1.py``, vLLM ``llama_eagle.py``,
SGLang ``llama_eagle.py``) all instantiate a Llama layer and load ``layers.0.self_attn.*`` /
``layers.0.mlp.*`` names, so only a Llama layer exports without conversion; (2) other families'
blocks have other signatures and weights (GPT-2's ``GPT2Block`` takes no rotary embeddings, fuses
q/k/v into one ``c_attn`` and has LayerNorm biases), so a per-family layer would need per-family
export code and would not load in the engines anyway. No modeling file is forked.

State-dict keys (native format = the EAGLE-1 reference layout): ``fc.weight`` ``[H, 2H]``
(columns ``[:H]`` read the token embedding, ``[H:]`` the feature), ``fc.bias`` ``[H]`` if
``fc_bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj
.weight``, ``layers.0.post_attention_layernorm.weight``. Rotary frequencies are non-persistent.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, LlamaConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from headway.decode.kv import cache_argument
from headway.heads.text_config import majority_rope, uniform_attr

__all__ = [
    "EagleConfig",
    "EagleModel",
    "TargetHead",
    "additive_mask",
    "causal_mask",
    "eagle_tensor_shapes",
    "rope_parameters",
    "rope_scaling_of",
]


# Far above any published model, low enough that building the shapes on the meta device is safe.
_MAXIMA = {
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 26,
}


@dataclass(frozen=True)
class EagleConfig:
    """Sizes of an EAGLE-1 draft model (stored as ``head_config`` in a run directory).

    Attributes:
        hidden_size: H, the target's hidden size (features, embeddings and the draft layer).
        intermediate_size: the draft layer's MLP width (the target's, or 4H for GPT-2).
        num_attention_heads: query heads of the draft layer.
        num_key_value_heads: key/value heads of the draft layer (grouped-query attention).
        head_dim: size of one attention head.
        vocab_size: V, the target's vocabulary (rows of its LM head).
        hidden_act: the MLP's gate activation (Llama-style targets' own; ``silu`` otherwise).
        rms_norm_eps: epsilon of the post-attention RMSNorm.
        rope_theta: rotary base (the target's; 10000 for targets without rotary embeddings).
        max_position_embeddings: the target's context length (recorded for engine configs).
        fc_bias: whether ``fc`` has a bias (the EAGLE-1 reference default is True).
        rope_scaling: the target's RoPE scaling beyond ``rope_theta`` (``rope_type`` ``llama3``,
            ``yarn``, ``linear``, ``dynamic`` ... with their parameters, as transformers names
            them), None for plain RoPE: the draft layer rotates positions as the target does.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    fc_bias: bool = True
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
        for name in (*sizes, "head_dim", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EagleConfig.{name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"EagleConfig: num_attention_heads={self.num_attention_heads} must be a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("EagleConfig: rms_norm_eps and rope_theta must be > 0")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            raise ValueError(
                f"EagleConfig.hidden_act={self.hidden_act!r} is not an activation transformers "
                "knows (e.g. 'silu', 'gelu')"
            )
        for name, maximum in _MAXIMA.items():  # a file must not make us build absurd shapes
            if getattr(self, name) > maximum:
                raise ValueError(
                    f"EagleConfig.{name}={getattr(self, name)} is beyond any real model (at most "
                    f"{maximum}); the file is damaged or not an EAGLE drafter"
                )
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:  # it would fail in the layer
            raise ValueError(
                f"EagleConfig.rope_scaling has rope_type {kind!r}, which transformers does not "
                f"build (it builds default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})"
            )
        try:  # transformers checks head sizes and each rope type's parameters in its config
            self.llama_config()
        except Exception as error:  # its validators raise several types, huggingface_hub's too
            raise ValueError(
                f"EagleConfig is not a layer transformers can build "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (what ``config.json`` stores as ``head_config``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EagleConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error, missing optional ones default."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"bad EAGLE head_config: unknown keys {unknown}; expected {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_target(cls, model: PreTrainedModel, *, fc_bias: bool = True) -> EagleConfig:
        """Draft-layer sizes copied from a target model (any family, see the module docstring)."""
        text = model.config.get_text_config()
        hidden = int(text.hidden_size)
        heads = int(uniform_attr(text, "num_attention_heads"))
        rope = majority_rope(text)  # Gemma 3/4: one set per layer type
        return cls(
            hidden_size=hidden,
            intermediate_size=int(
                uniform_attr(text, "intermediate_size")
                or getattr(text, "n_inner", None)
                or 4 * hidden
            ),
            num_attention_heads=heads,
            num_key_value_heads=int(uniform_attr(text, "num_key_value_heads") or heads),
            head_dim=int(uniform_attr(text, "head_dim") or hidden // heads),  # Gemma 4: per layer
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            hidden_act=str(getattr(text, "hidden_act", None) or "silu"),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", None) or 1e4)),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 2048),
            fc_bias=fc_bias,
            rope_scaling=rope_scaling_of(rope),
        )

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        """The 1-layer ``LlamaConfig`` the draft layer and its rotary embedding are built from."""
        settings: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope_parameters(self.rope_theta, self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "attn_implementation": attn_implementation,
        }
        return LlamaConfig(**settings)


def rope_parameters(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The transformers 5 ``rope_parameters`` dict of base ``theta`` and ``scaling`` (a
    ``rope_scaling`` dict, or None for plain RoPE), e.g. ``{"rope_type": "default",
    "rope_theta": 10000.0}``; :func:`rope_scaling_of` is its inverse."""
    return {"rope_type": "default", **(scaling or {}), "rope_theta": theta}


def rope_scaling_of(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """The scaling part of a transformers ``rope_parameters`` / ``rope_scaling`` dict (every key
    but ``rope_theta``, ``type`` read as ``rope_type``), or None for plain RoPE."""
    if not rope:
        return None
    scaling = {key: value for key, value in rope.items() if key not in ("rope_theta", "type")}
    scaling["rope_type"] = str(rope.get("rope_type", rope.get("type", "default")))
    return None if scaling["rope_type"] == "default" else scaling


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = may attend) -> additive float mask of the same shape (0 / finfo.min)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


class EagleModel(nn.Module):
    """fc + one Llama decoder layer without its input norm (see the module docstring).

    Args:
        config: sizes, see :class:`EagleConfig`.
        attn_implementation: ``"sdpa"`` or ``"eager"``; both take 4-D additive masks.
    """

    def __init__(self, config: EagleConfig, *, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.llama_config = config.llama_config(attn_implementation)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        layer = LlamaDecoderLayer(self.llama_config, layer_idx=0)
        # EAGLE drops the first layer's input norm: fc's output feeds attention directly.
        layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(self.llama_config)

    def new_cache(self) -> DynamicCache:
        """An empty one-layer ``DynamicCache`` for incremental (drafting) forwards."""
        return DynamicCache(config=self.llama_config)

    def forward(
        self,
        features: Tensor,
        token_embeddings: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> Tensor:
        """Predict the next features.

        Args:
            features: ``[B, T, H]``, f_t (the target's, or the draft's own when drafting deeper).
            token_embeddings: ``[B, T, H]``, the target's embedding of x_{t+1} for each row.
            position_ids: LongTensor ``[B or 1, T]``, position t of each pair; default
                ``past .. past + T - 1`` (``past`` = pairs already in ``cache``).
            attention_mask: ``None`` for plain causal attention over the cache and the new rows;
                a 2-D padding mask ``[B, T]`` (1 = token, 0 = padding; no cache) for a causal
                mask that never attends to padding (:func:`causal_mask`); or a 4-D additive mask
                ``[B, 1, T, past + T]`` (0 = attend, finfo.min = blocked; e.g. a tree mask).
            cache: the draft layer's keys/values of earlier pairs; grows by T entries.

        Returns:
            ``[B, T, H]``: row t is f̂_{t+1}, the predicted feature at position t + 1.
        """
        if features.shape != token_embeddings.shape or features.dim() != 3:
            raise ValueError(
                f"features {tuple(features.shape)} and token_embeddings "
                f"{tuple(token_embeddings.shape)} must both be [B, T, H]"
            )
        past = cache.get_seq_length() if cache is not None else 0
        length = features.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=features.device)[None]
        fused = self.fc(torch.cat([token_embeddings, features], dim=-1))
        rotary = self.rotary_emb(fused, position_ids)
        output: Tensor = self.layers[0](
            fused,
            attention_mask=_four_d(attention_mask, past, length, fused),
            position_ids=position_ids,
            **cache_argument(self.layers[0], cache),
            use_cache=cache is not None,
            position_embeddings=rotary,
        )
        return output


def causal_mask(padding_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Padding mask ``[B, T]`` (1 = token) -> additive ``[B, 1, T, T]``: causal, never attending
    to padding (a padding row sees only itself, so no row is empty). Works for right and left
    padding; with left padding pass matching ``position_ids``."""
    length = padding_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=padding_mask.device).tril()
    keys = padding_mask.bool()[:, None, None, :] | torch.eye(
        length, dtype=torch.bool, device=padding_mask.device
    )
    return additive_mask(causal & keys, dtype)


def _four_d(mask: Tensor | None, past: int, length: int, like: Tensor) -> Tensor:
    """The 4-D additive mask the layer gets (see :meth:`EagleModel.forward`). Always explicit:
    sdpa and eager would otherwise disagree on what "no mask" means for several rows."""
    if mask is not None and mask.dim() == 4:
        return mask
    if mask is not None:
        if past:
            raise ValueError("a 2-D padding mask needs an empty cache; pass a 4-D mask instead")
        return causal_mask(mask, like.dtype)
    visible = torch.ones(length, past + length, dtype=torch.bool, device=like.device)
    visible[:, past:] = visible[:, past:].tril()
    return additive_mask(visible, like.dtype)[None, None]


@dataclass(frozen=True)
class TargetHead:
    """The target's frozen token embedding and LM head, borrowed (never copied, trained or saved).

    Kept outside the ``nn.Module`` tree on purpose: holding the modules in a plain dataclass means
    they are not parameters of the draft model, so optimizers, DDP and ``state_dict`` never see
    them. Calling the modules (not their weights) keeps family quirks such as a scaled embedding.
    """

    embed: nn.Module
    lm_head: nn.Module

    @classmethod
    def of(cls, model: PreTrainedModel) -> TargetHead:
        """The input embedding and output embedding of a Hugging Face causal LM."""
        return cls(embed=model.get_input_embeddings(), lm_head=model.get_output_embeddings())

    def embed_tokens(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """``ids`` ``[...]`` -> embeddings ``[..., H]`` in ``dtype``."""
        embedded: Tensor = self.embed(ids)
        return embedded.to(dtype)

    def logits(self, features: Tensor, ids: Tensor | None = None) -> Tensor:
        """``features`` ``[..., H]`` -> logits ``[..., V]`` (in the LM head's dtype), or only the
        columns ``ids`` (int64 ``[N]``) -> ``[..., N]``, without the other rows' matmul."""
        weight = self.lm_head.weight
        assert isinstance(weight, Tensor)
        if ids is None:
            logits: Tensor = self.lm_head(features.to(weight.dtype))
            return logits
        bias = getattr(self.lm_head, "bias", None)
        return F.linear(features.to(weight.dtype), weight[ids], None if bias is None else bias[ids])


def eagle_tensor_shapes(config: EagleConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict key of :class:`EagleModel` for ``config`` and its shape (meta device)."""
    with torch.device("meta"):
        model = EagleModel(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
