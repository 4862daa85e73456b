"""Defaults that the library and the command line's help share, in a module that imports
nothing: ``hsmla-med --help`` shows them without loading torch (seconds)."""

from __future__ import annotations

__all__ = ["UNCERTAINTY_KINDS", "UNCERTAINTY_THRESHOLD", "CALIBRATION_SAMPLES"]

#: the values of ``infer --uncertainty``
UNCERTAINTY_KINDS = ("entropy", "mutual-information")
#: voxels above this uncertainty count as uncertain in the review queue: half the largest
#: possible entropy (the normalised measures' maximum is 1)
UNCERTAINTY_THRESHOLD = 0.5
#: samples (voxels or patches) kept for fitting and scoring a temperature: 250k x 14 classes is
#: 14 MB of float32, and a 1-parameter fit or a 15-bin ECE gains nothing from more
CALIBRATION_SAMPLES = 250_000
