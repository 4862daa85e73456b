"""Inference: sliding-window prediction of volumes."""

from hsmla_med.inference.sliding import SliceNetwork, predict_volume

__all__ = ["SliceNetwork", "predict_volume"]
