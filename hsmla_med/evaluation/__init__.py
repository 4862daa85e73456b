"""Scoring, in one place: predictions of any tool against the references, as the benchmarks'
official scripts and nnU-Net score them.

- :mod:`~hsmla_med.evaluation.segmentation`: label maps against label maps (BTCV, any volume
  segmentation; nnU-Net's ``compute_metrics_on_folder`` plus HD95, NSD and intervals), also
  what validation and post-processing score with. Its public names are re-exported here.
- :mod:`~hsmla_med.evaluation.pathology`: whole-slide lesion detections against ASAP XML
  outlines or the ground-truth mask TIFFs, as CAMELYON16's ``Evaluation_FROC.py``.
- :mod:`~hsmla_med.evaluation.detection`: nodule candidates in world millimetres against
  annotations, excluded findings and the scanned series, as LUNA16's ``noduleCADEvaluationLUNA16.py``.
- :mod:`~hsmla_med.evaluation.frames`: mask PNGs against EndoVis 2017 frames' labels, each at its
  frame's size, by the per-frame rule of TernausNet's ``evaluate.py`` and with nnU-Net's counts.

The metrics themselves (Dice, HD95, FROC, ...) are :mod:`hsmla_med.metrics`'; the pipelines'
``score_predictions`` (``evaluate --predictions``) read a task's files and call these.
"""

from hsmla_med.evaluation.segmentation import (DEFAULT_NSD_TOLERANCE, check_geometry, check_nsd_tolerance, evaluate_folder, pair_files,
                                               read_labels, score_prediction)

__all__ = ["DEFAULT_NSD_TOLERANCE", "check_nsd_tolerance", "evaluate_folder", "pair_files", "check_geometry", "read_labels", "score_prediction"]
