#!/usr/bin/env bash
# The GPU run, on a machine where torch and JAX see a CUDA GPU (python3 has both installed):
#   1. env:    nvidia-smi and the versions of python, jax, jaxlib, torch, triton
#   2. tests:  every test in tests/ with the compiled kernels, `gpu`-marked ones included
#   3. parity: python -m parity --device cuda --full --impl xla --impl pallas --impl mosaic
#   4. decode: python -m benchmarks.decode (every decode shape, every implementation)
#   5. ragged: python -m benchmarks.ragged (the ragged shapes against the matmul rate and the copy)
#   6. write:  python -m benchmarks.write (the cache write, bf16 and fp8, checked against torch)
#   7. e2e:    python -m examples.generate --bench (tokens/s: pallas, xla, transformers)
# Each step's log goes to <dir>/<step>.txt; <dir> is the first argument, else $OUT, else
# ./gpu-run-<UTC time>. The exit status is 1 when any step failed (a WRONG benchmark row counts).
#
#   bash benchmarks/gpu_run.sh [DIR]
#   STEPS="tests parity" bash benchmarks/gpu_run.sh    # a subset; timeouts: TESTS_TIMEOUT etc.
#   TESTS="tests/test_ragged.py" PARITY_ARGS="-k ragged" DECODE_ARGS="--shapes b1_ctx32768" ...
#   TEST_SHARDS=4 PARITY_SHARDS=6 ...  # tests and parity in that many processes at once (the
#                                      # tests dealt round-robin; both --shard i/N): the
#                                      # machine's cores compile in parallel; logs <step>-<i>.txt,
#                                      # each test's time in tests-<i>.xml
#   ARCHIVE=logs.tar.gz ...            # at the end, pack every file of <dir> into that one file
# The GPU tests and the full parity suite take minutes per shard: run the two steps in separate
# calls where a call is limited in time. On a 16-core H100 host, 16 test shards ran the files
# before tests/test_fused.py in under 520 s, and the files from tests/test_fused.py on (1277
# tests) in 330 s: split the suite by files (TESTS) across two calls there. A step past its
# timeout gets SIGINT (pytest still prints its summary: the failures so far), then SIGKILL 30 s
# later. The tests marked `huge` (caches of GBs) all run in test shard 0, one after the other.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-run-$(date -u +%Y%m%dT%H%M%SZ)}}"
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"
STEPS="${STEPS:-env tests parity decode ragged write e2e}"
TESTS="${TESTS:-tests}"
# The full suite for all three implementations (mosaic on the cases its kernel takes; the
# others still run every case). Set but empty: the default suite, xla and pallas.
PARITY_ARGS="${PARITY_ARGS---full --impl xla --impl pallas --impl mosaic}"
status=0

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name: $*" | tee "$out/$name.txt"
  timeout -s INT -k 30 "$limit" "$@" >> "$out/$name.txt" 2>&1
  rc=$?
  tail -n 6 "$out/$name.txt"
  echo "=== $name: exit $rc after $((SECONDS - start)) s (log $out/$name.txt)"
  [ "$rc" -eq 0 ] || status=1
}

step env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv &&
  $PY -c 'import sys, jax, jaxlib, torch, triton; print(\"python\", sys.version.split()[0],
  \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"torch\", torch.__version__,
  \"triton\", triton.__version__, jax.devices(), torch.cuda.get_device_name(0))'"
shards() {  # shards NAME TIMEOUT_S COUNT COMMAND_OF_SHARD: COUNT processes at once, one step
  local name=$1 limit=$2 count=$3 make=$4 start=$SECONDS rc i pids=()
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name: $count processes" | tee "$out/$name.txt"
  for ((i = 0; i < count; i++)); do
    local cmd
    cmd=$($make "$i" "$count" | tr '\n' ' ')
    # shellcheck disable=SC2086  # the shard's command splits into words on purpose
    { echo "=== $name-$i: $cmd"; timeout -s INT -k 30 "$limit" $cmd; } > "$out/$name-$i.txt" 2>&1 &
    pids+=($!)
  done
  rc=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "--- $name-$i: $(tail -n 1 "$out/$name-$i.txt")" | tee -a "$out/$name.txt"
  done
  echo "=== $name: exit $rc after $((SECONDS - start)) s (logs $out/$name-*.txt)"
  [ "$rc" -eq 0 ] || status=1
}
test_shard() {  # the pytest command of shard $1 of $2: every $2-th selected test (--shard)
  echo "$PY -m pytest -q -p no:cacheprovider -o addopts=-ra --shard $1/$2" \
    "--durations=15 --junitxml=$out/tests-$1.xml" $TESTS
}
parity_shard() {  # the parity command of shard $1 of $2, its BLAS threads its share of the cores
  local threads=$(( $(nproc) / $2 ))
  [ "$threads" -ge 1 ] || threads=1
  echo "env OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads" \
    "$PY -m parity --device cuda $PARITY_ARGS --shard $1/$2 --json $out/parity-$1.json"
}

# shellcheck disable=SC2086  # the *_ARGS and TESTS lists split into words on purpose
if [ "${TEST_SHARDS:-1}" -gt 1 ]; then
  shards tests "${TESTS_TIMEOUT:-1800}" "$TEST_SHARDS" test_shard
else
  step tests "${TESTS_TIMEOUT:-1800}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" $TESTS
fi
if [ "${PARITY_SHARDS:-1}" -gt 1 ]; then
  shards parity "${PARITY_TIMEOUT:-1800}" "$PARITY_SHARDS" parity_shard
else
  step parity "${PARITY_TIMEOUT:-1800}" "$PY" -m parity --device cuda $PARITY_ARGS \
    --json "$out/parity.json"
fi
step decode "${DECODE_TIMEOUT:-1800}" "$PY" -m benchmarks.decode --json "$out/decode.json" \
  ${DECODE_ARGS:-}
step ragged "${RAGGED_TIMEOUT:-1800}" "$PY" -m benchmarks.ragged --json "$out/ragged.json" \
  ${RAGGED_ARGS:-}
step write "${WRITE_TIMEOUT:-1800}" "$PY" -m benchmarks.write --json "$out/write.json" \
  ${WRITE_ARGS:-}
step e2e "${E2E_TIMEOUT:-1800}" env HF_HUB_OFFLINE=1 "$PY" -m examples.generate --bench \
  ${E2E_ARGS:-}
# shellcheck disable=SC2086  # the log names (letters, digits, '-', '.') split into words
if [ -n "${ARCHIVE:-}" ]; then  # one file instead of many (for transfers that limit the count)
  (cd "$out" && files=$(ls -A | grep -vxF "$ARCHIVE") && tar czf "$ARCHIVE" $files && rm -rf $files)
  echo "=== logs packed into $out/$ARCHIVE"
fi
exit $status
