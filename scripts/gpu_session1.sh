#!/usr/bin/env bash
# One device call: environment, the GPU test suite with the compiled kernel, a config sweep.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee $OUT/env.txt
python3 -c "import jax, jaxlib, torch, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'torch', torch.__version__, 'triton', triton.__version__, jax.devices())" 2>&1 | tee -a $OUT/env.txt
timeout 300 python3 -m pytest -x -q tests/test_decode.py tests/test_write.py tests/test_validate.py -p no:cacheprovider 2>&1 | tee $OUT/tests.txt | tail -25
timeout 240 python3 benchmarks/sweep_decode.py --quick --json $OUT/sweep.json 2>&1 | tee $OUT/sweep.txt
