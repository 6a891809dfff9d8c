"""Other projects' packages that tests check headway's exports against (``make setup`` installs
them without their dependencies: Makefile, ``CHECK_PACKAGES``)."""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType

import pytest


def installed_modules(distribution: str, *modules: str) -> list[ModuleType]:
    """``modules`` of the installed ``distribution``; the calling test module is skipped where the
    distribution is not installed, and an installed one that fails to import fails it."""
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        pytest.skip(
            f"{distribution} is not installed (make setup installs it)", allow_module_level=True
        )
    return [importlib.import_module(module) for module in modules]
