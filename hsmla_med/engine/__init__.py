"""The generic Lightning engine: segmentation module, DataModule base, run helpers."""

from hsmla_med.engine.datamodule import CaseDataModule
from hsmla_med.engine.run import build_trainer, evaluate, fit, load_module
from hsmla_med.engine.segmentation import SegmentationModule

__all__ = ["CaseDataModule", "SegmentationModule", "build_trainer", "evaluate", "fit", "load_module"]
