#!/usr/bin/env bash
# One call on a two-GPU machine: GPU tests (compiled kernels, two-GPU sharding), the two-GPU
# scaling benchmark, write-kernel variants, and a config sweep of the shapes below target.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L | tee $OUT/env.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_extensions.py \
  tests/test_write.py tests/test_sharding.py -k "not subprocess" 2>&1 | tee $OUT/tests.txt | tail -4
timeout 120 python3 -m pallas_paged.bench_sharded --json $OUT/sharded.json 2>&1 | tee $OUT/sharded.txt | tail -14
timeout 50 python3 benchmarks/sweep_decode.py --write-only 2>&1 | tee $OUT/write.txt
timeout 200 python3 -m pallas_paged.bench --tune --impls pallas --max-configs 10 --json $OUT/tune.json \
  --shapes fp8_b32_ctx4096,d256_b32_ctx4096,ragged_b64_ctx8192,mha_b32_ctx4096,b1_ctx32768 2>&1 \
  | tee $OUT/tune.txt | grep -E "BEST|best|TUNED|^ *\(|^}" | tail -40
