"""Inference: sliding-window prediction of volumes."""

from hsmla_med.inference.sliding import predict_volume

__all__ = ["predict_volume"]
