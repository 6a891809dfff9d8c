"""headway: speculative-decoding drafters for any Hugging Face causal LM.

Train Medusa / EAGLE-1/2 / EAGLE-3 drafters on a frozen target, export them for vLLM and SGLang,
measure their acceptance length, and decode with them losslessly through tree verification.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
