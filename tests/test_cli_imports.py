"""The command line builds its parser without transformers: ``headway --help`` (and every
subcommand's) loads torch, for the help texts that name what this machine's probes chose, but
not transformers, torch.compile's machinery or a model (3.6-3.9 s here against 9.6 s when it
did, on a 2-core EPYC)."""

from __future__ import annotations

import subprocess
import sys

from headway.heads.format_names import FORMAT_SUMMARIES
from headway.heads.loading import ENGINE_FORMATS


def test_building_the_parser_loads_no_transformers() -> None:
    code = (
        "import sys\n"
        "from headway.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_format_names_are_the_registrys() -> None:
    """``headway export --help`` lists the light table's names: those of the registry, in its
    order, each format's summary the table's."""
    assert list(FORMAT_SUMMARIES) == list(ENGINE_FORMATS)
    for name, engine in ENGINE_FORMATS.items():
        assert engine.summary == FORMAT_SUMMARIES[name]
