"""Every Triton kernel compiled for real GPU targets on a machine without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` runs the whole pipeline
down to a cubin with the ``ptxas`` that ships in the triton wheel; nothing asks a CUDA driver.
Each kernel is compiled in each supported dtype for sm_75 (T4), sm_80 (A100) and sm_90 (H100),
at the layer's default head size (32) and the largest supported one (128), the refinement for
2D and for 3D maps (its constexprs differ: 16 or 64 queries per tile) and without a gate, with the launch
configuration the kernel module picks for that target's shared memory
(``linear.launch_configs``, ``refine.launch_config``: the same functions the launches call).
A test fails when a kernel no longer compiles, uses more shared memory than the target gives
one program, or more than the estimate its module chose the block sizes by. Registers, local
memory (spills) and shared memory are printed (``pytest -s``) as the rows of the table in
docs/benchmarks.md and recorded as junit properties.

The compiled signature is the generic one: 32-bit integer arguments (sizes and strides not
specialised to 1 or multiples of 16) and 16-byte-aligned pointers, as torch allocates them.

The compiles run in child processes (up to 2 at once), without ``TRITON_INTERPRET``: triton
decorates its own ``@jit`` helpers (the reduction combiners the kernels use) for the
interpreter when it is imported with ``TRITON_INTERPRET=1``, as tests/test_kernels.py sets it
on a machine without CUDA, and the compiler cannot call those. Triton's own cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``) is used: its key covers the kernel's source,
signature, constexprs, options, target and the triton and ptxas versions, so a hit is the
artifact of the same compile. Cold, the 90 compiles take minutes on 2 cores
(docs/benchmarks.md); warm, the child processes' imports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from hsmla_med.kernels import _runtime, linear, refine  # noqa: E402
from hsmla_med.nn import functional as HF  # noqa: E402

KiB = 1024
# Shared memory one program may use (cudaDevAttrMaxSharedMemoryPerBlockOptin), per target;
# Triton opts in above the 48 KiB default. sm_86/89 give 99 KiB, between sm_75 and sm_80.
TARGETS = {75: 64 * KiB, 80: 163 * KiB, 90: 227 * KiB}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HEAD_DIMS = [32, 128]  # the layer's default and MAX_HEAD_DIM, the most shared memory
BLOCK, WINDOW = 4, 7  # the layer's default tile and window (hsmla_med.nn.registry.ATTENTION_DEFAULTS)
KERNELS = {
    "_aggregate_kernel": lambda dtype, d, limit: linear.compile_specs(dtype, d, limit)[0],
    "_apply_kernel": lambda dtype, d, limit: linear.compile_specs(dtype, d, limit)[1],
    # as the layer's inference path launches it: a float32 gate and tau read on the device, M * R added
    "_refine_kernel": lambda dtype, d, limit: refine.compile_specs(dtype, d, BLOCK, WINDOW, limit)[0],
    # the same kernel with the constexprs of 3D maps (64 queries and 1000 halo keys per tile)
    "_refine_kernel_3d": lambda dtype, d, limit: refine.compile_specs(dtype, d, BLOCK, WINDOW, limit, spatial_dims=3)[0],
    # without a gate (every tile refined, R added at weight 1): HAS_GATE false, dummy pointers
    "_refine_kernel_no_gate": lambda dtype, d, limit: refine.compile_specs(
        dtype, d, BLOCK, WINDOW, limit, has_gate=False, weighted=False
    )[0],
}
WORKERS = 2


def _cuda_toolchain() -> str:
    """Path of triton's ``cuobjdump`` once its CUDA backend and ``ptxas`` are found, else skip."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip(f"triton {triton.__version__} has no CUDA backend (backends: {sorted(backends)})")
    try:
        triton.knobs.nvidia.ptxas.path
        return triton.knobs.nvidia.cuobjdump.path
    except Exception as error:  # the tools are looked up on first use
        pytest.skip(f"triton's CUDA tools (ptxas, cuobjdump) are unavailable: {error}")


def compile_for(spec: _runtime.KernelSpec, arch: int):
    """``spec`` compiled for ``sm_<arch>``, as a launch on such a GPU would compile it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = spec.kernel.jit_function()
    aligned = [["tt.divisibility", 16]]
    attrs = {(fn.arg_names.index(name),): aligned for name, ty in spec.signature.items() if ty.startswith("*")}
    source = ASTSource(fn, spec.signature, spec.config.constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=spec.config.options)


def resource_usage(cuobjdump: str, cubin: bytes, path: Path) -> dict[str, int]:
    """REG, STACK, SHARED (static), LOCAL of the cubin's one function, as ``cuobjdump`` reads them.

    Triton's own ``n_regs`` and ``n_spills`` come from the driver after loading a kernel, which
    needs a GPU: the registers per thread, and the local memory per thread / 4. Spilled
    registers live in the stack frame (STACK; ``ptxas -v`` reports them as "bytes stack frame,
    N bytes spill stores").
    """
    path.write_bytes(cubin)
    text = subprocess.run(
        [cuobjdump, "--dump-resource-usage", str(path)], check=True, capture_output=True, text=True
    ).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    assert set(found) >= {"REG", "STACK", "SHARED", "LOCAL"}, text
    return {key: int(value) for key, value in found.items()}


def compile_jobs(jobs: list[list], out: Path) -> None:
    """In a child process: compile each ``(name, dtype, arch, head_dim)`` job, write the results."""
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    results = {}
    for name, dtype, arch, head_dim in jobs:
        key = f"{name}-{dtype}-{arch}-{head_dim}"
        spec = KERNELS[name](DTYPES[dtype], head_dim, TARGETS[arch])
        config = spec.config
        result = results[key] = dict(
            kernel=spec.kernel.name,
            config=dict(constexprs=config.constexprs, num_warps=config.num_warps, num_stages=config.num_stages),
            shared_estimate=config.shared_estimate,
        )
        try:
            kernel = compile_for(spec, arch)
        except Exception as error:
            result["error"] = f"{type(error).__name__}: {error}"
            continue
        cubin = kernel.asm.get("cubin")
        result["stages"] = sorted(kernel.asm.keys())
        if cubin:
            usage = resource_usage(cuobjdump, cubin, out.with_suffix(".cubin"))
            result.update(shared_dynamic=kernel.metadata.shared, **usage)
    out.write_text(json.dumps(results))


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """Results of every selected compile test, compiled in ``WORKERS`` child processes."""
    _cuda_toolchain()
    jobs = [
        [item.callspec.params[k] for k in ("name", "dtype", "arch", "head_dim")]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_kernel_compiles_within_shared_memory"
    ]
    folder = tmp_path_factory.mktemp("triton_compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    children = []
    for i in range(WORKERS):
        chunk = jobs[i::WORKERS]
        if chunk:
            out = folder / f"worker{i}.json"
            cmd = [sys.executable, __file__, json.dumps(chunk), str(out)]
            children.append((out, subprocess.Popen(cmd, env=env, cwd=root, stderr=subprocess.PIPE, text=True)))
    results = {}
    for out, child in children:
        _, stderr = child.communicate()
        assert child.returncode == 0 and out.exists(), f"compile worker failed:\n{stderr[-4000:]}"
        results.update(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("arch", list(TARGETS), ids=lambda a: f"sm{a}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_compiles_within_shared_memory(name, dtype, arch, head_dim, compiled, record_property):
    limit = TARGETS[arch]
    result = compiled[f"{name}-{dtype}-{arch}-{head_dim}"]
    assert name.removesuffix("_3d").removesuffix("_no_gate") == result["kernel"]
    assert "error" not in result, f"{name} {dtype} d={head_dim} does not compile for sm_{arch}: {result['error']}"
    assert "REG" in result, f"{name}: no cubin for sm_{arch} (stages: {result['stages']})"
    shared = result["shared_dynamic"] + result["SHARED"]  # Triton's allocation + static
    local = result["STACK"] + result["LOCAL"]  # bytes per thread, spills included
    estimate = result["shared_estimate"]
    config = result["config"]
    blocks = " ".join(f"{k}={v}" for k, v in config["constexprs"].items() if k.startswith("BLOCK_"))
    launch = f"{blocks} w{config['num_warps']} s{config['num_stages']}"
    for key, value in dict(
        registers=result["REG"], local_bytes=local, shared=shared, shared_estimate=estimate, shared_limit=limit,
        config=launch,
    ).items():
        record_property(key, value)
    print(
        f"\n| {name} | {dtype} | sm_{arch} | {head_dim} | {launch} | {result['REG']} | {local} | "
        f"{shared / KiB:.1f} | {estimate / KiB:.1f} | {limit // KiB} |"
    )
    assert shared <= limit, (
        f"{name} {dtype} d={head_dim} needs {shared} B of shared memory, sm_{arch} gives {limit} B per program"
    )
    assert shared <= estimate, (
        f"{name} {dtype} d={head_dim} on sm_{arch}: Triton allocates {shared} B of shared memory, more than the "
        f"{estimate} B its module estimated when choosing {launch}"
    )


# -- the configurations picked for little shared memory compute the same -----------------------


@pytest.fixture
def small_shared_memory(monkeypatch):
    """Launches pick their configurations for 48 KiB, the limit without opt-in (split ``Z`` columns, fewer keys
    and tokens per step, one stage); without CUDA the interpreter runs them."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    for module in (linear, refine):
        monkeypatch.setattr(module, "shared_memory_limit", lambda device: 48 * KiB)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_small_shared_memory_configs_are_smaller():
    aggregate, apply = linear.launch_configs(torch.float32, 128, 48 * KiB)
    assert aggregate.constexprs["BLOCK_N"] < linear.BLOCK_N and aggregate.num_stages == 1
    assert apply.constexprs["BLOCK_E"] < apply.constexprs["BLOCK_D"]
    config = refine.launch_config(torch.float32, 128, BLOCK, WINDOW, 48 * KiB)
    assert config.constexprs["BLOCK_K"] < refine.MAX_BLOCK_K and config.num_stages == 1
    volume = refine.launch_config(torch.float32, 128, BLOCK, WINDOW, 48 * KiB, spatial_dims=3)
    assert volume.constexprs["BLOCK_Q"] < BLOCK**3  # a 3D tile's queries over several programs
    assert all(c.shared_estimate <= 48 * KiB for c in (aggregate, apply, config, volume))


@pytest.mark.parametrize("shape", [(1, 2, 9, 13, 128), (2, 1, 5, 7, 80)], ids=str)
def test_linear_attention_with_small_shared_memory(shape, small_shared_memory):
    qh, kh, vh = (torch.randn(shape, device=small_shared_memory) for _ in range(3))
    out = linear.linear_attention(qh, kh, vh)
    ref = HF.linear_attention(qh, kh, vh)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("shape", [(1, 2, 9, 11, 128), (1, 1, 5, 6, 7, 128)], ids=str)
def test_local_refine_with_small_shared_memory(shape, small_shared_memory):
    tensors = [torch.randn(shape, device=small_shared_memory) for _ in range(6)]
    gate = torch.rand(1, *HF.tile_grid(shape[2:-1], BLOCK), device=small_shared_memory)
    out = refine.local_refine(*tensors, gate, 0.3, BLOCK, WINDOW)
    ref = HF.local_refine(*tensors, gate, 0.3, BLOCK, WINDOW)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


if __name__ == "__main__":  # a compile worker started by the ``compiled`` fixture
    compile_jobs(json.loads(sys.argv[1]), Path(sys.argv[2]))
