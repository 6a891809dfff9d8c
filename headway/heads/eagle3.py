"""The EAGLE-3 draft model (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", arXiv:2503.01840, §3).

EAGLE-3 drafts from a *fusion* of low, middle and high target features instead of the last one,
and predicts tokens directly (no feature regression)::

    g_t   = fc([l_t ; m_t ; h_t])                     # fc: Linear(3H, H), no bias
    a_t   = Attn([norm_in(E x_{t+1}) ; norm_h(g_t)])  # q/k/v read 2H, o_proj writes H
    s_t   = g_t + a_t;  s_t = s_t + MLP(norm_post(s_t))
    q(x_{t+2}) = softmax(lm_head(norm(s_t)))          # the drafter's own head, N draft tokens

``l, m, h`` are target hidden states at the three *feature layers* (``feature_layers``,
indices into the target's ``output_hidden_states``; :func:`default_feature_layers`), ``E`` is
the target's frozen embedding (borrowed, never stored) and ``s_t`` the layer's pre-norm output.
When drafting deeper, ``s_t`` itself replaces ``g`` as the next pair's feature (no fc): the
reference's ``topK_genrate`` feeds ``out_hidden`` back, and SGLang's draft model returns the
pre-norm residual stream as its aux hidden state. The residual of the attention block is ``g_t``,
not the normed input (SafeAILab/EAGLE ``eagle/model/cnets.py`` ``LlamaDecoderLayeremb``; vLLM's
``norm_before_residual=False``).

Feature layers. The reference (``eagle/traineagle3/modeling_llama_kv.py``) captures the
*inputs* of target layers 2, L//2 and L-3; vLLM (``get_eagle3_aux_hidden_state_layers``) and
SGLang (``set_eagle3_layers_to_capture``, default) capture the same. In transformers'
``output_hidden_states`` (0 = embeddings, i = output of layer i-1 = input of layer i) these are
entries 2, L//2 and L-3, the convention headway records. SpecForge names them as outputs of
layers 1, L//2-1 and L-4: the same tensors.

Modules, all stock transformers pieces (no forked modeling file): ``midlayer.self_attn`` is a
``LlamaAttention`` whose q/k/v ``Linear`` layers are rebuilt with input width 2H (the only change;
its forward, rotary and sdpa/eager kernels are transformers' own), ``midlayer.mlp`` a
``LlamaMLP``, the norms ``LlamaRMSNorm``. State-dict keys are exactly the engines' (vLLM
``llama_eagle3.py``, SGLang ``llama_eagle3.py``): ``fc.weight`` ``[H, 3H]``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight`` ``[N, H]``, and the vocabulary buffers ``d2t`` / ``t2d``.

EAGLE-3.1 options, both off by default (the model above, its keys unchanged):

- ``fc_norm``: one RMSNorm per feature layer on its own H-wide slice before fc,
  ``g_t = fc([n_0(l_t); n_1(m_t); n_2(h_t)])``, weights ``fc_norm.{0,1,2}.weight`` ``[H]``
  (speculators ``models/eagle3/core.py`` and vLLM ``llama_eagle3.py`` ``combine_hidden_states``;
  not their ``norm_before_fc``, a single RMSNorm over the 3H concatenation).
- ``norm_output``: the state a draft step hands to the next one (TTT step, deeper tree level) is
  ``norm(s_t)`` instead of ``s_t``; the LM head reads ``norm(s_t)`` either way and no weight is
  added (speculators: ``if self.config.norm_output: hidden_states = self.norm(hidden_states)``;
  vLLM: ``aux_output = hidden_states if self.norm_output else hidden_prenorm``). ``forward``
  returns that handed-on state and ``logits`` skips the norm it already holds, so training and
  the drafter run unchanged. SpecForge's ``norm_output`` flag means something else (whether its
  LM head reads ``norm(s)``; its default true is this model with the option off).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache, LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from headway.decode.kv import cache_argument
from headway.errors import TargetError
from headway.heads.eagle import EagleConfig, additive_mask, causal_mask
from headway.heads.vocab import DraftVocab

__all__ = [
    "Eagle3Config",
    "Eagle3Layer",
    "Eagle3Model",
    "default_feature_layers",
    "eagle3_tensor_shapes",
]


_OPTIONAL_FLAGS = ("fc_norm", "norm_output")  # head_config keys written only when true


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The three feature layers of an L-layer target, as ``output_hidden_states`` indices.

    ``(2, L//2, L-3)`` (the reference's and the engines' default) whenever those are distinct,
    i.e. L >= 7. Smaller (test-sized) targets get ``(1, L//2, L-1)``, still distinct layer inputs
    that engines can capture. Targets of fewer than 4 layers have no three distinct ones.
    """
    if num_layers >= 7:
        return (2, num_layers // 2, num_layers - 3)
    if num_layers >= 4:
        return (1, num_layers // 2, num_layers - 1)
    raise TargetError(
        f"EAGLE-3 fuses three distinct target layers; a {num_layers}-layer target has no three "
        "distinct layer inputs (1 .. L-1). Use a target with at least 4 layers"
    )


@dataclass(frozen=True)
class Eagle3Config:
    """Sizes of an EAGLE-3 draft model (stored as ``head_config`` in a run directory).

    Attributes:
        hidden_size: H, the target's hidden size (features, embeddings, the draft layer).
        intermediate_size: the draft layer's MLP width.
        num_attention_heads: query heads of the draft layer.
        num_key_value_heads: key/value heads of the draft layer.
        head_dim: size of one attention head.
        vocab_size: V, the target's vocabulary.
        draft_vocab_size: N, rows of the drafter's own LM head (``<= V``).
        feature_layers: the low, middle and high feature layers, strictly increasing indices
            into the target's ``output_hidden_states`` in ``1 .. L-1`` (= inputs of those layers).
        hidden_act: the MLP's gate activation.
        rms_norm_eps: epsilon of the four RMSNorms.
        rope_theta: rotary base.
        max_position_embeddings: the target's context length (recorded for engine configs).
        rope_scaling: the target's RoPE scaling, as in :class:`EagleConfig`.
        fc_norm: EAGLE-3.1's RMSNorm per feature layer before fc (module docstring).
        norm_output: EAGLE-3.1's normed state handed to the next draft step (module docstring).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, int, int]
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rope_scaling: dict[str, Any] | None = None
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        self.layer_sizes()  # validates the shared sizes
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Eagle3Config.draft_vocab_size={self.draft_vocab_size} must be in "
                f"[1, vocab_size={self.vocab_size}]"
            )
        layers = self.feature_layers
        valid = isinstance(layers, tuple) and len(layers) == 3
        if not valid or not all(isinstance(layer, int) and layer >= 1 for layer in layers):
            raise ValueError(f"Eagle3Config.feature_layers={layers!r} must be 3 integers >= 1")
        if not layers[0] < layers[1] < layers[2]:
            raise ValueError(
                f"Eagle3Config.feature_layers={layers!r} must be strictly increasing (low, mid, "
                "high); engines capture each layer once"
            )

    def layer_sizes(self) -> EagleConfig:
        """The shared draft-layer sizes as an :class:`EagleConfig` (validated there)."""
        return EagleConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            fc_bias=False,
            rope_scaling=self.rope_scaling,
        )

    def llama_config(self, attn_implementation: str = "sdpa") -> LlamaConfig:
        """The 1-layer ``LlamaConfig`` the attention, MLP and rotary embedding are built from."""
        return self.layer_sizes().llama_config(attn_implementation)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (what ``config.json`` stores as ``head_config``); the EAGLE-3.1
        flags only when on, so runs without them read and write as before."""
        data = asdict(self)
        data["feature_layers"] = list(self.feature_layers)
        return {key: value for key, value in data.items() if value or key not in _OPTIONAL_FLAGS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Eagle3Config:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"bad EAGLE-3 head_config: unknown keys {unknown}")
        values = dict(data)
        if isinstance(values.get("feature_layers"), list):
            values["feature_layers"] = tuple(values["feature_layers"])
        return cls(**values)

    @classmethod
    def from_target(
        cls,
        model: PreTrainedModel,
        *,
        draft_vocab_size: int,
        feature_layers: tuple[int, int, int] | None = None,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> Eagle3Config:
        """Draft-layer sizes copied from a target (as for EAGLE-1, any family); feature layers
        default to :func:`default_feature_layers`; the EAGLE-3.1 flags are off by default."""
        sizes = EagleConfig.from_target(model, fc_bias=False)
        num_layers = int(model.config.get_text_config().num_hidden_layers)
        layers = feature_layers or default_feature_layers(num_layers)
        if max(layers) >= num_layers:
            raise TargetError(
                f"feature layers {list(layers)} must be inputs of the target's layers (< "
                f"{num_layers}); output_hidden_states[{num_layers}] is after the final norm"
            )
        shared = {key: value for key, value in sizes.to_dict().items() if key != "fc_bias"}
        return cls(
            **shared,
            draft_vocab_size=min(draft_vocab_size, sizes.vocab_size),
            feature_layers=(int(layers[0]), int(layers[1]), int(layers[2])),
            fc_norm=fc_norm,
            norm_output=norm_output,
        )


class Eagle3Layer(nn.Module):
    """The draft layer (``midlayer``): attention over ``[norm_in(emb); norm_h(feature)]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        # The only change to the stock attention: q/k/v read the 2H-wide concatenation.
        for name in ("q_proj", "k_proj", "v_proj"):
            stock: nn.Linear = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * hidden, stock.out_features, bias=False))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(
        self,
        features: Tensor,
        token_embeddings: Tensor,
        *,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor,
        cache: DynamicCache | None,
    ) -> Tensor:
        """``features``, ``token_embeddings`` ``[B, T, H]`` -> pre-norm output ``[B, T, H]``."""
        joint = torch.cat(
            [self.input_layernorm(token_embeddings), self.hidden_norm(features)], dim=-1
        )
        attended, _ = self.self_attn(
            joint,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **cache_argument(self.self_attn, cache),
        )
        hidden = features + attended  # the residual is the un-normed fused feature
        output: Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return output


class Eagle3Model(nn.Module):
    """[fc_norm +] fc + the EAGLE-3 draft layer + norm + the draft LM head (module docstring).

    Args:
        config: sizes, see :class:`Eagle3Config`.
        attn_implementation: ``"sdpa"``, ``"eager"`` or another attention function registered
            with transformers' ``AttentionInterface`` (training uses
            :func:`~headway.decode.grouped_attention.packed_sdpa`); all take 4-D additive masks.
    """

    d2t: Tensor
    t2d: Tensor

    def __init__(self, config: Eagle3Config, *, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.llama_config = config.llama_config(attn_implementation)
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.fc_norm: nn.ModuleList | None = None
        if config.fc_norm:
            norms = [LlamaRMSNorm(hidden, eps=config.rms_norm_eps) for _ in range(3)]
            self.fc_norm = nn.ModuleList(norms)
        self.midlayer = Eagle3Layer(self.llama_config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.llama_config)
        # Placeholder until a vocabulary is set: the first N target ids (DraftVocab.identity,
        # written out so it also builds on the meta device).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)

    @property
    def vocab(self) -> DraftVocab:
        """The draft vocabulary held in the ``d2t`` / ``t2d`` buffers."""
        return DraftVocab(self.d2t, self.t2d)

    def set_vocab(self, vocab: DraftVocab) -> None:
        """Store ``vocab`` in the buffers (its size must be the config's)."""
        if (vocab.size, vocab.vocab_size) != (self.config.draft_vocab_size, self.config.vocab_size):
            raise ValueError(
                f"a vocabulary of {vocab.size} draft / {vocab.vocab_size} target ids does not fit "
                f"a model of {self.config.draft_vocab_size} / {self.config.vocab_size}"
            )
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def new_cache(self) -> DynamicCache:
        """An empty one-layer ``DynamicCache`` for incremental forwards."""
        return DynamicCache(config=self.llama_config)

    def fuse(self, features: Tensor) -> Tensor:
        """Concatenated low/mid/high target features ``[..., 3H]`` -> ``g`` ``[..., H]``."""
        if features.shape[-1] != 3 * self.config.hidden_size:
            raise ValueError(
                f"fuse needs the three feature layers concatenated, [..., "
                f"{3 * self.config.hidden_size}], got {list(features.shape)}"
            )
        if self.fc_norm is not None:  # EAGLE-3.1: each feature layer's slice normed on its own
            slices = zip(self.fc_norm, features.chunk(3, dim=-1), strict=True)
            features = torch.cat([norm(part) for norm, part in slices], dim=-1)
        fused: Tensor = self.fc(features)
        return fused

    def logits(self, states: Tensor) -> Tensor:
        """Draft states ``[..., H]`` as :meth:`forward` returns them (pre-norm ``s``, or
        ``norm(s)`` with ``norm_output``) -> draft-vocabulary logits ``[..., N]``."""
        normed = states if self.config.norm_output else self.norm(states)
        logits: Tensor = self.lm_head(normed)
        return logits

    def forward(
        self,
        features: Tensor,
        token_embeddings: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> Tensor:
        """One draft step over T pairs (the interface of :class:`~headway.heads.eagle.EagleModel`).

        Args:
            features: ``[B, T, H]``: ``g`` (fused target features, :meth:`fuse`) or the draft's
                own output of the previous step.
            token_embeddings: ``[B, T, H]``, the target's embedding of x_{t+1} for each row.
            position_ids: LongTensor ``[B or 1, T]``; default ``past .. past + T - 1``.
            attention_mask: ``None`` (causal over the cache and the new rows), a 2-D padding mask
                ``[B, T]`` (no cache), or a 4-D additive mask ``[B, 1, T, past + T]``.
            cache: the draft layer's keys/values of earlier rows; grows by T entries.

        Returns:
            ``[B, T, H]``, the states handed to the next step: pre-norm ``s_t``, or ``norm(s_t)``
            with ``norm_output`` (:meth:`logits` turns either into drafts).
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
        states: Tensor = self.midlayer(
            features,
            token_embeddings,
            position_embeddings=self.rotary_emb(features, position_ids),
            attention_mask=_four_d(attention_mask, past, length, features),
            cache=cache,
        )
        return self.norm(states) if self.config.norm_output else states


def _four_d(mask: Tensor | None, past: int, length: int, like: Tensor) -> Tensor:
    """The explicit 4-D additive mask of :meth:`Eagle3Model.forward` (sdpa and eager would
    otherwise disagree on what "no mask" means over several rows)."""
    if mask is not None and mask.dim() == 4:
        return mask
    if mask is not None:
        if past:
            raise ValueError("a 2-D padding mask needs an empty cache; pass a 4-D mask instead")
        return causal_mask(mask, like.dtype)
    visible = torch.ones(length, past + length, dtype=torch.bool, device=like.device)
    visible[:, past:] = visible[:, past:].tril()
    return additive_mask(visible, like.dtype)[None, None]


def eagle3_tensor_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every state-dict key of :class:`Eagle3Model` for ``config`` and its shape (meta device)."""
    with torch.device("meta"):
        model = Eagle3Model(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
