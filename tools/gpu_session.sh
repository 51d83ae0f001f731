#!/usr/bin/env bash
# One lent-GPU session in one call (issue 26): build decentpy against the machine's CUDA torch, run
# every GPU test, the kernel and overhead benchmarks, and the digits training on the GPU. Each step
# has its own time bound so that one slow step cannot eat the others; logs and CSVs go to $OUT.
#
#   OUT=/tmp/gpu BUDGET=560 bash tools/gpu_session.sh [steps...]
#       steps: build kernels overhead bench tests nccl e2e train lm ncu pipe toolchain (default: all;
#       they run in this order, the most wanted first, so that a budget cut drops the least)
#   E2E_K / KERNELS_K: pytest -k expressions for the e2e and CUDA-kernel steps (default: every test)
#
# BUDGET (seconds, default 560) bounds the whole script: each step's bound is cut to what is left
# (less 10 s for the summary), and a step with under 20 s left is skipped, so that the summary and
# the logs always come back inside one device call. A build carried from an earlier call
# (decentpy/_C*.so with decentpy/_build_info.py) is reused when REUSE_BUILD=1; KEEP_BUILD=1 copies
# the build to $OUT for that.
set -u
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY="${PYTHON:-python3}"
STEPS="${*:-build kernels overhead bench tests nccl e2e train lm ncu pipe toolchain}"
BUDGET="${BUDGET:-560}"
STATUS=/tmp/gpu_summary.txt
: > "$STATUS"

step() {  # step NAME SECONDS CMD...: run CMD bounded, append its output to $OUT/steps.log, record its status
  local name=$1 secs=$2; shift 2
  local left=$((BUDGET - SECONDS - 10))
  if (( left < 20 )); then
    echo "$name skipped: ${left}s of the budget left" | tee -a "$STATUS"
    return 124
  fi
  (( secs > left )) && secs=$left
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
    # -v: the compile and link commands go to the log (a toolchain surprise shows there)
    TAIL=8 step build 240 "$PY" -m pip install -v --no-index --no-deps --no-build-isolation -e . || { tail -n 80 /tmp/gpu_step_build.log; exit 1; }
    [[ "${KEEP_BUILD:-0}" == 1 ]] && cp decentpy/_C*.so decentpy/_build_info.py "$OUT/" 2>/dev/null
  fi
  {
    "$PY" -c "import decentpy._C as C; print(C.build_info())"
    echo "CXX=${CXX:-(unset)}: $("${CXX:-c++}" -print-file-name=libstdc++.so)"
    grep "^decentpy: C++ compiler" /tmp/gpu_step_build.log | head -n 1
    grep -o -- "-shared .*_C[^ ]*\.so" /tmp/gpu_step_build.log | tail -n 1 | cut -c1-1500
  } 2>&1 | tee -a "$OUT/steps.log"
fi

PYTEST=("$PY" -m pytest -q -p no:cacheprovider --timeout 200 -o addopts="-ra")

# The kernels first: a kernel change is checked against its CPU twin before it is timed.
if want kernels; then
  TAIL=6 step tests_test_kernels_cuda 120 "${PYTEST[@]}" -n 8 tests/test_kernels_cuda.py ${KERNELS_K:+-k "$KERNELS_K"}
  TAIL=12 step tests_gpu 150 "${PYTEST[@]}" -v tests/test_gpu_wrapper.py tests/test_gpu_sharding.py \
    "tests/test_compression.py::test_kernel_cuda_matches_cpu" "tests/test_compression.py::test_group_reduce_cuda_matches_cpu" \
    tests/test_outer_step.py tests/test_sparse_outer.py
fi

if want overhead; then
  # Unprofiled runs only (a profiled run's figures are not the iteration's): twice, for the spread.
  for r in 1 2; do
    mkdir -p "$OUT/overhead$r"
    TAIL=16 step "bench_overhead_cuda_$r" 75 "$PY" -m bench.bench_overhead_cuda --out-dir "$OUT/overhead$r" $([[ $r == 1 ]] && echo --ablations)
  done
fi

if want bench; then
  step bench_kernels_cuda 100 "$PY" -m bench.bench_kernels_cuda --runs 20 --out-dir "$OUT"
  step bench_outer_step 60 "$PY" -m bench.bench_outer_step --device cuda --repeats 20 --out "$OUT"
fi

if want tests; then
  # Issue 40 on the image's own CXX: the configuration report, the crash tests (refusals with
  # integers in their message), the toolchain tests (a static-libstdc++ driver), the kernels' CPU tests.
  TAIL=12 step tests_build 120 "${PYTEST[@]}" -n 8 tests/test_config_report.py tests/test_build_env.py \
    tests/test_kernels_cpu.py
fi

if want nccl; then
  # Under xdist: a crash (segfault) fails its test and the worker is replaced, so the others still run.
  TAIL=12 step tests_test_nccl_comm 90 "${PYTEST[@]}" -v -n 2 tests/test_nccl_comm.py
fi

if want e2e; then
  TAIL=14 step tests_e2e 200 "${PYTEST[@]}" -rA ${E2E_K:+-k "$E2E_K"} tests/test_gpu_end_to_end.py tests/test_gpu_pipeline.py
fi

if want train; then
  # `make train` on the GPU: 4 workers sharing the one GPU over gloo; then one worker on NCCL
  step train_4_shared 80 "$PY" -m torch.distributed.run --standalone --nproc_per_node=4 examples/train_digits.py \
    --epochs 3 --compare complete
  step train_1_nccl 50 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 examples/train_digits.py \
    --epochs 3 --topology complete --compare none --local-world-size 1
fi

if want lm; then
  # examples/train_lm.py on the GPU: 4 workers sharing it over gloo, then one process on NCCL
  step lm_4_shared 100 "$PY" -m torch.distributed.run --standalone --nproc_per_node=4 examples/train_lm.py \
    --device cuda --tokens 1000000 --evals 4 --topology alternating-exp-ring --compression int8
  step lm_1_nccl 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 examples/train_lm.py \
    --device cuda --backend nccl --tokens 1000000 --evals 4 --local-world-size 1
  # local steps on the GPU: the int8 gossip outer step (compressed_mix over the CUDA outer kernels)
  # and Streaming DiLoCo's fragments
  step lm_4_local_steps 100 "$PY" -m torch.distributed.run --standalone --nproc_per_node=4 examples/train_lm.py \
    --device cuda --tokens 1000000 --evals 4 --topology alternating-exp-ring --compression int8 --local-steps 32
  step lm_4_streaming 100 "$PY" -m torch.distributed.run --standalone --nproc_per_node=4 examples/train_lm.py \
    --device cuda --tokens 1000000 --evals 4 --topology complete --local-steps 32 --fragments 4 \
    --fragment-sync-delay 2 --fragment-update-alpha 0.5
fi

if want ncu; then
  # Hardware counters of one AccumAdamW@boundary bf16 launch (the kernel row under 85% of the copy):
  # what holds it back, for the next change. Not a timing: ncu replays the kernel.
  TAIL=60 step ncu_boundary 75 ncu --clock-control none --kernel-name regex:mix_step_kernel --launch-skip 4 \
    --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section LaunchStats "$PY" -m bench.bench_kernels_cuda --sizes-mib 25 \
    --dtypes bf16 --kernels AccumAdamW@boundary --runs 20 --warmup 2 --out-dir /tmp/ncu_bench
fi

if want pipe; then
  # If time is left: the AsyncPipe 4-stage rows on this machine's 16 CPU cores (no GPU involved).
  step bench_pipe_4 90 "$PY" -m bench.bench_pipe --stages 4 --chunks 1,4,8 --rounds 4 --no-memory \
    --no-plot --out "$OUT/pipe"
fi

if want toolchain; then
  # Its slow test rebuilds with a static-libstdc++ driver as CXX (a relink when the same compiler is
  # chosen as for the build above; the first GPU run of it did not finish in 150 s: see its log)
  TAIL=12 step tests_toolchain 150 "${PYTEST[@]}" -v tests/test_build_toolchain.py
fi

echo "== summary"
cat "$STATUS" | tee -a "$OUT/steps.log"
