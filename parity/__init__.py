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

Importing this package sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless already set) before
anything imports JAX: torch_ref and JAX share the GPU in a sweep, and JAX would otherwise reserve
most of its memory up front.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
