"""hsmla-med: HSMLA attention networks and medical imaging pipelines on MONAI and Lightning."""

__version__ = "0.1.0"

from hsmla_med.quiet_cucim import keep_monai_from_loading_cucim
from hsmla_med.torchvision_ops import declare_missing_operators_on_import

keep_monai_from_loading_cucim()  # MONAI's metrics would load cuCIM, which probes for CUDA aloud
declare_missing_operators_on_import()  # a CUDA torchvision beside the CPU torch imports (timm, torchmetrics)
