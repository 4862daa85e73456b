"""The network and layer benchmark of issue 2 under the name it was asked for: the same as
``hsmla-med bench`` (code in ``hsmla_med/bench/``, one module per table, ``main.py`` the command; options: ``--help``).

    .venv/bin/python scripts/bench_models.py --out bench_out
"""

import sys

from hsmla_med.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
