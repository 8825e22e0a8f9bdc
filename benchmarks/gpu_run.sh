#!/usr/bin/env bash
# The GPU run, on a machine where torch and JAX see a CUDA GPU (python3 has both installed):
#   1. env:    nvidia-smi and the versions of python, jax, jaxlib, torch, triton
#   2. tests:  every test in tests/ with the compiled kernels, `gpu`-marked ones included
#   3. parity: python -m parity --device cuda --full
#   4. bench:  python -m benchmarks.bench (every shape, tuned table), JSON and plot
# Each step's log goes to <dir>/<step>.txt; <dir> is the first argument, else $OUT, else
# ./gpu-run-<UTC time>. The exit status is 1 when any step failed (a WRONG benchmark row counts).
#
#   bash benchmarks/gpu_run.sh [DIR]
#   STEPS="tests parity" bash benchmarks/gpu_run.sh    # a subset; timeouts: TESTS_TIMEOUT etc.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-run-$(date -u +%Y%m%dT%H%M%SZ)}}"
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"
STEPS="${STEPS:-env tests parity bench}"
status=0

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name: $*" | tee "$out/$name.txt"
  timeout "$limit" "$@" >> "$out/$name.txt" 2>&1
  rc=$?
  tail -n 6 "$out/$name.txt"
  echo "=== $name: exit $rc after $((SECONDS - start)) s (log $out/$name.txt)"
  [ "$rc" -eq 0 ] || status=1
}

step env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv &&
  $PY -c 'import sys, jax, jaxlib, torch, triton; print(\"python\", sys.version.split()[0],
  \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"torch\", torch.__version__,
  \"triton\", triton.__version__, jax.devices(), torch.cuda.get_device_name(0))'"
step tests "${TESTS_TIMEOUT:-1800}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests
step parity "${PARITY_TIMEOUT:-1800}" "$PY" -m parity --device cuda --full --json "$out/parity.json"
step bench "${BENCH_TIMEOUT:-1800}" "$PY" -m benchmarks.bench --json "$out/bench.json" \
  --plot "$out/bench.png"
exit $status
