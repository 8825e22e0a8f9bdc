"""The decode Triton kernel's machine code for a named shape, without a GPU: what a config
compiles to (registers, shared memory, instructions by opcode) before a GPU run times it.

    python -m benchmarks.triton_sass --shape fp8_b32_ctx4096 [--config bk32/s4/w2/st2/vl1]
        [--out DIR] [--top 25]

The kernel is lowered as `pallas_paged.decode` lowers it for CUDA (an abstract H100-class GPU,
as the CPU tests lower it), its Triton IR is taken from that lowering, and the Triton compiler of
the ``triton`` package (``pip install triton==3.6.0``, the version on the H200 machine; not a
dependency of the project) compiles it for sm_90; its ``cuobjdump`` gives registers and SASS. On
the H200 XLA compiles the same IR with its own build of Triton, so the counts here are a
prediction to check with Nsight Compute there (for the fp8 kernel of 2026-12-01 they agreed: 254
registers here, 255 there, one ``LDS.U8`` per V byte in both).

``--config``: parts of `benchmarks.bench.config_label`'s form (``bk<int>/s<int>/w<int>/st<int>``,
``vl1`` for `DecodeConfig.fp8_v_at_load`), any subset, over the config ``decode`` picks for the
shape on an NVIDIA H200. ``--out``: keep ``kernel.ttir``, ``.ttgir``, ``.ptx``, ``.cubin`` and
``.sass`` there.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

import pallas_paged as pp
from benchmarks.bench import abstract_args, parse_config_label
from benchmarks.shapes import shape_by_name
from pallas_paged.decode_attention import configs
from pallas_paged.decode_attention.api import decode_shape

CONFIG_PARTS = {"bk": "block_k", "s": "num_splits", "w": "num_warps", "st": "num_stages",
                "vl": "fp8_v_at_load"}
TARGET_DEVICE = ("NVIDIA H200", 132)  # the device kind and SM count whose config is the base
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)")


def parse_config(label: str) -> dict:
    """``"bk32/w2/vl1"`` -> ``{"block_k": 32, "num_warps": 2, "fp8_v_at_load": True}``."""
    values = parse_config_label(label, CONFIG_PARTS)
    if "fp8_v_at_load" in values:
        if values["fp8_v_at_load"] not in (0, 1):
            raise ValueError(f"config {label!r}: vl takes 0 or 1")
        values["fp8_v_at_load"] = bool(values["fp8_v_at_load"])
    return values


def kernel_config(shape_name: str, overrides: dict) -> pp.DecodeConfig:
    """The config ``decode`` picks for the shape on `TARGET_DEVICE`, with ``overrides``."""
    shape = shape_by_name(shape_name)
    q, cache, tables = abstract_args(shape)
    return dataclasses.replace(configs.lookup(decode_shape(q, cache, tables), *TARGET_DEVICE),
                               **overrides)


def triton_ir(shape_name: str, config: pp.DecodeConfig) -> str:
    """The Triton IR (text) of the decode kernel that ``decode(..., impl="pallas")`` lowers to
    for the named shape and ``config``, lowered for CUDA without a GPU."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    shape = shape_by_name(shape_name)
    q, one_block, tables = abstract_args(shape)
    # As many blocks as the tables can name: with one, the clamped block ids would be constants.
    cache = jax.ShapeDtypeStruct((shape.batch * shape.max_blocks,) + one_block.shape[1:],
                                 one_block.dtype)
    lens = jax.ShapeDtypeStruct((shape.batch,), jnp.int32)
    k_scale, v_scale = shape.scales
    fn = functools.partial(pp.decode, impl="pallas", interpret=False, config=config,
                           k_scale=k_scale, v_scale=v_scale, sliding_window=shape.sliding_window)
    modules = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result
    gpu = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=gpu)):
            jax.jit(fn).trace(q, cache, cache, tables, lens).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    decode_modules = [m for m in modules if "pallas_paged_decode" in m.split("\n", 1)[0]]
    if not decode_modules:
        raise RuntimeError(f"no decode kernel in the lowering of {shape_name} ({config})")
    return decode_modules[0]


def compile_sass(ir_text: str, config: pp.DecodeConfig, out_dir: str) -> dict:
    """Compile ``ir_text`` with the ``triton`` package for sm_90.

    Returns:
      ``{"registers": int, "shared_bytes": int, "opcodes": Counter}`` (static instruction counts
      over the whole kernel), the files written under ``out_dir``.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(out_dir, "kernel.ttir")
    with open(path, "w") as f:
        f.write(ir_text)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=config.num_warps,
                                         num_stages=config.num_stages))
    base = os.path.join(out_dir, "kernel")
    for suffix in ("ttgir", "ptx"):
        with open(f"{base}.{suffix}", "w") as f:
            f.write(kernel.asm[suffix])
    with open(f"{base}.cubin", "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", f"{base}.cubin"], capture_output=True, text=True,
                          check=True).stdout
    with open(f"{base}.sass", "w") as f:
        f.write(sass)
    usage = subprocess.run([tool, "-res-usage", f"{base}.cubin"], capture_output=True, text=True,
                           check=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    return {"registers": int(registers.group(1)) if registers else None,
            "shared_bytes": kernel.metadata.shared,
            "opcodes": collections.Counter(m.group(1) for line in sass.splitlines()
                                           if (m := _SASS_LINE.match(line)))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, help="a decode shape of benchmarks.shapes")
    parser.add_argument("--config", type=parse_config, default={},
                        help="bk<int>/s<int>/w<int>/st<int>/vl<0|1>, any subset")
    parser.add_argument("--out", default=None, help="keep the IR, PTX, cubin and SASS here")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401 - only to fail early with a clear message
    except ImportError:
        print("error: needs the triton package (pip install triton==3.6.0)", file=sys.stderr)
        return 2
    config = kernel_config(args.shape, args.config)
    out_dir = args.out or tempfile.mkdtemp(prefix="triton_sass_")
    os.makedirs(out_dir, exist_ok=True)
    result = compile_sass(triton_ir(args.shape, config), config, out_dir)
    opcodes = result["opcodes"]
    print(f"{args.shape} {config}: {result['registers']} registers per thread,"
          f" {result['shared_bytes']} bytes of shared memory, {sum(opcodes.values())} static"
          f" instructions (files in {out_dir})")
    for op, count in opcodes.most_common(args.top):
        print(f"{count:7d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
