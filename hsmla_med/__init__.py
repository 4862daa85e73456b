"""hsmla-med: HSMLA attention networks and medical imaging pipelines on MONAI and Lightning."""

__version__ = "0.1.0"

from hsmla_med.quiet_cucim import keep_monai_from_loading_cucim

keep_monai_from_loading_cucim()  # MONAI's metrics would load cuCIM, which probes for CUDA aloud
