"""What Mosaic GPU's interpret mode (``plgpu.kernel(..., interpret=plgpu.InterpretGPUParams())``)
does not run, each as the smallest kernel that shows it; the compiled kernel on an sm_90 GPU takes
the same code. Each case prints ``runs`` and whether its output is the expected one, or the
exception it raised.

    python -m benchmarks.mosaic_interpret_limits            # interpret mode, any machine
    python -m benchmarks.mosaic_interpret_limits --compiled # the same kernels on a GPU

- ``global_semaphore``: two CTAs, the first signals a global semaphore (`pl.get_global`) that
  the second waits on: what a merge in the decode kernel's last CTA per (sequence, kv head)
  needs. jax 0.12.0.1: ``TypeError: No ir_type_handler for aval type: AbstractRef``.
- ``griddepcontrol``: `plgpu.griddepcontrol_launch_dependents` / `griddepcontrol_wait` (the
  merge kernel launched early, `mosaic_gpu.launches_early`). jax 0.12.0.1:
  ``NotImplementedError: MLIR translation rule for primitive 'griddepcontrol_launch_dependents'
  not found for platform cpu``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def global_semaphore(plgpu, interpret):
    def body(x_ref, o_ref):  # x, o: f32[2, 128], one row per CTA
        cta = jax.lax.axis_index("cta")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)

        @pl.when(cta == 0)
        def _():
            o_ref[0] = x_ref[0]
            pl.semaphore_signal(sem)

        @pl.when(cta == 1)
        def _():
            pl.semaphore_wait(sem)
            o_ref[1] = x_ref[1] + 1.0

    x = jnp.zeros((2, 128), jnp.float32)
    out = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                       grid_names=("cta",), interpret=interpret)(x)
    return out, x + jnp.array([[0.0], [1.0]])


def griddepcontrol(plgpu, interpret):
    def body(x_ref, o_ref):  # x, o: f32[128]
        plgpu.griddepcontrol_launch_dependents()
        plgpu.griddepcontrol_wait()
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.zeros((128,), jnp.float32)
    out = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       interpret=interpret)(x)
    return out, x + 1.0


# name -> case(plgpu, interpret) -> (the kernel's output, the expected one)
CASES = {"global_semaphore": global_semaphore, "griddepcontrol": griddepcontrol}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compiled", action="store_true", help="compiled (needs an sm_90 GPU)")
    args = parser.parse_args(argv)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    interpret = None if args.compiled else plgpu.InterpretGPUParams()
    print(f"jax {jax.__version__}, {'compiled' if args.compiled else 'interpret mode'}")
    for name, case in CASES.items():
        try:
            out, expected = jax.block_until_ready(case(plgpu, interpret))
            print(f"{name}: runs, output {'right' if bool(jnp.all(out == expected)) else 'WRONG'}")
        except Exception as e:  # noqa: BLE001 - the point is to print what each case raises
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
