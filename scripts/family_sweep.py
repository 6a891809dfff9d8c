"""Sweep transformers' causal-LM families: can headway decode each one exactly, or does it
refuse it in one line?

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING`` (or those named), a tiny random model
is built in-process from the config class's defaults, shrunk (hidden 32, 2 layers, 96 tokens;
:data:`SHRINK`), and decoded greedily for 20 tokens with an oracle tree of width 3 (every block
a real tree), eagerly and over the static cache headway captures on CUDA (uncaptured here),
after the mask probe ``headway generate`` runs first; for an exact family, whether Medusa and
EAGLE drafters can read its hidden states (``headway check``'s row). Each row says one of:

- ``exact``: both paths gave transformers' own greedy tokens (``distinct`` counts the tokens of
  that answer: 1 means the random model repeats one token and proves little);
- ``refused``: headway refused the target in one line (its error, shortened);
- ``MISMATCH``: other tokens than transformers' (a bug: headway's promise is exactness);
- ``ERROR in headway``: a traceback inside headway's code (a bug: refuse in one line instead);
- ``not built``: the shrunk config did not build or transformers' own generate failed on it
  (the sweep's shrinking, not headway; see ``tests/families.py`` for configs built by hand).

Run: ``python scripts/family_sweep.py`` (every family, ~2 minutes on 2 cores) or
``python scripts/family_sweep.py llama qwen3_next``. Fixed by this sweep on 2026-11-28
(transformers 5.24): Llama 4's chunked attention (MISMATCH), DeepSeek-V3's latent attention
over the static cache (ERROR), recurrent targets and BLOOM (ERROR, now refused), Gemma 3n's
shared keys/values (refused as recurrent, now exact).
"""

from __future__ import annotations

import argparse
import signal
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SHRINK: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 256, "moe_intermediate_size": 32, "num_experts": 4,
    "n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
    "shared_expert_intermediate_size": 32, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "initializer_range": 0.16, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1, "topk_group": 1, "sliding_window": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "n_embd": 32, "n_layer": 2, "n_head": 4, "d_model": 32,
    "num_layers": 2, "ffn_dim": 64, "n_positions": 256, "n_inner": 64, "rotary_dim": 8,
}  # fmt: skip
"""Config attributes set where a family's config has them (a tiny model of any family)."""

LATENT = {"num_key_value_heads": 4}  # multi-head latent attention: as many key heads as queries
OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v2": LATENT, "deepseek_v3": LATENT, "deepseek_v32": LATENT, "minicpm3": LATENT,
    "kimi_linear": LATENT, "glm4_moe_lite": LATENT, "gemma3n_text": {"num_kv_shared_layers": 0},
    "axk1": LATENT, "axk2": LATENT, "bailing_hybrid": LATENT, "glm_moe_dsa": LATENT,
    "hy_v4": LATENT, "sarvam_mla": LATENT, "youtu": LATENT,
}  # fmt: skip
PROMPT = [1, 5, 17, 33, 8, 40, 41, 9]
NEW_TOKENS = 20
SECONDS = 120  # a family taking longer is reported as not built
MAX_PARAMETERS = 300_000_000  # a family still larger after shrinking is not built


@dataclass(frozen=True)
class Row:
    """One family's outcome (module docstring)."""

    family: str
    outcome: str
    detail: str = ""
    features: str = "-"  # exact families: can Medusa / EAGLE drafters read its hidden states?


def tiny_model(family: str) -> Any:
    """A tiny random model of ``family`` from its config class's defaults, shrunk."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[family]()
    text = config.get_text_config()
    for name, value in {**SHRINK, **OVERRIDES.get(family, {})}.items():
        try:
            if hasattr(text, name):
                setattr(text, name, value)
        except Exception:
            continue
    for per_layer in ("layer_types", "layers_block_type"):
        kinds = getattr(text, per_layer, None)
        if isinstance(kinds, list) and len(kinds) != text.num_hidden_layers:
            distinct = list(dict.fromkeys(kinds))  # keep every kind, e.g. linear and full
            count = text.num_hidden_layers
            setattr(text, per_layer, [distinct[i % len(distinct)] for i in range(count)])
    with torch.device("meta"):  # sized first: a family the shrinking misses can be huge
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size / 1e6:.0f}M parameters after shrinking")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _greedy(model: Any) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,  # as tests/test_generate.py's reference: EOS neither stops nor
        )  # is suppressed (min_new_tokens would suppress it, which headway's decoding does not)
    return [int(token) for token in out[0, len(PROMPT) :]]


def sweep_one(family: str) -> Row:
    """Build ``family`` tiny, decode it both ways, and classify (module docstring)."""
    from headway.decode.generate import Decoder
    from headway.decode.options import DecodeOptions
    from headway.decode.probe import check_tree_mask
    from headway.drafters.oracle import OracleDrafter
    from headway.errors import HeadwayError

    try:
        model = tiny_model(family)
        truth = _greedy(model)
    except Exception as error:
        return Row(family, "not built", _first_line(error))
    try:
        check_tree_mask(model)  # as headway generate, headway eval and headway.generate do
    except HeadwayError as error:
        return Row(family, "refused", _first_line(error))
    except Exception as error:
        return Row(family, "ERROR in headway", f"mask probe: {_where(error)}")
    for verify in ("eager", "captured"):
        try:
            decoder = Decoder(model, OracleDrafter(truth, 4, width=3), DecodeOptions(verify=verify))
            tokens = decoder.generate(
                torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, eos_token_ids=()
            ).tokens
        except HeadwayError as error:
            return Row(family, "refused", _first_line(error))
        except Exception as error:
            return Row(family, "ERROR in headway", f"{verify}: {_where(error)}")
        if tokens != truth:
            return Row(
                family, "MISMATCH", f"{verify}: first differs at token {_first(tokens, truth)}"
            )
    try:
        features = _features(model)
    except Exception as error:
        return Row(family, "ERROR in headway", f"hidden-state check: {_where(error)}")
    return Row(family, "exact", f"distinct={len(set(truth))}", features)


def _features(model: Any) -> str:
    """``yes``, or ``no`` and why, for Medusa and EAGLE drafters on ``model`` (the row
    ``headway check`` prints; EAGLE-3's needs 4 layers, more than the sweep's 2)."""
    from headway.drafters.target_support import FEATURES, target_support

    row = next(row for row in target_support(model) if row.capability == FEATURES)
    return "yes" if row.ok else f"no: {row.detail[:100]}"


def _first_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:140]}"


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if "/headway/" in frame.filename.replace("\\", "/")]
    frame = (ours or frames)[-1]
    return f"{_first_line(error)} at {frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"


def _first(tokens: Sequence[int], truth: Sequence[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, truth, strict=False)) if a != b), 0)


def decoder_families() -> list[str]:
    """Every ``model_type`` transformers builds as a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _timeout(signum: int, frame: Any) -> None:
    raise TimeoutError(f"over {SECONDS} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="model types (default: every causal LM)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    families = args.families or decoder_families()
    signal.signal(signal.SIGALRM, _timeout)
    rows = []
    print("| family | outcome | Medusa, EAGLE | detail |\n|---|---|---|---|")
    for family in families:
        signal.alarm(SECONDS)
        try:
            row = sweep_one(family)
        except TimeoutError as error:
            row = Row(family, "not built", str(error))
        finally:
            signal.alarm(0)
        rows.append(row)
        cells = (row.family, row.outcome, row.features, row.detail)
        print("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |", flush=True)
    counts = {kind: sum(row.outcome == kind for row in rows) for kind in dict.fromkeys(
        row.outcome for row in rows)}  # fmt: skip
    print("\n" + ", ".join(f"{count} {kind}" for kind, count in counts.items()))
    return 1 if any(row.outcome in ("MISMATCH", "ERROR in headway") for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
