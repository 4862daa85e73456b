"""Evaluation metrics: per-case segmentation Dice and HD95 (mm) and their summary."""

from hsmla_med.metrics.segmentation import case_scores, summarize

__all__ = ["case_scores", "summarize"]
