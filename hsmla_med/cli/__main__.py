"""``python -m hsmla_med.cli``: the ``hsmla-med`` command."""

import sys

from hsmla_med.cli.main import main

sys.exit(main())
