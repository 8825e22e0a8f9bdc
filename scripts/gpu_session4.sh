#!/usr/bin/env bash
# The closing device call on one H200: the benchmark of every shape (tuned table), an fp8 config
# sweep, the GPU test suite, the hardening runs (huge caches, determinism) and the garbage-table
# cases under compute-sanitizer memcheck.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python3 -m pallas_paged.bench --json $OUT/bench.json --plot $OUT/bench.png --jax-configs 4 \
  > $OUT/bench.txt 2>&1; echo "bench rc=$?"; grep -E "pallas |jax_paged|prefill" $OUT/bench.txt | grep -v tune | tail -40
timeout 60 python3 benchmarks/sweep_decode.py --no-write --shapes fp8_b32_ctx4096 > $OUT/fp8.txt 2>&1; grep -E "BEST|copy" $OUT/fp8.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_extensions.py \
  tests/test_write.py tests/test_validate.py tests/test_hardening.py > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
timeout 60 python3 scripts/gpu_hardening.py all --out $OUT > $OUT/hardening.txt 2>&1; grep -E "SUMMARY|FAIL" $OUT/hardening.txt
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 110 compute-sanitizer --tool memcheck --target-processes all \
  python3 scripts/gpu_hardening.py garbage --out $OUT > $OUT/sanitizer.txt 2>&1; echo "sanitizer rc=$?"
grep -E "SUMMARY|ERROR SUMMARY|FAIL" $OUT/sanitizer.txt | tail -5
