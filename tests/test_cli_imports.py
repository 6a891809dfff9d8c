"""The command line builds its parser without transformers: ``headway --help`` (and every
subcommand's) loads torch, for the help texts that name what this machine's probes chose, but
not transformers, torch.compile's machinery or a model (3.6-3.9 s here against 9.6 s when it
did, on a 2-core EPYC); training and decoding load no peft (Medusa-2's LoRA library)."""

from __future__ import annotations

import subprocess
import sys

from headway.heads.format_names import FORMAT_SUMMARIES
from headway.heads.loading import ENGINE_FORMATS


def run_python(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter (nothing imported yet)."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return out.stdout + out.stderr


def test_building_the_parser_loads_no_transformers() -> None:
    code = (
        "import sys\n"
        "from headway.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))\n"
    )
    printed = run_python(code)
    assert printed.split("\n")[0] == "[]", printed


def test_training_and_decoding_start_without_peft() -> None:
    """peft (0.4-0.5 s of a process's start on a CPU) loads only when a Medusa-2 adapter is
    made or read."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import headway.train.loop, headway.api, headway.drafters.build, headway.eval.speed\n"
        "print('peft' in sys.modules)\n"
        "from headway.heads.medusa2 import read_adapter\n"
        "try:\n"
        "    read_adapter(Path('/nonexistent'), 'x')  # imports peft, then finds no adapter\n"
        "except Exception as error:\n"
        "    print(type(error).__name__)\n"
        "print('peft' in sys.modules)\n"
    )
    printed = run_python(code)
    assert printed.split()[:3] == ["False", "HeadsError", "True"], printed


def test_the_format_names_are_the_registrys() -> None:
    """``headway export --help`` lists the light table's names: those of the registry, in its
    order, each format's summary the table's."""
    assert list(FORMAT_SUMMARIES) == list(ENGINE_FORMATS)
    for name, engine in ENGINE_FORMATS.items():
        assert engine.summary == FORMAT_SUMMARIES[name]
