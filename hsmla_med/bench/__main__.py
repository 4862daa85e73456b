"""``python -m hsmla_med.bench``: the same as ``hsmla-med bench``."""

import sys

from hsmla_med.runtime import configure_cpu_threads

# OpenMP's waiting and thread count as hsmla-med sets them, before torch loads (libgomp reads
# them once, then): without it the benchmarks, and the processes they start, ran with libgomp's
# default spin, which hsmla-med's commands never do
configure_cpu_threads()

from hsmla_med.bench.main import main  # noqa: E402 (after the OpenMP settings)

sys.exit(main())
