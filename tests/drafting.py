"""Build a drafter from a heads folder on a bare model (no tokenizer), through the one factory
(:func:`headway.drafters.build.build_drafter`), with options as ``--draft-option`` gives them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from headway.decode.generate import Drafter
from headway.drafters.build import build_drafter, spec_for
from headway.target import Target


def heads_drafter(
    directory: str | Path, model: Any, *, force: bool = False, **options: Any
) -> Drafter:
    """``build_drafter(spec_for(heads=directory, options=...), Target(model))``; ``choices`` is
    the old name of the option ``tree``."""
    if "choices" in options:
        options["tree"] = options.pop("choices")
    if force:
        options["force"] = True
    target = Target(model=model, tokenizer=None, source="test")  # type: ignore[arg-type]
    return build_drafter(spec_for(heads=str(directory), options=options), target)
