"""The engine formats' ``--format`` names and one-line summaries, in a module of their own so
that the command line's help reads them without loading torch or transformers; each
:class:`~headway.heads.formats.EngineFormat` takes its summary from here
(:data:`headway.heads.loading.ENGINE_FORMATS` is the registry, in this order)."""

from __future__ import annotations

__all__ = ["FORMAT_SUMMARIES"]

FORMAT_SUMMARIES: dict[str, str] = {
    "medusa": "FasterDecoding/Medusa reference layout (medusa_lm_head.safetensors)",
    "medusa-vllm": "vLLM MedusaModel (model.safetensors; not in vLLM 0.33, which dropped Medusa)",
    "eagle1": "EAGLE-1/2 reference layout (fc + one decoder layer)",
    "eagle3-hf": "vLLM / SGLang EAGLE-3 (LlamaForCausalLMEagle3, d2t/t2d)",
    "speculators": "vLLM-native speculators EAGLE-3 (speculators_config; vllm serve DIR)",
}
