#!/usr/bin/env bash
# The GPU measurements (hsmla-med bench --only gpu and --only kernels, the GPU checks, the kernel
# tests) in one call of the lent device machine (a bare image with CUDA, PyTorch, Triton,
# Lightning and transformers; no MONAI), at most 8 minutes: installs the wheels
# carried in .whl/ and this checkout, prints the device, commit and versions, then runs the steps
# below, most important first, each under its own time cap so that one hang or slow compile leaves
# the rest measured. The log and a tarball of the results go to $OUT (log.txt, results.tgz of
# bench_out/gpu); the last line names the steps to run again where a step was cut off.
#
#   bash scripts/gpu_session.sh [DEADLINE_SECONDS]             # default 470
#   STEPS="training tests" bash scripts/gpu_session.sh 300     # only the steps named (a rerun)
#
# Steps (estimated time on an H100/H200 host of 16 cores; cap):
#   floor          graph replay (and eager) of HSMLA-B2 routing off, B2 on the dense backend and
#                  SegFormer-B2, 512^2 fp16 batch 1: the floor before any new kernel (~40 s; 75)
#   check          scripts/gpu_check.py: GraphedCallable(B2) vs eager and float64 at 512^2 on
#                  three inputs, no host sync; then the Triton-vs-reference cases (~90 s; 110)
#   inference      HSMLA-B2 vs SegFormer-B2, 512^2 fp16, batches 1 and 16, graph, compiled+graph
#                  and eager (~120 s, mostly torch.compile; 150)
#   kernel_counts  GPU kernels per forward (profiler), eager and compiled, B2 and SegFormer-B2,
#                  beside the census and B2's host syncs (~50 s; 90)
#   3d             HSMLA-B0 3D vs SegResNet and SwinUNETR, 96^3 fp16 (~70 s; 90)
#   training       B2, SegFormer-B2, SwinUNETR-2D, 512^2 batch 8 bf16 AdamW, eager and compiled
#                  (~100 s; 120)
#   bench_kernels  hsmla-med bench --only kernels: linear attention against copy bandwidth, refine_add
#                  at alpha 0.3 against alpha 1, graph replay (~45 s; 60)
#   wsi            wsi-heatmap patches/s against the forward alone on the GPU (HSMLA-B0, the
#                  dense slide of 6400 tissue patches, 8 and 4 reader workers) (~45 s; 90)
#   tests          tests/test_kernels.py, test_graph_ready.py, test_cuda_graph.py natively (~70 s; 100)
#   inference_all  every 2D network (B0/B1/B2, SegFormer-B0/B2, SwinUNETR-2D, UNet), graph and
#                  eager, into bench_out/gpu/all (~60 s; 120)
# The first call reaches about `tests`; rerun the rest with STEPS. Wheels (here, once): pip
# download --no-deps for Python 3.12 of monai, nibabel, pydicom, highdicom, pyjpegls,
# openslide-python and openslide-bin into .whl/ (ignored; README of the device tool). Without CUDA
# every step says so and the script ends at once, with status 0.
set -uo pipefail
cd "$(dirname "$0")/.."
deadline=$(( SECONDS + ${1:-470} ))
OUT=${OUT:-bench_out/gpu_session}
res=bench_out/gpu
mkdir -p "$OUT" "$res"
log="$OUT/log.txt"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if [ -n "${PYTHON:-}" ]; then py=$PYTHON; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
hm=("$py" -m hsmla_med.cli)
gpu=("${hm[@]}" bench --only gpu --warmup 5 --reps 20)
cuda=$($py -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
rerun=()

wanted() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }

skip() {  # skip NAME REASON: a step that does not run here, said in the log
  wanted "$1" || return 0
  echo "### $1: skipped, $2" | tee -a "$log"
}

step() {  # step NAME CAP_SECONDS COMMAND...: runs COMMAND under min(CAP, time left - 15 s)
  local name=$1 cap=$2; shift 2
  wanted "$name" || return 0
  if [ "$cuda" != 1 ]; then skip "$name" "no CUDA GPU on this machine"; return 0; fi
  local left=$(( deadline - SECONDS - 15 ))
  (( left < cap )) && cap=$left
  if (( cap < 10 )); then skip "$name" "out of time"; rerun+=("$name"); return 0; fi
  echo "### $name (cap ${cap}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$log" | grep -vE '^\s*$' | tail -40
  local rc=${PIPESTATUS[0]}
  echo "### $name: rc=$rc in $(( SECONDS - t0 ))s" | tee -a "$log"
  (( rc == 124 || rc == 137 )) && rerun+=("$name")
  tar czf "$OUT/results.tgz" "$res" 2>/dev/null
}

{
  echo "### $(date -u '+%Y-%m-%d %H:%M:%S UTC'), deadline ${1:-470}s"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  else
    echo "device: no nvidia-smi"
  fi
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$( [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && echo ' (uncommitted changes)')"
} | tee -a "$log"
if [ "$cuda" = 1 ] && [ -z "${SKIP_INSTALL:-}" ]; then
  ls .whl/*.whl >/dev/null 2>&1 && $py -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -3
  $py -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
fi
$py - <<'PYEOF' 2>&1 | tee -a "$log"
import importlib
import torch
versions = []
for name in ("torch", "triton", "monai", "transformers", "lightning"):
    try:
        versions.append(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        versions.append(f"{name} missing")
cuda = torch.cuda.is_available()
device = torch.cuda.get_device_name() if cuda else "no CUDA GPU"
print(f"device: {device}; {', '.join(versions)}; CUDA {torch.version.cuda}")
if cuda:
    import hsmla_med.kernels as k
    print("Triton kernels on CUDA:", k.triton_available("cuda"))
PYEOF

# 1. the floor: what a captured forward costs before any new kernel
step floor 75 "${gpu[@]}" --tables floor --modes graph,eager --out "$res"
# 2. correctness: the graph check first, then the Triton path against the reference and float64
step check 110 "$py" scripts/gpu_check.py --out "$res/gpu_check.csv"
# 3. the headline: HSMLA-B2 against SegFormer-B2, graph modes first
step inference 150 "${gpu[@]}" --tables inference --networks HSMLA-B2,SegFormer-B2 --modes graph,compiled,eager --batches 1,16 --out "$res"
# 4. GPU kernels per forward, beside the census and the host syncs
step kernel_counts 90 "${gpu[@]}" --tables kernels --modes eager,compiled --out "$res"
# 5. 3D
step 3d 90 "${gpu[@]}" --tables 3d --modes graph,eager,compiled --out "$res"
# 6. training
step training 120 "${gpu[@]}" --tables training --networks HSMLA-B2,SegFormer-B2,SwinUNETR-2D --modes eager,compiled --out "$res"
# 7. the Triton kernels alone
step bench_kernels 60 "${hm[@]}" bench --only kernels --alphas 0.3 1.0 --out "$res/kernels_2d.csv"
# 8. wsi-heatmap on the GPU against the forward alone
step wsi 90 "${hm[@]}" bench --only wsi --device cuda --out "$res/wsi"
# 9. the kernel tests natively (one process per 2 cores where pytest-xdist is there: Triton's compiles dominate)
parallel=$($py -c "import xdist, os; print('-n', max(1, os.cpu_count() // 2))" 2>/dev/null)
step tests 100 "$py" -m pytest -q -p no:cacheprovider $parallel tests/test_kernels.py tests/test_graph_ready.py tests/test_cuda_graph.py
# 10. every 2D network, graph and eager
step inference_all 120 "${gpu[@]}" --tables inference --modes graph,eager --batches 1,16 --out "$res/all"

echo "### done at ${SECONDS}s${rerun[*]:+; cut off or not reached: STEPS=\"${rerun[*]}\" bash scripts/gpu_session.sh}" | tee -a "$log"
exit 0
