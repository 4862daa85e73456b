"""hsmla-med: HSMLA attention networks and medical imaging pipelines on MONAI and Lightning."""

__version__ = "0.1.0"
