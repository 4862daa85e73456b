"""The gate-as-a-signal helpers of hsmla_med.bench.trust (the calibration and uncertainty measurements) against hand-made
cases, and the gate pass of a tiny checkpoint against infer's probabilities."""

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from hsmla_med.bench.trust import boundary_distance, correlations, gate_signal, tile_samples


def test_boundary_distance_by_hand():
    labels = np.zeros((6, 8, 2), dtype=np.int64)
    labels[:, 4:, 0] = 1  # slice 0: a vertical edge between columns 3 and 4; slice 1: one label
    distance = boundary_distance(labels)
    expected = np.minimum(np.abs(np.arange(8) - 3), np.abs(np.arange(8) - 4)).astype(float)
    np.testing.assert_array_equal(distance[..., 0], np.broadcast_to(expected, (6, 8)))
    np.testing.assert_array_equal(distance[..., 1], 6 + 8)


def test_tile_samples_average_partial_tiles_by_hand():
    error = np.arange(5 * 7, dtype=float).reshape(5, 7, 1)
    window = (0, slice(0, 3), slice(1, 6), np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]))  # 3 x 5 pixels, tiles of 2
    gate, means = tile_samples([window], {"error": error}, tile=2)
    patch = error[0:3, 1:6, 0]
    expected = [patch[r:r + 2, c:c + 2].mean() for r in (0, 2) for c in (0, 2, 4)]  # edge tiles: the pixels they hold
    np.testing.assert_allclose(means["error"], expected)
    np.testing.assert_allclose(gate, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    with pytest.raises(ValueError, match="tiles"):
        tile_samples([(0, slice(0, 3), slice(1, 6), np.zeros((1, 3)))], {"error": error}, tile=2)


def test_correlations_signs_and_undefined():
    rng = np.random.default_rng(0)
    error = rng.random(50)
    noisy = error + rng.normal(0, 0.3, 50)
    means = {"error": error, "entropy": noisy, "distance": error.copy()}  # far from the boundary = more errors: rho -1
    rho = correlations(error ** 2, means)
    assert rho["gate"] == pytest.approx(1.0)
    assert rho["entropy"] == pytest.approx(spearmanr(noisy, error).statistic)
    assert rho["boundary"] == pytest.approx(-1.0)
    assert correlations(np.full(50, 0.3), means)["gate"] is None


def test_gate_signal_windows_are_infers(tiny_btcv_checkpoint):
    """Every window of every slice gives its gate tiles (a 40 x 36 slice, 32-pixel windows at
    overlap 0.25: 2 x 2 windows, one tile each at strides 16 and 32), and the stitched
    probabilities are infer's."""
    data = Path(tiny_btcv_checkpoint).parent.parent / "data"
    result = gate_signal(Path(tiny_btcv_checkpoint), data / "imagesTr/img0000.nii.gz", data / "labelsTr/label0000.nii.gz")
    assert result["probabilities_max_diff_vs_infer"] < 1e-5
    assert set(result["stages"]) == {"stride16", "stride32"}
    for stage in result["stages"].values():
        assert stage["tiles"] == 2 * 2 * 6 and stage["layers"] == 2
        assert all(r is None or -1.0 <= r <= 1.0 for r in stage["spearman"].values())
    assert 0.0 <= result["voxel_error_rate"] <= 1.0
