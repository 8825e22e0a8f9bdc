"""parity: the sweep that holds every implementation to torch_ref (SPEC.md).

Each case feeds identical numpy-seeded inputs to torch_ref and to pallas_paged's ``"xla"`` and
``"pallas"`` implementations, runs a model-runner step (write the new tokens, then decode), and
judges every output: the written caches bit for bit, the decode outputs against a float64 truth
within FlashAttention's tolerance rule, finite where SPEC.md says so, within a few ulps of
torch_ref's own output (the JAX impls) and free of systematic bias.

- `parity.cases`: `Case`, `make_inputs`, `DEFAULT_SUITE`, `FULL_SUITE`.
- `parity.convert`: numpy <-> torch / JAX, bit for bit (the one module importing both).
- `parity.tolerance`: the rules, the per-dtype floors, ulp and bias bounds.
- `parity.compare`: `run_case`, `run_suite`, `case_outputs`, `judge`.
- `parity.report`: the table, progress lines, JSON.
- ``python -m parity``: the CLI (``--help``).

Importing this package, before anything starts JAX, sets two environment variables (unless
already set):

- ``XLA_PYTHON_CLIENT_PREALLOCATE=false``: torch_ref and JAX share the GPU in a sweep, and JAX
  would otherwise reserve most of its memory up front.
- ``NPROC`` to at least `INTERPRET_CPU_THREADS`: the size of the XLA CPU client's thread pools
  (else one thread per CPU). Mosaic GPU's interpret mode runs each warpgroup of a CTA as a JAX
  computation of its own whose barrier waits block inside host callbacks, and XLA may run those
  callbacks on its pools: with fewer pool threads than warpgroups, waiting warpgroups can hold
  every thread while the one they wait for queues behind them, and the call never returns (seen:
  a producer and three consumers on a 2-CPU machine). The kernel has at most five warpgroups.
"""

import os

INTERPRET_CPU_THREADS = 8

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NPROC", str(max(INTERPRET_CPU_THREADS, os.cpu_count() or 1)))
