"""Device and process choices of multi-process runs, checked on the CPU (no GPU or peers needed)."""

from __future__ import annotations

import pytest

from hsmla_med.engine.prediction import _accelerator
from hsmla_med.errors import InputError


def test_a_gpu_index_is_kept_or_the_combination_refused():
    assert _accelerator("cuda:1") == ("gpu", [1])
    assert _accelerator("cuda:1", 1) == ("gpu", [1])  # the index used to give way to --devices (GPU 0)
    assert _accelerator("cuda", 2) == ("gpu", 2) and _accelerator("cpu", 2) == ("cpu", 2) and _accelerator("cpu") == ("cpu", 1)
    with pytest.raises(InputError, match=r"--device cuda:1 names one GPU, --devices 2 asks for 2 processes"):
        _accelerator("cuda:1", 2)


def test_missing_ranks_are_written_as_runs():
    from hsmla_med.engine.distributed import _ranks

    assert _ranks([1]) == "1" and _ranks([2, 3, 4, 7, 9, 10]) == "2-4, 7, 9-10"
