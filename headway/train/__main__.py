"""``python -m headway.train`` / ``accelerate launch -m headway.train --config X [overrides]``."""

from __future__ import annotations

import sys

from headway.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
