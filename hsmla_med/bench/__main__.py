"""``python -m hsmla_med.bench``: the same as ``hsmla-med bench``."""

import sys

from hsmla_med.bench.main import main

sys.exit(main())
