"""Evaluation metrics: per-case segmentation Dice and HD95 (mm), per-frame Dice and IoU (per
class and by the EndoVis reference rule), and their summaries; pathology AUC, slide score and
lesion-level FROC; LUNA16 nodule candidates, hit rule, FROC and CPM."""

from hsmla_med.metrics.detection import extract_candidates, match_candidates, nodule_froc
from hsmla_med.metrics.pathology import auc, detect_lesions, evaluation_mask, lesion_froc, slide_fp_tp, slide_score
from hsmla_med.metrics.segmentation import case_scores, frame_confusion, frame_reference_scores, frame_scores, summarize, summarize_frames

__all__ = ["case_scores", "summarize", "frame_confusion", "frame_scores", "frame_reference_scores", "summarize_frames", "auc", "slide_score", "detect_lesions", "evaluation_mask", "lesion_froc", "slide_fp_tp", "extract_candidates", "match_candidates", "nodule_froc"]
