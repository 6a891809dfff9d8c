"""The package's import structure: no module imports itself back, directly or through others,
and nothing dodges a circle with an import inside a function."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import grimp

PACKAGE = Path(__file__).resolve().parents[1] / "headway"


def test_no_import_circle_anywhere_in_the_package() -> None:
    graph = grimp.build_graph("headway")
    modules = sorted(graph.modules)
    circles = [
        (a, b)
        for a, b in itertools.combinations(modules, 2)
        if graph.chain_exists(importer=a, imported=b) and graph.chain_exists(importer=b, imported=a)
    ]
    assert circles == []


def test_heads_and_decode_import_at_module_level_only() -> None:
    """Function-level imports are how circles hide; heads/ and decode/ have none."""
    late = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for folder in ("heads", "decode", "drafters")
        for path in sorted((PACKAGE / folder).glob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"\s+(from headway|import headway)", line)
    ]
    assert late == []


def test_training_and_loading_know_the_same_methods() -> None:
    """One set of methods: what ``train.method`` accepts, what training builds and what a run
    directory may hold (``DRAFTER_METHODS``, which loading and export read)."""
    import typing

    from headway.heads.io import DRAFTER_METHODS
    from headway.run_config import TrainConfig
    from headway.train.methods import METHODS

    accepted = set(typing.get_args(typing.get_type_hints(TrainConfig)["method"]))
    assert set(METHODS) == set(DRAFTER_METHODS) == accepted


def test_inference_and_corpora_import_nothing_from_training() -> None:
    """The generation engine, the corpus readers, the decoder, the runtime drafters, evaluation
    and the Python API are inference: no chain of imports leads from them to ``train``."""
    graph = grimp.build_graph("headway")
    inference = ("generation", "corpus", "decode", "drafters", "heads", "eval", "api")
    engine = sorted(
        m for m in graph.modules if any(m.startswith(f"headway.{p}") for p in inference)
    )
    training = sorted(m for m in graph.modules if m.startswith("headway.train"))
    assert len(engine) >= 40
    reached = [
        (source, target)
        for source in engine
        for target in training
        if graph.chain_exists(importer=source, imported=target)
    ]
    assert reached == []


def test_every_runtime_drafter_lives_in_drafters() -> None:
    """A class with a ``propose`` method (the Drafter protocol) is defined in ``drafters/`` only;
    ``decode/`` keeps the protocols (one sequence's, a batch's), the loop's "no drafter" and
    the batch loop's asking of one drafter per row, ``heads/`` the trainable modules, ``eval/``
    wrappers that time or record another drafter."""
    allowed = {("decode", "Drafter"), ("decode", "_NoDrafter")}
    allowed |= {("decode", "BatchDrafter"), ("decode", "RowDrafters")}
    allowed |= {("eval", "TimedDrafter"), ("eval", "RecordingDrafter")}
    outside = [
        f"{path.relative_to(PACKAGE)}:{node.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.parent.name != "drafters"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        and any(isinstance(f, ast.FunctionDef) and f.name == "propose" for f in node.body)
        and (path.parent.name, node.name) not in allowed
    ]
    assert outside == []


def test_no_two_modules_share_a_name() -> None:
    """One name, one module: outside ``cli/`` (whose modules are named after their commands) no
    two modules of different packages share a file name, and none is named like a package."""
    names: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem not in ("__init__", "__main__") and path.parent.name != "cli":
            names.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert shared == {}
    assert sorted(packages & set(names)) == []
