"""hsmla-med: HSMLA attention networks and medical imaging pipelines on MONAI and Lightning."""

__version__ = "0.1.0"

import sys

from hsmla_med.quiet_cucim import keep_monai_from_loading_cucim
from hsmla_med.runtime import configure_cpu_threads

keep_monai_from_loading_cucim()  # MONAI's metrics would load cuCIM, which probes for CUDA aloud
# A script that imports hsmla_med before torch gets the OpenMP waiting and thread count that
# hsmla-med's command line sets (libgomp reads them once, when torch loads; after it, nothing
# can be changed, and the networks' load-adaptive threads still apply): HSMLA_MED_CPU_DEFAULTS=0
# leaves OpenMP's defaults.
if "torch" not in sys.modules:
    configure_cpu_threads()
