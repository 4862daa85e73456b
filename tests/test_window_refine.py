"""``window_refine``: the soft training path's ``R`` as batched window attention over all tiles,
against the tile schedule (``local_refine(gate=None)``) and the masked ``N x N`` form
(``dense_refine``); its gradients, bf16 autocast, the ops it dispatches (no host sync, none that
depends on the batch) and ``torch.compile(fullgraph=True)``."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from hsmla_med import ops_reference
from hsmla_med.nn import functional as HF

# (features (b, h, *S, d), block, window): partial edge tiles, window above and below block,
# batch 1 and 3, head_dim not a power of two, a window wider than the map
CASES = [
    ((1, 2, 10, 13, 6), 4, 7),
    ((3, 2, 9, 7, 5), 4, 3),
    ((3, 1, 6, 6, 12), 3, 5),
    ((1, 3, 5, 11, 7), 2, 9),
    ((1, 2, 5, 6, 7, 6), 4, 3),
    ((3, 1, 3, 4, 5, 5), 2, 5),
    ((1, 1, 4, 4, 4, 3), 4, 7),
]


def _maps(shape, dtype=torch.float32, grad=False):
    return [torch.randn(shape, dtype=dtype, requires_grad=grad) for _ in range(6)]


@pytest.mark.parametrize("shape, block, window", CASES)
def test_values_match_the_tile_schedule_and_the_dense_form(shape, block, window):
    maps = _maps(shape, torch.float64)
    r = HF.window_refine(*maps, block, window)
    assert r.shape == shape and r.dtype == torch.float64
    torch.testing.assert_close(r, HF.dense_refine(*maps, window), rtol=1e-10, atol=1e-10)
    maps32 = [m.float() for m in maps]
    r32 = HF.window_refine(*maps32, block, window)
    assert r32.dtype == torch.float32
    torch.testing.assert_close(r32, HF.local_refine(*maps32, None, 0.0, block, window), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r32.double(), r, rtol=1e-4, atol=1e-5)


def test_channel_first_feature_views():
    """The layer's features are views of channel-first maps: ``head_dim`` strided, not last."""
    maps = [torch.randn(2, 3, 6, 9, 10).movedim(2, -1) for _ in range(6)]
    expected = HF.window_refine(*(m.contiguous() for m in maps), 4, 7)
    torch.testing.assert_close(HF.window_refine(*maps, 4, 7), expected)


@pytest.mark.parametrize("spatial, block, window", [((10, 13), 4, 7), ((9, 7), 4, 3), ((5, 6, 7), 4, 3), ((3, 4, 5), 2, 5)])
def test_tables_are_the_tile_schedules(spatial, block, window):
    q_index, k_index, bias, visible, inverse = HF._window_tables(spatial, block, window, torch.device("cpu"))
    q_flat, k_flat, hidden, _ = ops_reference._tile_tables(spatial, block, window, torch.device("cpu"))
    assert torch.equal(q_index, q_flat.flatten()) and torch.equal(k_index, k_flat.flatten())
    assert torch.equal(bias, hidden) and torch.equal(visible, (hidden == 0).float())
    # every token is read back from the one tile row that holds it
    assert torch.equal(q_index[inverse], torch.arange(inverse.numel()))


@pytest.mark.parametrize("shape, block, window, fast", [((1, 2, 5, 3, 3), 2, 3, False), ((1, 1, 3, 2, 3, 2), 2, 3, True)])
def test_gradcheck(shape, block, window, fast):
    """All six inputs; the 3D case checks random projections of the Jacobian (``fast_mode``)."""
    maps = _maps(shape, torch.float64, grad=True)
    assert torch.autograd.gradcheck(lambda *m: HF.window_refine(*m, block, window), maps, fast_mode=fast)


def test_gradients_equal_the_dense_forms():
    shape = (2, 2, 10, 12, 5)
    maps = _maps(shape, torch.float64, grad=True)
    grad = torch.randn(shape, dtype=torch.float64)
    ours = torch.autograd.grad(HF.window_refine(*maps, 4, 7), maps, grad)
    dense = torch.autograd.grad(HF.dense_refine(*maps, 7), maps, grad)
    for a, b in zip(ours, dense):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_bf16_autocast():
    shape = (2, 2, 9, 10, 8)
    maps = [m.bfloat16() for m in _maps(shape)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = HF.window_refine(*maps, 4, 7)
        # float32 features stay float32: autocast is off inside
        r32 = HF.window_refine(*(m.float() for m in maps), 4, 7)
    assert r.dtype == torch.bfloat16 and r32.dtype == torch.float32 and torch.isfinite(r).all()
    torch.testing.assert_close(r32, HF.window_refine(*(m.float() for m in maps), 4, 7))
    assert (r.float() - r32).abs().max() <= 1e-2 * r32.abs().max()


def test_sdpa_form_of_the_softmax_term():
    """The ``scaled_dot_product_attention`` form that CUDA takes: same values and gradients."""
    _, _, bias, _, _ = HF._window_tables((9, 7), 4, 5, torch.device("cpu"))
    tiles, bq, bk = bias.shape
    q = torch.randn(6, tiles, bq, 5, requires_grad=True)
    k, v = (torch.randn(6, tiles, bk, 5, requires_grad=True) for _ in range(2))
    grad = torch.randn(6, tiles, bq, 5)
    fused, explicit = (HF._window_softmax(q, k, v, bias, f) for f in (True, False))
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(fused, (q, k, v), grad), torch.autograd.grad(explicit, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Ops(TorchDispatchMode):
    """Records the name of every aten op dispatched."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


SYNCING = ("nonzero", "_local_scalar_dense", "item", "bincount", "masked_select", "is_nonzero", "equal")


def _synced(names):
    ops = {n.removeprefix("aten::").split(".")[0] for n in names}
    return sorted(op for op in ops if op in SYNCING or op.lstrip("_").startswith("unique"))


def _forward_backward(refine, batch):
    maps = _maps((batch, 2, 9, 10, 6), grad=True)
    grad = torch.randn(batch, 2, 9, 10, 6)
    with _Ops() as ops:
        refine(*maps).backward(grad)
    return ops.names


def test_no_host_sync_and_the_same_ops_for_every_batch():
    refine = lambda *m: HF.window_refine(*m, 4, 7)  # noqa: E731
    HF._window_tables.cache_clear()  # the first call builds the tables: they sync neither
    assert _synced(_forward_backward(refine, 3)) == []
    one, three = _forward_backward(refine, 1), _forward_backward(refine, 3)
    assert _synced(one) == [] and one == three
    # the recorder sees a sync where there is one: the tile schedule counts tiles per batch element
    assert _synced(_forward_backward(lambda *m: HF.local_refine(*m, None, 0.0, 4, 7), 3))


def test_compiled_fullgraph_equals_eager():
    torch._dynamo.reset()
    maps = _maps((2, 2, 5, 7, 6))
    with torch.no_grad():
        compiled = torch.compile(HF.window_refine, fullgraph=True)(*maps, 4, 7)
        torch.testing.assert_close(compiled, HF.window_refine(*maps, 4, 7), rtol=1e-5, atol=1e-5)


def test_compiled_backward_and_symbolic_sizes_equal_eager():
    """Forward and backward through dynamo and AOT autograd (inductor's backward compiles too
    slowly for this suite) with symbolic sizes: the tables are built in the graph, and one graph
    serves every map size."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    refine = torch.compile(lambda *m: HF.window_refine(*m, 4, 7), fullgraph=True, backend=counter, dynamic=True)
    frames = []
    for shape in [(2, 3, 5, 7, 6), (3, 2, 9, 10, 5), (4, 5, 13, 6, 7)]:  # no size shared (duck sizing)
        maps = _maps(shape, grad=True)
        grad = torch.randn(shape)
        out, ref = refine(*maps), HF.window_refine(*maps, 4, 7)
        torch.testing.assert_close(out, ref)
        for a, b in zip(torch.autograd.grad(out, maps, grad), torch.autograd.grad(ref, maps, grad)):
            torch.testing.assert_close(a, b)
        frames.append(counter.frame_count)
    assert len(set(frames)) == 1


def test_checks_arguments():
    maps = _maps((1, 2, 5, 5, 4))
    with pytest.raises(ValueError, match="window"):
        HF.window_refine(*maps, 4, 4)
    with pytest.raises(ValueError, match="block"):
        HF.window_refine(*maps, 0, 3)
    with pytest.raises(ValueError, match="share"):
        HF.window_refine(*maps[:5], torch.randn(1, 2, 5, 4, 4), 4, 3)
