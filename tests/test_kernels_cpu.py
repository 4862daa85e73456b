"""The C refinement kernel (``hsmla_med.kernels.refine_cpu``) against its reference,
:func:`hsmla_med.nn.functional.local_refine` (itself tested against float64 brute force).

Inputs are fresh random numbers every run, laid out as the HSMLA layer makes them (head views
of a channels-last map) or as plain contiguous tensors. Every comparison first makes the
reference unreachable from the wrapper, so a silent fallback fails the test.
"""

import ctypes
import hashlib
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from hsmla_med import kernels
from hsmla_med.kernels import _cpu_build, gate_cpu, norm_cpu, refine_cpu
from hsmla_med.nn import HSMLA
from hsmla_med.nn import functional as HF

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

# (shape (b, h, *S, d), block, window): odd maps, partial edge tiles, head_dim not a multiple of
# the 16 vector lanes, tiles of 1 and of 64 queries, 3D.
CASES = [
    ((2, 3, 9, 11, 8), 4, 3),
    ((1, 2, 16, 16, 32), 4, 7),
    ((1, 2, 13, 10, 20), 8, 5),
    ((2, 1, 7, 5, 4), 1, 5),
    ((1, 2, 6, 5, 7, 8), 4, 3),
    ((2, 1, 5, 9, 4, 12), 2, 5),
]
IDS = ["x".join(map(str, s)) + f"-b{b}-w{w}" for s, b, w in CASES]


@pytest.fixture
def kernel_only(monkeypatch):
    """Fail instead of falling back to the reference."""
    assert kernels.cpu_kernel_available()

    def refuse(*args, **kwargs):
        raise AssertionError("the wrapper fell back to the reference")

    monkeypatch.setattr(refine_cpu, "reference", refuse)


def _maps(shape, layout):
    """Six ``(b, h, *S, d)`` maps: head views of two channels-last ``(b, *S, 3 h d)`` maps (the
    layer's q, k, v and qh, kh, vh) or independent contiguous tensors."""
    b, h, *spatial, d = shape
    if layout == "contiguous":
        return [torch.randn(shape) for _ in range(6)]
    maps = []
    for _ in range(2):
        x = torch.randn(b, *spatial, 3, h, d).movedim(-3, 1).movedim(-2, 2)  # (b, 3, h, *S, d)
        maps += list(x.unbind(1))
    return maps


def _gate(shape, block, which):
    grid = (shape[0], *HF.tile_grid(tuple(shape[2:-1]), block))
    gate = torch.rand(grid)
    tau = {"between": float(gate.median()), "all": -1.0, "none": 2.0}[which]
    return gate, tau


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
@pytest.mark.parametrize("which", ["between", "all", "none"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_residual_matches_reference(case, which, layout, kernel_only, monkeypatch):
    shape, block, window = case
    maps = _maps(shape, layout)
    gate, tau = _gate(shape, block, which)
    got = refine_cpu.local_refine(*maps, gate, tau, block, window, 1e-6)
    monkeypatch.undo()
    expected = HF.local_refine(*maps, gate, tau, block, window, 1e-6)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if which == "none":
        assert torch.count_nonzero(got) == 0


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dense_residual_matches_reference(case, kernel_only, monkeypatch):
    shape, block, window = case
    maps = _maps(shape, "channels_last")
    got = refine_cpu.local_refine(*maps, None, 0.0, block, window, 1e-6)
    monkeypatch.undo()
    torch.testing.assert_close(got, HF.local_refine(*maps, None, 0.0, block, window, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_add_to_adds_gate_weighted_residual_and_nothing_else(case, kernel_only, monkeypatch):
    """``add_to`` (channel-first, like the layer's linear output) receives ``gate * R`` on the
    active tiles; every other element keeps its exact value."""
    shape, block, window = case
    b, h, *spatial, d = shape
    maps = _maps(shape, "channels_last")
    gate, tau = _gate(shape, block, "between")
    base = torch.randn(b, h, d, *spatial).movedim(2, -1)
    got = refine_cpu.local_refine(*maps, gate, tau, block, window, 1e-6, add_to=base.clone())
    monkeypatch.undo()
    expected = HF.local_refine(*maps, gate, tau, block, window, 1e-6, add_to=base.clone())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    active = HF.tile_broadcast(gate > tau, block, tuple(spatial))[:, None, ..., None].expand_as(base)
    assert torch.equal(got[~active], base[~active])


def test_reads_nothing_outside_the_active_halos(kernel_only):
    """NaN everywhere but one active tile's halo leaves the result finite."""
    block, window = 4, 3
    maps = _maps((1, 2, 16, 16, 8), "channels_last")
    gate = torch.zeros(1, 4, 4)
    gate[0, 1, 2] = 1.0  # rows 4..7, columns 8..11; halo rows 3..8, columns 7..12
    keep = torch.zeros(16, 16, dtype=torch.bool)
    keep[3:9, 7:13] = True
    for m in maps:
        m[:, :, ~keep] = math.nan
    r = refine_cpu.local_refine(*maps, gate, 0.5, block, window, 1e-6)
    assert torch.isfinite(r).all()
    assert torch.count_nonzero(r[:, :, 4:8, 8:12]) == r[:, :, 4:8, 8:12].numel()


@pytest.mark.parametrize("why", ["float64", "gradient", "strided head_dim"])
def test_inputs_it_does_not_take_run_the_reference(why):
    shape, block, window = (1, 2, 9, 7, 4), 4, 3
    maps = _maps(shape, "contiguous")
    if why == "float64":
        maps = [m.double() for m in maps]
    elif why == "gradient":
        maps = [m.requires_grad_() for m in maps]
    else:
        maps = [torch.randn(1, 2, 4, 9, 7).movedim(2, -1) for _ in range(6)]  # channel-first
    r = refine_cpu.local_refine(*maps, None, 0.0, block, window, 1e-6)
    torch.testing.assert_close(r, HF.local_refine(*maps, None, 0.0, block, window, 1e-6))
    if why == "gradient":
        r.sum().backward()
        assert all(m.grad is not None for m in maps)


def test_bad_arguments_raise():
    maps = _maps((1, 2, 8, 8, 4), "channels_last")
    with pytest.raises(ValueError, match="gate"):
        refine_cpu.local_refine(*maps, torch.zeros(1, 3, 3), 0.0, 4, 3)
    with pytest.raises(ValueError, match="add_to"):
        refine_cpu.local_refine(*maps, None, 0.0, 4, 3, add_to=torch.zeros(1, 2, 8, 8, 4))
    with pytest.raises(ValueError, match="window"):
        refine_cpu.local_refine(*maps, None, 0.0, 4, 4)


def _forget_libraries():
    for cached in (_cpu_build.library, refine_cpu._library, gate_cpu._library, norm_cpu._library):
        cached.cache_clear()


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """Builds into an empty cache; the process-wide libraries are looked up again afterwards."""
    monkeypatch.setenv("HSMLA_MED_CACHE_DIR", str(tmp_path))
    _forget_libraries()
    yield tmp_path
    monkeypatch.undo()
    _forget_libraries()


def test_builds_once_into_the_cache(fresh_build):
    """One library and its checksum sidecar (the SHA-256 of the library's bytes), no temporary
    left behind; a second start loads that library without building it again."""
    assert refine_cpu.compiled()
    library, sidecar = sorted(fresh_build.iterdir())
    assert library.suffix == ".so" and sidecar.name == library.name + ".sha256"
    assert sidecar.read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()
    built = library.stat().st_mtime_ns
    _forget_libraries()
    assert refine_cpu.compiled() and sorted(fresh_build.iterdir()) == [library, sidecar]
    assert library.stat().st_mtime_ns == built


@pytest.fixture
def loads(monkeypatch):
    """The files ``ctypes.CDLL`` loads: (path, SHA-256 of its bytes at that moment)."""
    seen = []
    real = ctypes.CDLL

    def spy(path, *args, **kwargs):
        seen.append((Path(path), hashlib.sha256(Path(path).read_bytes()).hexdigest()))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", spy)
    return seen


def _replace(path, data):
    """New bytes at ``path`` in a new file: the library this process has loaded stays mapped
    untouched (writing into it would change the running code)."""
    other = path.with_name(path.name + ".new")
    other.write_bytes(data)
    other.chmod(path.stat().st_mode)
    os.replace(other, path)


def _cached_refine_library(folder):
    (library,) = [p for p in folder.iterdir() if p.name.startswith("refine_cpu") and p.suffix == ".so"]
    return library


@pytest.mark.parametrize("how", ["other library", "appended bytes", "writable by others"])
def test_a_tampered_cached_library_is_not_loaded(how, fresh_build, loads):
    """A cached library that differs from the checksum its build recorded (here the gate's
    library, which loads fine but has no refinement entry point, or the right one with bytes
    appended) or that others may write to is rebuilt, with a warning, and never loaded."""
    assert refine_cpu.compiled() and gate_cpu._library() is not None
    library = _cached_refine_library(fresh_build)
    recorded = Path(str(library) + ".sha256").read_text().strip()
    if how == "other library":
        gate = next(p for p in fresh_build.iterdir() if p.name.startswith("gate_cpu") and p.suffix == ".so")
        _replace(library, gate.read_bytes())
    elif how == "appended bytes":
        _replace(library, library.read_bytes() + b"\0")
    else:
        library.chmod(0o777)
    tampered = hashlib.sha256(library.read_bytes()).hexdigest()
    _forget_libraries()
    loads.clear()
    with pytest.warns(UserWarning, match="not loading the cached kernel"):
        assert refine_cpu.compiled()
    assert [path for path, _ in loads] == [library]
    assert loads[0][1] == recorded
    if how != "writable by others":
        assert tampered != recorded
    assert hasattr(refine_cpu._library(), "hsmla_refine_tiles")
    assert library.stat().st_mode & 0o022 == 0


def test_a_cached_library_without_checksum_is_rebuilt(fresh_build, loads):
    """A library with no sidecar (a cache from before the checksums, or a planted file) is
    rebuilt before anything is loaded."""
    assert refine_cpu.compiled()
    library = _cached_refine_library(fresh_build)
    Path(str(library) + ".sha256").unlink()
    _replace(library, b"not a library")
    _forget_libraries()
    loads.clear()
    assert refine_cpu.compiled()
    assert loads[0][0] == library and loads[0][1] == Path(str(library) + ".sha256").read_text().strip()


@pytest.mark.parametrize("how", ["garbage sidecar", "garbage library with its checksum"])
def test_garbage_in_the_cache_is_rebuilt(how, fresh_build, loads, monkeypatch):
    """A sidecar that is no checksum (binary bytes) used to end in UnicodeDecodeError; a damaged
    library whose sidecar matches it (both written by this user) made the kernels give up for
    the run. Both are rebuilt, with a warning, and the rebuilt library is the one loaded."""
    assert refine_cpu.compiled()
    # the cache moves to another folder: dlopen hands back a library already loaded from the
    # same path without reading the file again
    moved = fresh_build / "moved"
    moved.mkdir(mode=0o700)
    for path in list(fresh_build.iterdir()):
        if path != moved:
            path.rename(moved / path.name)
    monkeypatch.setenv("HSMLA_MED_CACHE_DIR", str(moved))
    library = _cached_refine_library(moved)
    sidecar = Path(str(library) + ".sha256")
    if how == "garbage sidecar":
        sidecar.write_bytes(bytes(range(256)))
    else:
        _replace(library, b"\x7fELF garbage")
        sidecar.write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")
    _forget_libraries()
    loads.clear()
    with pytest.warns(UserWarning, match="rebuilding it"):
        assert refine_cpu.compiled()
    assert loads[-1] == (library, sidecar.read_text().strip())
    assert hasattr(refine_cpu._library(), "hsmla_refine_tiles")


@pytest.mark.parametrize("how", ["a file in the way", "no home"])
def test_an_unusable_cache_folder_builds_privately(how, fresh_build, loads, monkeypatch):
    """A cache folder that cannot be made (a file where a folder should be; a HOME that is not a
    folder; no home at all) used to give up the kernels or end in a traceback: they are built
    into a private temporary folder instead, with one warning."""
    if how == "a file in the way":
        (fresh_build / "file").write_text("")
        monkeypatch.setenv("HSMLA_MED_CACHE_DIR", str(fresh_build / "file" / "kernels"))
    else:
        monkeypatch.delenv("HSMLA_MED_CACHE_DIR")
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("Could not determine home directory.")))
    _forget_libraries()
    with pytest.warns(UserWarning, match="cannot be used") as caught:
        assert refine_cpu.compiled() and gate_cpu._library() is not None
    assert len([w for w in caught if "cannot be used" in str(w.message)]) == 1
    assert len(loads) == 2 and not any(path.parent.exists() for path, _ in loads)


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "foreign owner"])
def test_an_untrusted_cache_folder_is_not_loaded_from(how, fresh_build, loads, monkeypatch):
    """A cache folder that others may write to (or that belongs to someone else) is not loaded
    from, even when it holds a library matching its checksum: the kernels are built into a
    private temporary folder, loaded, and that folder is removed; one warning per folder."""
    assert refine_cpu.compiled()
    if how == "foreign owner":
        owner = fresh_build.stat().st_uid
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    else:
        fresh_build.chmod(0o775 if how == "group-writable" else 0o777)
    _forget_libraries()
    loads.clear()
    with pytest.warns(UserWarning, match="not trusted") as caught:
        assert refine_cpu.compiled() and gate_cpu._library() is not None
    assert len([w for w in caught if "not trusted" in str(w.message)]) == 1
    assert len(loads) == 2
    for path, _ in loads:
        assert fresh_build not in path.parents
        assert not path.parent.exists()  # the private folder is gone
    assert hasattr(refine_cpu._library(), "hsmla_refine_tiles")
    fresh_build.chmod(0o700)


@pytest.mark.parametrize("how", ["missing compiler", "failing compiler", "switched off"])
def test_without_the_kernel_the_reference_runs(how, fresh_build, monkeypatch, tmp_path):
    if how == "missing compiler":
        monkeypatch.setenv("CC", "no-such-compiler")
    elif how == "failing compiler":
        monkeypatch.setenv("CC", "false")
    else:
        monkeypatch.setenv("HSMLA_MED_CPU_KERNEL", "0")
    if how == "switched off":
        assert not refine_cpu.compiled()
    else:
        with pytest.warns(UserWarning, match="reference"):
            assert not refine_cpu.compiled()
    maps = _maps((1, 2, 9, 7, 4), "channels_last")
    torch.testing.assert_close(
        refine_cpu.local_refine(*maps, None, 0.0, 4, 3), HF.local_refine(*maps, None, 0.0, 4, 3)
    )
    assert not any(p.suffix in (".so", ".tmp") for p in tmp_path.iterdir())


def test_layer_uses_the_kernel_at_cpu_inference(monkeypatch):
    """``auto`` runs the C kernel in eval mode on the CPU and the reference in training; its
    output equals the reference backend's."""
    layer = HSMLA(2, 32, head_dim=8, window=5, block=4).to(memory_format=torch.channels_last).eval()
    x = torch.randn(2, 32, 13, 18).contiguous(memory_format=torch.channels_last)
    calls = []
    original = refine_cpu.local_refine  # what the CPU implementation of torch.ops.hsmla.local_refine calls
    monkeypatch.setattr(refine_cpu, "local_refine", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        gate = layer.gate(layer._multiscale(layer.qkv(x)))
        layer.tau.fill_(gate.median().item())
        fast = layer(x)
        assert calls and 0.0 < layer.last_alpha < 1.0
        layer.backend = "reference"
        reference = layer(x)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    layer.backend = "auto"
    layer.train()
    calls.clear()
    layer(x).sum().backward()
    assert not calls and layer.gate_weight.grad is not None


@pytest.mark.parametrize("spatial,block,head_dim", [((16, 12), 4, 8), ((8, 8), 2, 4), ((8, 4, 12), 4, 8), ((9, 8), 4, 8)])
def test_block_gate_matches_the_pytorch_gate(spatial, block, head_dim):
    """The C gate equals the layer's PyTorch gate on channels-last maps; maps with partial tiles
    (9 x 8 at block 4) and channel-first maps are left to PyTorch (``None``)."""
    layer = HSMLA(len(spatial), 32, head_dim=head_dim, window=3, block=block).eval()
    for p in (layer.gate_conv.weight, layer.gate_conv.bias, layer.gate_weight, layer.gate_bias):
        torch.nn.init.normal_(p)
    x = torch.randn(2, 32, *spatial)
    with torch.no_grad():
        ms = layer._multiscale(layer.qkv(x)).contiguous(memory_format=_channels_last(len(spatial)))
        layer.backend = "reference"
        expected = layer.gate(ms)
        taps = layer._gate_pool_kernel().flatten(1).t()
        args = (taps, layer.gate_conv.bias, layer.gate_weight, layer.gate_bias, block)
        got = gate_cpu.block_gate(ms, *args)
        assert gate_cpu.block_gate(ms.contiguous(), *args) is None
        layer.backend = "cpu"
        through_layer = layer.gate(ms)
    torch.testing.assert_close(through_layer, expected, rtol=1e-5, atol=1e-6)
    if any(n % block for n in spatial):
        assert got is None
    else:
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _channels_last(spatial_dims):
    return torch.channels_last if spatial_dims == 2 else torch.channels_last_3d


@pytest.mark.parametrize("name", ["gate_cpu", "refine_cpu", "norm_cpu"])
def test_parallel_regions_take_the_team_pytorchs_grain_rule_gives(name):
    """Every kernel's region runs on one thread per 32768 units of work (PyTorch's
    at::internal::GRAIN_SIZE), at most one per item and at most torch's thread count, which the
    kernels' libgomp shares with torch; hand-computed cases."""
    team = _cpu_build.library(name).hsmla_team_size
    team.argtypes, team.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_int
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        for items, work, expected in [(0, 0, 1), (1, 10, 1), (100, 32768, 1), (100, 32769, 2), (100, 3 * 32768, 3),
                                      (100, 10**9, 4), (3, 10**9, 3), (1, 10**9, 1)]:
            assert team(items, work) == expected, (items, work)
        torch.set_num_threads(2)
        assert team(100, 10**9) == 2
    finally:
        torch.set_num_threads(threads)
