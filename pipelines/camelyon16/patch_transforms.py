"""CAMELYON16's patch transforms: reading a patch lazily from its slide, stain normalisation and
stain-robust augmentation, and the channels-last collate (MONAI's ``apps/pathology``
``transforms``)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch
from monai.data import list_data_collate
from monai.transforms import Compose, MapTransform, RandFlipd, RandRotate90d, RandScaleIntensityd, RandShiftIntensityd

from hsmla_med.data.patch_readers import open_patches, requested_reader
from hsmla_med.data.stain import hed_jitter, stain_normalization

log = logging.getLogger("hsmla_med")


class ReadPatchd(MapTransform):
    """Read the patch ``(slide, x, y, level, size)`` of an item as ``image`` ``(3, size, size)``,
    float32 in 0..1 (for augmentation), or with ``uint8`` the bytes as read (0..255), which
    :class:`~hsmla_med.engine.classification.ClassificationModule` scales on its device: a
    quarter of the bytes through the loader workers' shared memory and the host-to-device copy.
    Slides are opened lazily, once per process (DataLoader workers included), and only the
    patch's region is read, by tifffile or cuCIM where they agree with OpenSlide, else OpenSlide
    (:func:`~hsmla_med.data.patch_readers.open_patches`; ``HSMLA_MED_SLIDE_READER``); ``keep``
    bounds the handles held open (the least recently used closes first; inference reads slide
    after slide and keeps one)."""

    def __init__(self, keep: int | None = None, uint8: bool = False) -> None:
        super().__init__(["slide"])
        requested_reader()  # a bad HSMLA_MED_SLIDE_READER is refused before training or inference starts
        self.keep, self.uint8 = keep, uint8
        self._open: OrderedDict[str, object] = OrderedDict()

    def __call__(self, item: dict) -> dict:
        path = item["slide"]
        if path not in self._open:
            if self.keep is not None and len(self._open) >= self.keep:
                self._open.popitem(last=False)[1].close()
            self._open[path] = open_patches(path)
        self._open.move_to_end(path)
        rgb = self._open[path].read(int(item["x"]), int(item["y"]), int(item["level"]), int(item["size"]))
        image = torch.from_numpy(rgb).permute(2, 0, 1)  # a channels-last view: the networks run channels-last
        return {**item, "image": image if self.uint8 else image.float().div_(255.0)}


def patch_collate(items: list[dict]) -> dict:
    """MONAI's ``list_data_collate`` with the patches' ``image`` stacked channels-last, as the
    networks run: :class:`ReadPatchd`'s images are channels-last views of the bytes read, which
    ``torch.stack`` (``default_collate``) copies into a contiguous NCHW batch by a strided copy
    that the network then undoes (25-40 ms per 32 patches of 256 px against 1.3 ms for stacking
    the pixel rows as read, on this project's 2-vCPU host: docs/benchmarks.md). Hand-written:
    neither MONAI's nor PyTorch's collate takes a memory format."""
    rest = list_data_collate([{k: v for k, v in item.items() if k != "image"} for item in items])
    rest["image"] = torch.stack([torch.as_tensor(item["image"]).permute(1, 2, 0) for item in items]).permute(0, 3, 1, 2)
    return rest


def _stain(data: dict) -> list:
    """The stain normalisation ``data.stain_normalization`` asks for (a transform right after
    :class:`ReadPatchd`; none by default), the slides' estimates cached beside their patch grids."""
    return stain_normalization(data, Path(data["cache_dir"]).expanduser() / "camelyon16-patches")


def transforms(config: dict) -> tuple[Compose, Compose]:
    """Patch reading (and stain normalisation, when configured) plus stain-robust augmentation
    (HED stain jitter, per-channel intensity scale and shift, flips, 90-degree rotations) for
    training; patch reading (and normalisation) alone, in bytes, for validation."""
    aug, stain = config["data"]["augment"], _stain(config["data"])
    train = Compose([
        ReadPatchd(),
        *stain,
        RandFlipd("image", prob=aug["flip_prob"], spatial_axis=0),
        RandFlipd("image", prob=aug["flip_prob"], spatial_axis=1),
        RandRotate90d("image", prob=aug["rot90_prob"], max_k=3),
        hed_jitter(aug),
        RandScaleIntensityd("image", factors=aug["colour_scale"], prob=aug["colour_prob"], channel_wise=True),
        RandShiftIntensityd("image", offsets=aug["colour_shift"], prob=aug["colour_prob"], channel_wise=True),
    ])
    return train, Compose([ReadPatchd(uint8=True), *stain])
