"""The decode Triton kernel's machine code for a named shape, without a GPU: what a config
compiles to (registers, shared memory, instructions by opcode, how deep its K/V tiles are
pipelined, how many programs a multiprocessor holds) before a GPU run times it.

    python -m benchmarks.triton_sass --shape fp8_b32_ctx4096 [--config bk32/s4/w2/st2/vl1 ...]
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
shape on an NVIDIA H200; repeatable (one summary line per config). ``--out``: keep
``kernel.ttir``, ``.ttgir``, ``.ptx``, ``.cubin`` and ``.sass`` there (one config).

The summary (`pipeline_summary`): the tile loop's instructions per warp; the K/V ring's depth,
the leading dimension of the shared-memory buffers Triton's pipeliner allocates for the K and V
tiles (`ring_depth_in_ttgir`; `pallas_paged.decode_attention.pallas_triton.kv_ring_depth` is
the model it checks: ``num_stages`` 2 to 4 give one buffer, 5 and 6 two); the programs
one multiprocessor holds (`programs_per_sm`: registers, shared memory, warps, blocks of sm_90)
and the K/V bytes in flight per multiprocessor at most (resident programs x ring depth x tile
bytes), the quantity Little's law ties to bandwidth.
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
from benchmarks.bench import abstract_args, config_label, parse_config_label
from benchmarks.shapes import shape_by_name
from pallas_paged.decode_attention import configs
from pallas_paged.decode_attention.api import decode_shape
from pallas_paged.decode_attention.pallas_triton import kv_ring_depth

CONFIG_PARTS = {"bk": "block_k", "s": "num_splits", "w": "num_warps", "st": "num_stages",
                "vl": "fp8_v_at_load"}
TARGET_DEVICE = ("NVIDIA H200", 132)  # the device kind and SM count whose config is the base
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)")
_SASS_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
# An allocation of a pipelined tile ring: ``local_alloc : () -> !ttg.memdesc<DEPTHxROWSxCOLSxTYPE``.
_TILE_RING = re.compile(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x(\d+)x(\d+)x(\w+?)[,>]")
# sm_90, per multiprocessor: registers, shared memory (each block reserves 1 KiB of it), warps,
# blocks; registers are given to a warp in units of 256.
SM90_REGISTERS, SM90_SHARED_BYTES, SM90_WARPS, SM90_BLOCKS = 65536, 233472, 64, 32
SM90_BLOCK_RESERVED_SHARED, SM90_REGISTER_UNIT = 1024, 256


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
      ``{"registers": int, "shared_bytes": int, "opcodes": Counter, "loop_instructions": int,
      "kv_ring_depth": int}`` (opcodes: static instruction counts over the whole kernel; see
      `loop_instructions`, `ring_depth_in_ttgir`), the files written under ``out_dir``.
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
                                           if (m := _SASS_LINE.match(line))),
            "loop_instructions": loop_instructions(sass),
            "kv_ring_depth": ring_depth_in_ttgir(kernel.asm["ttgir"], config.block_k)}


def loop_instructions(sass: str) -> int:
    """Instructions in the longest loop of the SASS (the span of its longest backward branch):
    the decode kernel's tile loop, per warp and per tile."""
    instructions = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines()
                    if (m := _SASS_INSTRUCTION.match(line))]
    longest = 0
    for address, text in instructions:
        target = _BRANCH_TARGET.search(text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            longest = max(longest, sum(start <= a <= address for a, _ in instructions))
    return longest


def ring_depth_in_ttgir(ttgir: str, block_k: int) -> int:
    """Buffers of the K/V tile rings that Triton's pipeliner allocated in the compiled kernel:
    the leading dimension of its ``[depth, block_k, cols]`` shared-memory allocations (the
    shallower of K's and V's; 0 when the tiles are not pipelined)."""
    depths = [int(m.group(1)) for m in _TILE_RING.finditer(ttgir)
              if int(m.group(2)) == block_k and m.group(4) != "i32"]
    return min(depths, default=0)


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> tuple[int, str]:
    """Programs of ``num_warps`` warps one sm_90 multiprocessor holds, and what limits it."""
    per_warp = -(-registers * 32 // SM90_REGISTER_UNIT) * SM90_REGISTER_UNIT
    limits = {
        "registers": SM90_REGISTERS // per_warp // num_warps,
        "shared memory": SM90_SHARED_BYTES // (shared_bytes + SM90_BLOCK_RESERVED_SHARED),
        "warps": SM90_WARPS // num_warps,
        "blocks": SM90_BLOCKS,
    }
    limit = min(limits, key=lambda name: (limits[name], name))
    return limits[limit], limit


def pipeline_summary(shape_name: str, config: pp.DecodeConfig, result: dict) -> str:
    """One line: the tile loop, the K/V ring, residency and the bytes in flight (see the module
    docstring), from `compile_sass`'s ``result``."""
    shape = shape_by_name(shape_name)
    sms = TARGET_DEVICE[1]
    loop, depth = result["loop_instructions"], result["kv_ring_depth"]
    model = kv_ring_depth(config.num_stages)
    per_sm, limit = programs_per_sm(result["registers"], result["shared_bytes"], config.num_warps)
    grid = shape.batch * shape.num_kv_heads * config.num_splits
    resident = min(per_sm, grid / sms)
    tile_bytes = 2 * config.block_k * shape.head_dim * shape.cache_itemsize
    in_flight = resident * max(depth, 1) * tile_bytes
    return (f"{config_label(config)}: {result['registers']} regs, {result['shared_bytes']} B smem;"
            f" tile loop {loop} instrs/warp ({loop * config.num_warps / config.block_k:.1f} per"
            f" token); K/V ring {depth} deep"
            + ("" if depth == model else f" (kv_ring_depth says {model})")
            + f"; {per_sm} programs/SM (by {limit}), grid {grid} ="
            f" {grid / (per_sm * sms):.2f} waves; K/V in flight <= {in_flight / 1024:.0f}"
            " KiB/SM")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, help="a decode shape of benchmarks.shapes")
    parser.add_argument("--config", type=parse_config, action="append",
                        help="bk<int>/s<int>/w<int>/st<int>/vl<0|1>, any subset; repeatable")
    parser.add_argument("--out", default=None, help="keep the IR, PTX, cubin and SASS here")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401 - only to fail early with a clear message
    except ImportError:
        print("error: needs the triton package (pip install triton==3.6.0)", file=sys.stderr)
        return 2
    labels = args.config or [{}]
    if args.out and len(labels) > 1:
        parser.error("--out keeps the files of one config")
    for overrides in labels:
        config = kernel_config(args.shape, overrides)
        out_dir = args.out or tempfile.mkdtemp(prefix="triton_sass_")
        os.makedirs(out_dir, exist_ok=True)
        result = compile_sass(triton_ir(args.shape, config), config, out_dir)
        opcodes = result["opcodes"]
        print(f"{args.shape} {config}: {sum(opcodes.values())} static instructions (files in"
              f" {out_dir})")
        print(f"  {pipeline_summary(args.shape, config, result)}", flush=True)
        for op, count in opcodes.most_common(args.top):
            print(f"{count:7d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
