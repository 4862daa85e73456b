"""File formats: atomic file output (:mod:`.atomic`, re-exported here, used by every writer);
volumes, one reader/writer class per format chosen by file ending, and the one naming rule of
predictions (:mod:`.volumes`: NIfTI, NIfTI pairs, MetaImage, NRRD through :mod:`.itk`, DICOM
series through :mod:`.dicom`, DICOM SEG through :mod:`.dicom_seg`); the pyramidal heatmap TIFF
(:mod:`.tiff`), the overlay pictures (:mod:`.overlays`), predicted tumour regions as QuPath
GeoJSON and ASAP XML (:mod:`.annotations`) and CAMELYON16's submission CSVs
(:mod:`.lesion_csv`) and the smoothing of a slide's probability map they share with the slide
score (:mod:`.smoothing`); the check of compressed voxels against their header's size
(:mod:`.compressed`). Those but :mod:`.atomic` are imported where used (pydicom, SimpleITK and
scikit-image load slowly)."""

from hsmla_med.io.atomic import atomic_path, file_sha256, is_temporary, read_npz_cache, remove_stale_temporaries, write_json, write_yaml

__all__ = ["atomic_path", "file_sha256", "is_temporary", "read_npz_cache", "remove_stale_temporaries", "write_json", "write_yaml"]
