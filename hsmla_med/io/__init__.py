"""Writers: atomic file output (:mod:`.atomic`, re-exported here, used by every writer), the
pyramidal heatmap TIFF (:mod:`.tiff`), the overlay pictures (:mod:`.overlays`) and predicted
tumour regions as QuPath GeoJSON and ASAP XML (:mod:`.annotations`); the one reader of DICOM
image series (:mod:`.dicom`); the check of compressed voxels against their header's size
(:mod:`.compressed`). Those but :mod:`.atomic` are imported where used (pydicom,
SimpleITK and scikit-image load slowly)."""

from hsmla_med.io.atomic import atomic_path, is_temporary, read_npz_cache, remove_stale_temporaries, write_json, write_yaml

__all__ = ["atomic_path", "is_temporary", "read_npz_cache", "remove_stale_temporaries", "write_json", "write_yaml"]
