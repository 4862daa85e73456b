"""DataModule base shared by the task pipelines: cached MONAI datasets over lists of cases."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from multiprocessing.pool import ThreadPool

import lightning as L
from monai.data import CacheDataset, DataLoader, list_data_collate

from hsmla_med.errors import DataError

__all__ = ["CaseDataModule", "JoinedCacheDataset"]


class JoinedCacheDataset(CacheDataset):
    """MONAI's ``CacheDataset`` whose cache-filling threads have all ended when it returns or raises.

    MONAI fills the cache inside ``with ThreadPool(...)``, whose exit terminates the pool without
    joining its threads. When one case raises (a 4D image, NaN voxels, a bad frame), the other
    threads are still reading theirs, in torch, NumPy or zlib without the GIL, while the command
    prints its one-line error and Python shuts down; a daemon thread that takes the GIL back then
    is ended by ``pthread_exit``, whose unwinding through torch's C++ frames calls
    ``std::terminate`` ("terminate called without an active exception", exit 134 instead of 2).
    Here the pool is terminated (cases not started are dropped) and then joined.
    """

    def _fill_cache(self, indices=None) -> list:
        if self.cache_num <= 0:
            return []
        pool = ThreadPool(self.num_workers)
        try:
            return list(pool.imap(self._load_cache_item, list(range(self.cache_num)) if indices is None else indices))
        finally:
            pool.terminate()
            pool.join()


class CaseDataModule(L.LightningDataModule):
    """Training and validation over lists of case dicts (``{"image": path, "label": path}``).

    Deterministic transforms are cached (MONAI ``CacheDataset`` caches everything up to the first
    random transform); random crops yielding several samples per case are flattened into the
    batch by ``list_data_collate``. Each case dict gets ``case``, its index in its list, which the
    validation uses to count every case exactly once across processes.

    Args:
        training, validation: case dicts.
        train_transform, val_transform: MONAI ``Compose`` pipelines.
        batch_size: cases per training batch (times the samples each yields).
        num_workers: DataLoader worker processes (and cache-filling threads).
        cache_rate: share of the cases to cache in memory.
    """

    def __init__(
        self,
        training: Sequence[dict],
        validation: Sequence[dict],
        train_transform: Callable,
        val_transform: Callable,
        batch_size: int = 2,
        num_workers: int = 0,
        cache_rate: float = 1.0,
    ) -> None:
        super().__init__()
        if not validation:
            raise DataError("the dataset has no validation cases")
        self.training = [dict(c, case=i) for i, c in enumerate(training)]
        self.validation = [dict(c, case=i) for i, c in enumerate(validation)]
        self.train_transform, self.val_transform = train_transform, val_transform
        self.batch_size, self.num_workers, self.cache_rate = batch_size, num_workers, cache_rate
        self.train_set = self.val_set = None

    def _dataset(self, cases: list[dict], transform: Callable) -> CacheDataset:
        return JoinedCacheDataset(cases, transform, cache_rate=self.cache_rate, num_workers=max(1, self.num_workers), progress=False)

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None:
            if not self.training:  # checked here, not above: evaluate scores another dataset's cases with none to train on
                raise DataError("the dataset has no training cases")
            self.train_set = self._dataset(self.training, self.train_transform)
        if stage in (None, "fit", "validate") and self.val_set is None:
            self.val_set = self._dataset(self.validation, self.val_transform)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            collate_fn=list_data_collate,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=1, num_workers=self.num_workers)
