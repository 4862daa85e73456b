"""Writers: atomic file output (:mod:`.atomic`, re-exported here, used by every writer), the
pyramidal heatmap TIFF (:mod:`.tiff`) and the overlay pictures (:mod:`.overlays`); the one
reader of DICOM image series (:mod:`.dicom`, imported where used: pydicom and SimpleITK load
slowly)."""

from hsmla_med.io.atomic import atomic_path, is_temporary, remove_stale_temporaries, write_json, write_yaml

__all__ = ["atomic_path", "is_temporary", "remove_stale_temporaries", "write_json", "write_yaml"]
