"""Load a script of ``scripts/`` as a module (scripts/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(relative: str) -> ModuleType:
    """``scripts/RELATIVE`` (``"compare.py"``, ``"device/step_costs.py"``) as a fresh module,
    registered in ``sys.modules`` as ``script_<name>`` (dataclasses look their module up
    there)."""
    path = SCRIPTS / relative
    name = "script_" + relative.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
