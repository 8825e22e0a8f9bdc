"""A Triton kernel's machine code for a named shape, without a GPU: what a config compiles to
(registers, shared memory, instructions by opcode, how deep its K/V tiles are pipelined, how
many programs a multiprocessor holds) before a GPU run times it.

    python -m benchmarks.profiling.triton_sass --shape fp8_b32_ctx4096
        [--config bk32/s4/w2/st2/vl1 ...] [--out DIR] [--top 25]
    python -m benchmarks.profiling.triton_sass --shape mixed_4x512c2560_60dec4096
        [--config bq16/sq4/st3] [--fused]

A decode shape of `benchmarks.shapes` gives the decode kernel, a ragged one the ragged
paged-attention kernel. The kernel is lowered as
`pallas_paged.decode` or `pallas_paged.paged_attention` lowers it for CUDA (an abstract H100-class
GPU, as the CPU tests lower it), its Triton IR is taken from that lowering, and the Triton compiler
of the ``triton`` package (installed with the ``test`` extra on Linux x86_64, not a dependency of
the library) compiles it for sm_90; its ``cuobjdump`` gives registers and SASS. On a GPU, XLA
compiles the same IR with its own build of Triton, so the counts here are a prediction to check
with Nsight Compute there.

``--config``: parts of `benchmarks._cli.config_label`'s form (``bk<int>/s<int>/w<int>/st<int>``,
``vl1`` for `DecodeConfig.fp8_v_at_load`, ``mk1`` for ``merge_in_kernel``, ``pr1`` for
``fp8_pairs``; for ragged shapes those of an `AttentionConfig`, with ``bq``, ``sq``), any subset,
over the config the kernel picks for the shape on an NVIDIA H200; repeatable (one summary line
per config). ``--out``: keep ``kernel.ttir``, ``.ttgir``, ``.ptx``, ``.cubin`` and ``.sass``
there (one config).

The summary (`pipeline_summary`): the longest loop's instructions per warp (decode: the tile
loop); the K/V rings' depths, the leading dimension of the shared-memory buffers Triton's
pipeliner allocates for the K and V tiles (`ring_depths_in_ttgir`; the ragged kernel has one
pair per tile loop; for decode `pallas_paged._triton_common.kv_ring_depth` is the model it
checks: ``num_stages`` 2 to 4 give one buffer, 5 and 6 two); the programs one
multiprocessor holds (`programs_per_sm`: registers, shared memory, warps, blocks of sm_90); for
decode also the grid's waves and the K/V bytes in flight per multiprocessor at most (resident
programs x ring depth x tile bytes), the quantity Little's law ties to bandwidth.
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
from benchmarks._cli import config_label, parse_config as parse_label
from benchmarks.shapes import RAGGED_SHAPES, shape_by_name
from pallas_paged._triton_common import kv_ring_depth
from pallas_paged.decode_attention import pallas_triton_config
from pallas_paged.decode_attention.api import decode_shape
from pallas_paged.ragged_attention import pallas_triton_config as ragged_config
from pallas_paged.ragged_attention.api import attention_shape

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


def ragged_shape(shape_name: str):
    """The ragged shape of that name, or None for a decode shape."""
    return {shape.name: shape for shape in RAGGED_SHAPES}.get(shape_name)


def parse_config(label: str, shape_name: str | None = None) -> dict:
    """``"bk32/w2/vl1"`` -> ``{"block_k": 32, "num_warps": 2, "fp8_v_at_load": True}`` (for a
    ragged shape, an `AttentionConfig`'s fields)."""
    ragged = shape_name is not None and ragged_shape(shape_name) is not None
    return parse_label(label, pp.AttentionConfig if ragged else pp.DecodeConfig)


def kernel_config(shape_name: str, overrides: dict):
    """The config the kernel picks for the shape on `TARGET_DEVICE`, with ``overrides``: a
    `pallas_paged.DecodeConfig`, or an `pallas_paged.AttentionConfig` for a ragged shape."""
    ragged = ragged_shape(shape_name)
    if ragged is not None:
        q, cache, tables, _, _ = ragged.abstract_args()
        base = ragged_config.lookup(attention_shape(q, cache, tables), *TARGET_DEVICE)
        return dataclasses.replace(base, **overrides)
    shape = shape_by_name(shape_name)
    found = decode_shape(*shape.abstract_args(), sliding_window=shape.sliding_window)
    return dataclasses.replace(pallas_triton_config.lookup(found, *TARGET_DEVICE), **overrides)


def cache_operands(cache, fused: bool) -> tuple:
    """The call's cache operands for the abstract K (or V) cache ``cache``: ``(k, v)``, or the
    one fused cache ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]`` of its blocks."""
    if not fused:
        return cache, cache
    blocks, block_size, kvh, head_dim = cache.shape
    return (jax.ShapeDtypeStruct((blocks, block_size, 2 * kvh, head_dim), cache.dtype),)


def triton_ir(shape_name: str, config, fused: bool = False) -> str:
    """The Triton IR (text) of the kernel that ``decode(..., impl="pallas")`` (or, for a ragged
    shape, ``paged_attention``) lowers to for the named shape and ``config``, lowered for CUDA
    without a GPU; ``fused``: over one fused cache (``decode_fused``, ``paged_attention_fused``)."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    ragged = ragged_shape(shape_name)
    if ragged is not None:
        q, cache, tables, lens, starts = ragged.abstract_args()
        fn = functools.partial(pp.paged_attention_fused if fused else pp.paged_attention,
                               impl="pallas", interpret=False, config=config, **ragged.scales)
        args = (q, *cache_operands(cache, fused), tables, lens, starts)
        prefix = "pallas_paged_ragged"
    else:
        shape = shape_by_name(shape_name)
        q, one_block, tables = shape.abstract_args()
        # As many blocks as the tables can name: with one, the clamped ids would be constants.
        cache = jax.ShapeDtypeStruct((shape.batch * shape.max_blocks,) + one_block.shape[1:],
                                     one_block.dtype)
        lens = jax.ShapeDtypeStruct((shape.batch,), jnp.int32)
        fn = functools.partial(pp.decode_fused if fused else pp.decode, impl="pallas",
                               interpret=False, config=config,
                               sliding_window=shape.sliding_window, **shape.scales)
        args, prefix = (q, *cache_operands(cache, fused), tables, lens), "pallas_paged_decode"
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
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    kernels = [m for m in modules if prefix in m.split("\n", 1)[0]]
    if not kernels:
        raise RuntimeError(f"no {prefix} kernel in the lowering of {shape_name} ({config})")
    return kernels[0]


def compile_sass(ir_text: str, config, out_dir: str) -> dict:
    """Compile ``ir_text`` with the ``triton`` package for sm_90 (``config``: its
    ``num_warps``, ``num_stages`` and ``block_k``).

    Returns:
      ``{"registers": int, "shared_bytes": int, "opcodes": Counter, "loop_instructions": int,
      "copies_left_in_flight": int | None, "ring_depths": list[int]}`` (opcodes: static
      instruction counts over the whole kernel; see `loop_instructions`,
      `copies_left_in_flight`, `ring_depths_in_ttgir`), the files written under ``out_dir``.
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
            "copies_left_in_flight": copies_left_in_flight(sass),
            "ring_depths": ring_depths_in_ttgir(kernel.asm["ttgir"], config.block_k)}


def _longest_loop(sass: str) -> list[str]:
    """The instructions (text) of the longest loop of the SASS: the span of its longest
    backward branch."""
    instructions = [(int(m.group(1), 16), m.group(2)) for line in sass.splitlines()
                    if (m := _SASS_INSTRUCTION.match(line))]
    longest = []
    for address, text in instructions:
        target = _BRANCH_TARGET.search(text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            body = [t for a, t in instructions if start <= a <= address]
            longest = body if len(body) > len(longest) else longest
    return longest


def loop_instructions(sass: str) -> int:
    """Instructions in the longest loop of the SASS: the decode kernel's tile loop, per warp and
    per tile (the ragged kernel's longest tile loop)."""
    return len(_longest_loop(sass))


def copies_left_in_flight(sass: str) -> int | None:
    """How many groups of asynchronous copies the tile loop's first wait leaves outstanding
    (``DEPBAR.LE SB0, n``): 0 means the loop waits for every copy it issued, so a tile's loads
    never overlap the tile before it; None without such a wait."""
    for text in _longest_loop(sass):
        match = re.search(r"DEPBAR\.LE\s+SB0,\s*(0x[0-9a-f]+|\d+)", text)
        if match:
            return int(match.group(1), 0)
    return None


def ring_depths_in_ttgir(ttgir: str, block_k: int) -> list[int]:
    """Buffers of each K/V tile ring that Triton's pipeliner allocated in the compiled kernel, in
    allocation order: the leading dimension of its ``[depth, block_k, cols]`` shared-memory
    allocations (K and V of each pipelined tile loop; empty when no tile is pipelined)."""
    return [int(m.group(1)) for m in _TILE_RING.finditer(ttgir)
            if int(m.group(2)) == block_k and m.group(4) != "i32"]


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


def pipeline_summary(shape_name: str, config, result: dict) -> str:
    """One line: the tile loop, the K/V rings, residency and, for decode, the waves and the
    bytes in flight (see the module docstring), from `compile_sass`'s ``result``."""
    loop, depths = result["loop_instructions"], result["ring_depths"]
    per_sm, limit = programs_per_sm(result["registers"], result["shared_bytes"], config.num_warps)
    spills = sum(count for op, count in result.get("opcodes", {}).items()
                 if op.startswith(("LDL", "STL")))
    head = (f"{result['registers']} regs, {result['shared_bytes']} B smem"
            + (f", {spills} local-memory (spill) instructions" if spills else "")
            + f"; tile loop {loop} instrs/warp"
            f" ({loop * config.num_warps / config.block_k:.1f} per token)")
    if result.get("copies_left_in_flight") is not None:
        head += f", its wait leaves {result['copies_left_in_flight']} copy groups in flight"
    if ragged_shape(shape_name) is not None:
        rings = ", ".join(f"{depth} deep x{count}"
                          for depth, count in sorted(collections.Counter(depths).items()))
        return (f"{config_label(config)}: {head}; K/V rings"
                f" {rings or 'none'}; {per_sm} programs/SM (by {limit})")
    shape = shape_by_name(shape_name)
    sms = TARGET_DEVICE[1]
    depth, model = min(depths, default=0), kv_ring_depth(config.num_stages)
    grid = shape.num_kv_heads * (config.persistent_programs
                                 or shape.batch * config.num_splits)
    resident = min(per_sm, grid / sms)
    tile_bytes = 2 * config.block_k * shape.head_dim * jnp.dtype(shape.dtype).itemsize
    in_flight = resident * max(depth, 1) * tile_bytes
    return (f"{config_label(config)}: {head}; K/V ring {depth} deep"
            + ("" if depth == model else f" (kv_ring_depth says {model})")
            + f"; {per_sm} programs/SM (by {limit}), grid {grid} ="
            f" {grid / (per_sm * sms):.2f} waves; K/V in flight <= {in_flight / 1024:.0f}"
            " KiB/SM")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True,
                        help="a decode or ragged shape of benchmarks.shapes")
    parser.add_argument("--config", action="append",
                        help="bk<int>/s<int>/w<int>/st<int>/vl<0|1> (ragged: also bq, sq), any"
                             " subset; repeatable")
    parser.add_argument("--fused", action="store_true",
                        help="the kernel over one fused cache (decode_fused, paged_attention_fused)")
    parser.add_argument("--out", default=None, help="keep the IR, PTX, cubin and SASS here")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401 - only to fail early with a clear message
    except ImportError:
        print("error: needs the triton package (pip install triton)", file=sys.stderr)
        return 2
    labels = args.config or [""]
    if args.out and len(labels) > 1:
        parser.error("--out keeps the files of one config")
    try:
        overrides = [parse_config(label, args.shape) if label else {} for label in labels]
    except ValueError as e:
        parser.error(str(e))
    for fields in overrides:
        config = kernel_config(args.shape, fields)
        with tempfile.TemporaryDirectory(prefix="triton_sass_") as scratch:
            out_dir = args.out or scratch
            os.makedirs(out_dir, exist_ok=True)
            ir_text = triton_ir(args.shape, config, args.fused)
            result = compile_sass(ir_text, config, out_dir)
        opcodes = result["opcodes"]
        print(f"{args.shape}{' (fused)' if args.fused else ''} {config}:"
              f" {sum(opcodes.values())} static instructions"
              + (f" (files in {args.out})" if args.out else ""))
        print(f"  {pipeline_summary(args.shape, config, result)}", flush=True)
        for op, count in opcodes.most_common(args.top):
            print(f"{count:7d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
