"""headway: speculative-decoding drafters for any Hugging Face causal LM.

Train Medusa / EAGLE-1/2 / EAGLE-3 drafters on a frozen target, export them for vLLM and SGLang,
measure their acceptance length, and decode with them losslessly through tree verification.
"""

from __future__ import annotations

from typing import Any

from headway.version import __version__

__all__ = ["__version__", "generate", "generate_batch", "load_drafter", "load_target", "release"]


def __getattr__(name: str) -> Any:
    # The API pulls in torch and transformers; import it on first use, so `import headway` and
    # `headway --help` stay quick.
    if name in {"generate", "generate_batch", "load_drafter", "load_target", "release"}:
        from headway import api, named_drafters, target

        return {
            "generate": api.generate,
            "generate_batch": api.generate_batch,
            "load_drafter": api.load_drafter,
            "load_target": target.load_target,
            "release": named_drafters.release,
        }[name]
    raise AttributeError(f"module 'headway' has no attribute {name!r}")
