"""Defaults that the library and the command line's help share, and the names of outputs that
their writers and the report share, in a module that imports nothing of the package or of torch:
``hsmla-med --help`` shows them, and ``hsmla-med report`` reads the outputs, without loading
torch (seconds)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["UNCERTAINTY_KINDS", "UNCERTAINTY_THRESHOLD", "CALIBRATION_SAMPLES", "UNCERTAINTY_MAPS", "REVIEW_QUEUE", "uncertainty_map_path",
           "GATE_REFINED"]

#: the values of ``infer --uncertainty``
UNCERTAINTY_KINDS = ("entropy", "mutual-information")
#: voxels above this uncertainty count as uncertain in the review queue: half the largest
#: possible entropy (the normalised measures' maximum is 1)
UNCERTAINTY_THRESHOLD = 0.5
#: samples (voxels or patches) kept for fitting and scoring a temperature: 250k x 14 classes is
#: 14 MB of float32, and a 1-parameter fit or a 15-bin ECE gains nothing from more
CALIBRATION_SAMPLES = 250_000

#: infer --uncertainty: the folder under OUTPUT of the maps and the review queue's per-case rows
UNCERTAINTY_MAPS = "uncertainty"
#: infer --uncertainty: OUTPUT's review queue
REVIEW_QUEUE = "uncertainty.csv"


def uncertainty_map_path(output: str | Path, case: str) -> Path:
    """Where ``infer --uncertainty`` writes a case's map under ``output`` (a NIfTI on the label
    map's grid, whatever the input's format)."""
    return Path(output) / UNCERTAINTY_MAPS / f"{case}_uncertainty.nii.gz"


#: a validation summary's share of tiles refined per gated HSMLA layer
#: (:meth:`~hsmla_med.engine.base.GatedModule.refined_per_layer`)
GATE_REFINED = "gate_refined_per_layer"
