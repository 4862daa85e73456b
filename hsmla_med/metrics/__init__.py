"""Evaluation metrics: per-case segmentation Dice and HD95 (mm) and their summary; pathology
AUC, slide score and lesion-level FROC."""

from hsmla_med.metrics.pathology import auc, detect_lesions, lesion_froc, lesion_labels, slide_score
from hsmla_med.metrics.segmentation import case_scores, summarize

__all__ = ["case_scores", "summarize", "auc", "slide_score", "detect_lesions", "lesion_froc", "lesion_labels"]
