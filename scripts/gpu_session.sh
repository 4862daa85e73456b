#!/usr/bin/env bash
# Issue 32's GPU work in one call of the lent device machine (a bare image with CUDA, PyTorch,
# Triton, Lightning and transformers; no MONAI): installs the wheels carried in .whl/ and this
# checkout, then runs the checks in order of importance, each under its own time cap so that one
# hang leaves the rest measured. Logs and CSVs go to $OUT (log.txt, results.tgz).
#
#   bash scripts/gpu_session.sh [DEADLINE_SECONDS]    # on the device machine, from the checkout
#   STEPS="bench_gpu train_bf16" bash scripts/gpu_session.sh   # only the steps named
#
# Wheels (here, once): pip download --no-deps for Python 3.12 of monai, nibabel, pydicom,
# highdicom, pyjpegls, openslide-python and openslide-bin into .whl/ (ignored; README of the
# device tool). Without CUDA every step says so and the script still ends.
set -uo pipefail
cd "$(dirname "$0")/.."
deadline=$(( SECONDS + ${1:-520} ))
OUT=${OUT:-bench_out/gpu_session}
mkdir -p "$OUT" bench_out/gpu
log="$OUT/log.txt"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
py=${PYTHON:-python3}

step() {  # step NAME CAP_SECONDS COMMAND...: runs COMMAND under min(CAP, time left - 15 s)
  local name=$1 cap=$2; shift 2
  [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $name "* ]] || return 0
  local left=$(( deadline - SECONDS - 15 ))
  (( left < cap )) && cap=$left
  if (( cap < 10 )); then echo "### $name: skipped, out of time" | tee -a "$log"; return; fi
  echo "### $name (cap ${cap}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$log" | grep -vE '^\s*$' | tail -40
  echo "### $name: rc=${PIPESTATUS[0]} in $(( SECONDS - t0 ))s" | tee -a "$log"
  tar czf "$OUT/results.tgz" bench_out/gpu 2>/dev/null
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv; git log -1 --format='commit %H' 2>/dev/null; } | tee -a "$log"
if [ -z "${SKIP_INSTALL:-}" ]; then
  ls .whl/*.whl >/dev/null 2>&1 && $py -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -3
  $py -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
fi
hm=$(dirname "$(command -v "$py")")/hsmla-med
$py -c "import torch, triton, monai, hsmla_med.kernels as k; print('torch', torch.__version__, 'triton', triton.__version__, 'monai', monai.__version__, 'cuda', torch.cuda.is_available(), 'triton backend', k.triton_available('cuda'))" 2>&1 | tee -a "$log"

# in order of importance, so that a cut-off run has measured what matters most
# 1. whole networks, Triton path against the reference and float64
step gpu_check 90 $py scripts/gpu_check.py --out bench_out/gpu/gpu_check.csv
# 3. the headline tables: HSMLA-B2 vs SegFormer-B2 at 512^2 fp16, 3D, bf16 training
step bench_gpu 150 "$hm" bench --only gpu --warmup 5 --reps 20 --out bench_out/gpu
# 1. the kernel tests natively (float32/float16/bfloat16, 2D and 3D)
# (one process per 2 cores where pytest-xdist is there: the Triton compiles dominate)
parallel=$($py -c "import xdist, os; print('-n', max(1, os.cpu_count() // 2))" 2>/dev/null)
step test_kernels 100 $py -m pytest -q -x -p no:cacheprovider $parallel tests/test_kernels.py
# 2. training in bf16 with validation, then infer on CUDA: precision auto against float32
run=bench_out/gpu/btcv_run
step train_bf16 110 "$hm" train --task btcv --accelerator gpu --precision bf16-mixed --max-steps 150 --output "$run"
ts=$(ls -d ~/.cache/hsmla-med/btcv-synthetic/imagesTs 2>/dev/null)
if [ -f "$run/best.ckpt" ] && [ -n "$ts" ]; then
  step infer_auto 40 "$hm" infer --task btcv --checkpoint "$run/best.ckpt" --input "$ts" --output bench_out/gpu/pred_auto --device cuda --precision auto
  step infer_fp32 40 "$hm" infer --task btcv --checkpoint "$run/best.ckpt" --input "$ts" --output bench_out/gpu/pred_fp32 --device cuda --precision 32-true
  step label_agreement 20 $py - <<'PYEOF'
import pathlib, nibabel as nib, numpy as np
a, b = pathlib.Path("bench_out/gpu/pred_auto"), pathlib.Path("bench_out/gpu/pred_fp32")
same = total = 0
for f in sorted(a.glob("*.nii.gz")):
    x, y = np.asarray(nib.load(f).dataobj), np.asarray(nib.load(b / f.name).dataobj)
    same += int((x == y).sum()); total += x.size
    print(f.name, f"agree {(x == y).mean():.6f}")
print(f"labels agree in {same / max(total, 1):.6%} of {total} voxels (auto vs 32-true)")
PYEOF
fi
# 4. exported graphs on CUDA: TorchScript in float16, ONNX under onnxruntime's CUDA provider
ckpt=(); [ -f "$run/best.ckpt" ] && ckpt=(--checkpoint "$run/best.ckpt")
step export_cuda 50 $py scripts/gpu_export_check.py "${ckpt[@]}" --out bench_out/gpu/export_cuda.csv
# kernel tables, 2D then 3D
step bench_kernels_2d 60 $py scripts/bench_kernels.py --out bench_out/gpu/kernels_2d.csv
step bench_kernels_3d 50 $py scripts/bench_kernels.py --spatial-dims 3 --out bench_out/gpu/kernels_3d.csv
# the CUDA-only tests of the suite
step cuda_tests 60 $py -m pytest -q -p no:cacheprovider tests/test_prediction.py tests/test_wsi_features.py tests/test_camelyon16.py -k cuda
echo "### done at ${SECONDS}s"
