"""``python -m headway ...``: the ``headway`` command without its console script (a checkout on
``PYTHONPATH``, as on a GPU machine that cannot install the package)."""

from __future__ import annotations

import sys

from headway.cli import main

if __name__ == "__main__":
    sys.exit(main())
