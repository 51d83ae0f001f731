#!/usr/bin/env bash
# One lent-GPU session in one call (issue 26): build decentpy against the machine's CUDA torch, run
# every GPU test, the kernel and overhead benchmarks, and the digits training on the GPU. Each step
# has its own time bound so that one slow step cannot eat the others; logs and CSVs go to $OUT.
#
#   OUT=/tmp/gpu bash tools/gpu_session.sh [steps...]     steps: build tests bench overhead e2e train (default: all)
#
# A build carried from an earlier call (decentpy/_C*.so with decentpy/_build_info.py) is reused
# when REUSE_BUILD=1; KEEP_BUILD=1 copies the build to $OUT for that.
set -u
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY="${PYTHON:-python3}"
STEPS="${*:-build tests bench overhead e2e train}"
STATUS=/tmp/gpu_summary.txt
: > "$STATUS"

step() {  # step NAME SECONDS CMD...: run CMD bounded, append its output to $OUT/steps.log, record its status
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS log="/tmp/gpu_step_$name.log"
  echo "== $(date +%T) $name (bound ${secs}s): $*"
  timeout --kill-after=10 "$secs" "$@" > "$log" 2>&1
  local rc=$?
  { echo "===== $name rc=$rc $((SECONDS - t0))s: $*"; cat "$log"; } >> "$OUT/steps.log"
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$STATUS"
  tail -n "${TAIL:-25}" "$log"
  return $rc
}

want() { [[ " $STEPS " == *" $1 "* ]]; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  nvcc --version | tail -n 2
} 2>&1 | tee -a "$OUT/steps.log"

if want build; then
  if [[ "${REUSE_BUILD:-0}" == 1 ]] && ls decentpy/_C*.so >/dev/null 2>&1; then
    echo "build: reusing the carried decentpy/_C*.so" | tee -a "$STATUS"
  else
    export DECENTPY_CUDA_ARCHS="${DECENTPY_CUDA_ARCHS:-90}" MAX_JOBS="${MAX_JOBS:-16}"
    step build 240 "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . || { tail -n 80 /tmp/gpu_step_build.log; exit 1; }
    [[ "${KEEP_BUILD:-0}" == 1 ]] && cp decentpy/_C*.so decentpy/_build_info.py "$OUT/" 2>/dev/null
  fi
  "$PY" -c "import decentpy._C as C; print(C.build_info())" 2>&1 | tee -a "$OUT/steps.log"
fi

PYTEST=("$PY" -m pytest -q -p no:cacheprovider --timeout 200 -o addopts="-ra")
if want tests; then  # one pytest per file: a crash (segfault) in one does not hide the others
  for f in tests/test_kernels_cuda.py tests/test_nccl_comm.py tests/test_gpu_wrapper.py tests/test_gpu_sharding.py \
           "tests/test_compression.py::test_kernel_cuda_matches_cpu" \
           "tests/test_compression.py::test_group_reduce_cuda_matches_cpu" tests/test_config_report.py; do
    name="tests_$(basename "${f%%::*}" .py)"
    [[ "$f" == *::* ]] && name="${name}_${f##*::}"
    TAIL=6 step "$name" 150 "${PYTEST[@]}" -v "$f"
  done
fi

if want bench; then
  step bench_kernels_cuda 100 "$PY" -m bench.bench_kernels_cuda --runs 20 --out-dir "$OUT"
fi

if want overhead; then
  TAIL=14 step bench_overhead_cuda 90 "$PY" -m bench.bench_overhead_cuda --out-dir "$OUT" --profile
fi

if want e2e; then
  step tests_e2e 200 "${PYTEST[@]}" tests/test_gpu_end_to_end.py tests/test_gpu_pipeline.py
fi

if want train; then
  # `make train` on the GPU: 4 workers sharing the one GPU over gloo; then one worker on NCCL
  step train_4_shared 90 "$PY" -m torch.distributed.run --standalone --nproc_per_node=4 examples/train_digits.py \
    --epochs 3 --compare complete
  step train_1_nccl 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 examples/train_digits.py \
    --epochs 3 --topology complete --compare none --local-world-size 1
fi

echo "== summary"
cat "$STATUS" | tee -a "$OUT/steps.log"
