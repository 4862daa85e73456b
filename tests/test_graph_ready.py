"""A HSMLA forward a CUDA graph can capture: no host sync, launch grids that
do not depend on the gate, and few launches.

Without a GPU the CUDA path runs under Triton's interpreter (``backend="triton"`` on CPU tensors:
the same Python code and launches as on CUDA); :func:`hsmla_med.bench.census.census` records
every ATen operation and every Triton launch with its grid. Budgets: per HSMLA layer at most 8
kernel-launching operations outside the attention kernels and 3 launches inside; in a whole
network's inference forward and in a training step, forward and backward, no syncing operation.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if CUDA else "cpu")  # on a GPU the same tests run natively, through the op

pytest.importorskip("triton")

from hsmla_med.bench.census import census  # noqa: E402
from hsmla_med.nn import HSMLA, HSMLASegNet  # noqa: E402

LAYER_OPS = 8  # kernel-launching operations of one HSMLA layer outside its attention kernels
LAYER_LAUNCHES = 3  # the linear attention's two kernels and the refinement's one


def _layer(spatial_dims, channels=32, head_dim=16, block=4, seed=0):
    torch.manual_seed(seed)
    layer = HSMLA(spatial_dims, channels, head_dim=head_dim, block=block, window=5, backend="triton").eval()
    torch.nn.init.normal_(layer.gate_weight, std=2.0)
    return layer.to(DEVICE)


def _map(spatial, channels=32, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(1, channels, *spatial, device=DEVICE)
    return x.contiguous(memory_format=torch.channels_last if len(spatial) == 2 else torch.channels_last_3d)


@pytest.mark.parametrize("spatial", [(12, 16), (10, 13), (4, 8, 8)], ids=str)
def test_a_layer_syncs_never_and_stays_in_budget(spatial):
    layer = _layer(len(spatial))
    x = _map(spatial)
    layer.calibrate(x, 0.5)
    with torch.no_grad():
        layer(x)  # caches built before the census, as before a capture
        out, seen = census(layer, x)
    assert seen.syncs == []
    assert sum(seen.launches.values()) == LAYER_LAUNCHES, seen.launches
    assert sum(seen.ops.values()) <= LAYER_OPS, seen.ops
    layer.backend = "reference"
    with torch.no_grad():
        torch.testing.assert_close(out, layer(x), rtol=1e-4, atol=1e-5)


def test_launch_grids_do_not_depend_on_the_gate():
    layer = _layer(2)
    x = _map((16, 16))
    grids, outputs = [], []
    with torch.no_grad():
        for alpha in (0.1, 0.9):
            layer.calibrate(x, alpha)
            out, seen = census(layer, x)
            assert abs(layer.last_alpha - alpha) < 0.15
            grids.append(seen.grids)
            outputs.append(out)
    assert grids[0] == grids[1] and len(grids[0]) == LAYER_LAUNCHES
    assert not torch.equal(outputs[0], outputs[1])  # the gate did select other tiles


@pytest.mark.parametrize("routing", ["off", "all"])
def test_routing_off_and_all_sync_never(routing):
    layer = _layer(2)
    layer.routing = routing
    x = _map((8, 12))
    with torch.no_grad():
        out, seen = census(layer, x)
        layer.backend = "reference"
        torch.testing.assert_close(out, layer(x), rtol=1e-4, atol=1e-5)
    assert seen.syncs == []
    assert sum(seen.launches.values()) == (2 if routing == "off" else LAYER_LAUNCHES)


@pytest.mark.parametrize("spatial_dims,variant", [(2, "b2"), (3, "b0")])
def test_network_inference_syncs_never(spatial_dims, variant):
    torch.manual_seed(0)
    net = HSMLASegNet(spatial_dims, 1, 3, variant=variant).eval().to(DEVICE)
    net.set_backend("triton")
    x = torch.randn(1, 1, *((64, 64) if spatial_dims == 2 else (32, 32, 32)), device=DEVICE)
    with torch.no_grad():
        net.calibrate_tau(x, 0.3)
        net(x)
        _, seen = census(net, x)
    layers = len(net.hsmla_layers())
    assert seen.syncs == []
    assert sum(seen.launches.values()) == LAYER_LAUNCHES * layers
    print(f"{variant} {spatial_dims}D eager forward: {seen.kernels} kernels ({sum(seen.ops.values())} ATen, "
          f"{sum(seen.launches.values())} Triton launches)")


@pytest.mark.parametrize("spatial", [(24, 24), (6, 6)], ids=["window-refine", "dense"])
def test_training_step_syncs_never(spatial):
    """Forward and backward in training: the soft refinement on every token, by batched window
    attention on large maps and masked N x N scores on small ones."""
    torch.manual_seed(0)
    layer = HSMLA(2, 32, head_dim=16).train().to(DEVICE)
    x = _map(spatial).requires_grad_(True)

    def step():
        out = layer(x)
        budget, smoothness = layer.regularizers()
        (out.square().mean() + budget + smoothness).backward()

    for batch in (1, 3):
        x = _map(spatial).expand(batch, -1, -1, -1).contiguous(memory_format=torch.channels_last).requires_grad_(True)
        _, seen = census(step)
        assert seen.syncs == [], seen.syncs
        assert x.grad is not None and torch.isfinite(x.grad).all()
