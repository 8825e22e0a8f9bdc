"""What Mosaic GPU kernels share: the jax version and device they need, the interpret-mode
caveat, sm_90's shared-memory budget and arithmetic, and the paged K/V tile copies.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_paged._platform import has_gpu, xla_cpu_threads

MIN_JAX = (0, 11, 2)  # plgpu.kernel with out_type / scratch_types and warpgroup semantics
MAX_SMEM_BYTES = 227 * 1024  # shared memory one CTA may use on sm_90
SMEM_PER_SM = 228 * 1024  # shared memory of an sm_90 multiprocessor
SMEM_RESERVED_PER_CTA = 1024  # of it, what the driver reserves for each resident CTA
# A kernel's producer warpgroup, which only issues copies, gives its registers to the consumer
# warpgroups (``setmaxnreg``, `consumer_registers`), whose accumulators and scores live in
# registers.
PRODUCER_REGISTERS = 40
REGISTERS_PER_SM = 64 * 1024


# Pallas places each scoped shared-memory allocation at a multiple of this many bytes (its
# SMEM_ALIGNMENT), so an allocation takes its size rounded up to it (`allocated`).
SMEM_ALIGNMENT = 1024


def allocated(*nbytes: int) -> int:
    """The shared memory scoped allocations of ``nbytes`` bytes each take (`SMEM_ALIGNMENT`)."""
    return sum(-(-int(n) // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for n in nbytes)


def ctas_per_sm(smem: int) -> int:
    """CTAs of ``smem`` bytes of shared memory one sm_90 multiprocessor holds at once."""
    return max(1, SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA))


def persistent_programs(items: int, smem: int, sm_count: int) -> int:
    """The CTAs of a persistent grid (a kernel's ``persistent`` config): as many as the
    multiprocessors hold at once with ``smem`` bytes of shared memory each (`ctas_per_sm`), at
    most one per work item."""
    return max(1, min(items, sm_count * ctas_per_sm(smem)))


def dealt_index(program, j, programs: int):
    """The work item of the ``j``-th round of persistent CTA ``program`` of ``programs``: the
    items (longest first) are dealt in rounds of one per CTA, in snake order (round 0: CTA 0
    first; round 1: CTA ``programs - 1`` first; ...), so that the CTA that took the longest item
    of one round takes the shortest of the next, as a longest-first greedy schedule does."""
    reverse = jax.lax.rem(j, 2) == 1
    return j * programs + jnp.where(reverse, programs - 1 - program, program)


def dealt_items(program, programs: int, items: int):
    """How many items `dealt_index` gives CTA ``program``: one per full round, and one of the
    last, partial round where its position in that round's order falls before its end."""
    rounds, left = divmod(items, programs)
    position = program if rounds % 2 == 0 else programs - 1 - program
    return rounds + (position < left).astype(jnp.int32)


def jax_version() -> tuple[int, ...]:
    """``jax.__version__`` as a tuple of ints (``"0.11.2"`` -> ``(0, 11, 2)``)."""
    parts = []
    for piece in jax.__version__.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_jax() -> None:
    """ValueError unless this jax has the ``plgpu.kernel`` API the kernel is written for."""
    if jax_version() < MIN_JAX:
        raise ValueError(
            f"impl='mosaic' needs jax >= {'.'.join(map(str, MIN_JAX))} (plgpu.kernel), found"
            f" jax {jax.__version__}: use impl='pallas' or impl='xla'")


def import_plgpu():
    """``jax.experimental.pallas.mosaic_gpu``, or ValueError where its API is not the one used."""
    check_jax()
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def check_device(interpret: bool) -> None:
    """ValueError unless the kernel can run here: interpret mode anywhere, compiled on sm_90+."""
    if interpret:
        return
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise ValueError(
            f"impl='mosaic' compiled (interpret=False) needs an NVIDIA GPU, found"
            f" {device.platform!r} ({device.device_kind}): pass interpret=True or use impl='xla'")
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        raise ValueError(f"impl='mosaic' needs an NVIDIA GPU of compute capability >= 9.0, found"
                         f" {device.device_kind!r}: use impl='pallas'")
    major = int(str(capability).split(".")[0])
    if major < 9:
        raise ValueError(
            f"impl='mosaic' needs compute capability >= 9.0 (Hopper: TMA, wgmma), found"
            f" {device.device_kind!r} with compute capability {capability}: use impl='pallas'")


def warn_if_interpret_may_stall(interpret: bool, warpgroups: int, *, fewer: str) -> None:
    """A ``RuntimeWarning`` where interpret mode can wait forever.

    Mosaic GPU's interpret mode runs each warpgroup of a CTA as a JAX computation of its own,
    whose barrier waits block inside host callbacks that XLA runs on its CPU thread pools: with
    more ``warpgroups`` than pool threads (`xla_cpu_threads`), the waiting ones can hold every
    thread while the one they wait for queues behind them. Where JAX's default backend is a GPU,
    those callbacks are slower still (a call of two sequences did not finish in 100 s, against
    3 s on a CPU), so interpret mode belongs on the CPU. ``fewer`` names the config field that
    takes fewer warpgroups.
    """
    if not interpret:
        return
    if has_gpu():
        warnings.warn(
            "impl='mosaic' in interpret mode with a GPU as JAX's default backend: its warpgroups"
            " wait on each other inside host callbacks, which there are too slow to finish"
            " (a call of two sequences took over 100 s, 3 s on a CPU); run interpret mode on the"
            " CPU (JAX_PLATFORMS=cpu), or compiled on the GPU (interpret=False)",
            RuntimeWarning, stacklevel=3)
    threads = xla_cpu_threads()
    if warpgroups > threads:
        warnings.warn(
            f"impl='mosaic' in interpret mode: the kernel's {warpgroups} warpgroups wait on each"
            f" other inside host callbacks that XLA's CPU thread pools run, and those pools have"
            f" {threads} threads here, so the call can wait forever; set NPROC={max(8, warpgroups)}"
            f" in the environment before JAX starts, or use fewer {fewer}",
            RuntimeWarning, stacklevel=3)


def mma_swizzle(row_bytes: int) -> int:
    """The widest swizzle (32, 64 or 128 bytes) rows of ``row_bytes`` allow."""
    return 128 if row_bytes % 128 == 0 else 64 if row_bytes % 64 == 0 else 32


def mma_smem(plgpu, shape, dtype, swizzle: int | None = None):
    """Shared memory for a wgmma operand (or a TMA destination read as one): 8-row tiles of
    ``swizzle`` bytes, by default the widest swizzle the rows allow (`mma_swizzle`)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = swizzle or mma_swizzle(shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def copies_per_tile(block_size: int, block_kv: int) -> int:
    """TMA copies of K (and of V) per K/V tile of ``block_kv`` tokens: one per page, or one
    part of a page larger than the tile."""
    return block_kv // block_size if block_size <= block_kv else 1


def tile_block_ids(tables_ref, row, kv_tile, *, block_size: int, block_kv: int, num_blocks: int,
                   page_lo, page_hi) -> tuple:
    """The block ids of ``kv_tile``'s pages (`copies_per_tile` of them), read from
    ``tables_ref[row]`` at page indices clamped into ``[page_lo, page_hi]`` (so the table is read
    only where the tiles are), each id clamped into the cache's ``[0, num_blocks)``."""
    if block_size <= block_kv:
        copies = copies_per_tile(block_size, block_kv)
        pages = [kv_tile * copies + j for j in range(copies)]
    else:
        pages = [kv_tile // (block_size // block_kv)]
    return tuple(jnp.clip(tables_ref[row, jnp.clip(page, page_lo, page_hi)], 0, num_blocks - 1)
                 for page in pages)


def kv_head_rows(h, fused: bool):
    """Where kv head ``h``'s K and V rows lie along a cache's head axis (a TMA copy's index):
    ``(h, h)`` in separate K and V caches, ``(2h, 2h + 1)`` in one fused cache."""
    return (2 * h, 2 * h + 1) if fused else (h, h)


def copy_kv_tile(plgpu, k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, *, kv_tile, slot, blocks,
                 kv_head, fused: bool, block_size: int, block_kv: int) -> None:
    """TMA the K and V rows of ``kv_tile`` (its pages' block ids ``blocks``, `tile_block_ids`)
    of kv head ``kv_head`` (the fused cache: its rows `kv_head_rows`) into stage ``slot`` of the
    rings ``k_smem``/``v_smem`` [stages, block_kv, D], each copy arriving on
    ``k_bars``/``v_bars[slot]`` (whose arrivals: `copies_per_tile`)."""
    k_head, v_head = kv_head_rows(kv_head, fused)
    if block_size <= block_kv:
        for j, block in enumerate(blocks):
            rows = pl.ds(j * block_size, block_size)
            plgpu.copy_gmem_to_smem(k_ref.at[block, :, k_head], k_smem.at[slot, rows],
                                    k_bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[block, :, v_head], v_smem.at[slot, rows],
                                    v_bars.at[slot])
    else:
        rows = pl.ds((kv_tile % (block_size // block_kv)) * block_kv, block_kv)
        plgpu.copy_gmem_to_smem(k_ref.at[blocks[0], rows, k_head], k_smem.at[slot],
                                k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[blocks[0], rows, v_head], v_smem.at[slot],
                                v_bars.at[slot])


def consumer_registers(num_consumers: int) -> int:
    """Registers per thread each of several consumer warpgroups takes (``setmaxnreg``): the CTA's
    launch share (the register file over its ``1 + num_consumers`` warpgroups, a multiple of 8)
    less the producer's `PRODUCER_REGISTERS`, split among the consumers (2: 232, 3: 152, 4: 104)."""
    warpgroups = 1 + num_consumers
    launch = REGISTERS_PER_SM // (128 * warpgroups) // 8 * 8
    return min((launch * warpgroups - PRODUCER_REGISTERS) // num_consumers // 8 * 8, 256)


def with_optional_operands(body, num_fixed: int, optional: dict):
    """A kernel body over ``num_fixed`` refs, then only the present ones (not None) of the
    ``optional`` operands (in its order), then the outputs, for ``body`` that takes every
    optional ref (None where absent). Returns ``(kernel_body, the present operands)``."""
    present = [name for name, x in optional.items() if x is not None]

    def kernel_body(*refs):
        given = dict(zip(present, refs[num_fixed:]))
        body(*refs[:num_fixed], *(given.get(name) for name in optional),
             *refs[num_fixed + len(present):])

    return kernel_body, [optional[name] for name in present]


def check_query_dtype(q) -> None:
    """ValueError unless ``q`` is bf16 or fp16 (fp32 would run the tensor cores in TF32)."""
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(
            f"impl='mosaic' takes bf16 or fp16 queries, got q.dtype={jnp.dtype(q.dtype)} (fp32"
            " would run the tensor cores in TF32): use impl='pallas' or impl='xla' for fp32")


def check_head_dim(q, supported: tuple) -> None:
    """ValueError unless ``q``'s head_dim is one of ``supported``."""
    head_dim = q.shape[2]
    if head_dim not in supported:
        raise ValueError(f"impl='mosaic' supports head_dim in {supported}, got"
                         f" {q.shape=} (head_dim={head_dim}): use impl='pallas'")


def check_pages_fit_tiles(k_cache, tile: int, tile_name: str) -> None:
    """ValueError unless the cache's block_size is a multiple of 8 (a TMA copy's rows into a
    tiled operand) that divides the kernel's K/V tile of ``tile`` tokens (config field
    ``tile_name``) or is a multiple of it: a tile is whole pages, or one slice of a page."""
    block_size = k_cache.shape[1]
    if block_size % 8 or (tile % block_size and block_size % tile):
        raise ValueError(
            f"impl='mosaic' needs block_size a multiple of 8 that divides {tile_name}={tile} or"
            f" is a multiple of it, got {k_cache.shape=} (block_size={block_size}): use"
            " impl='pallas'")


def auto_kernel(config, *, triton_type: type, mosaic_type: type, measured_faster: bool,
                interpret: bool, mosaic_config, refusal) -> tuple[str, object]:
    """``impl="auto"``'s kernel, for an op with a Triton and a Mosaic GPU kernel: ``(impl,
    config)``, ``impl`` ``"pallas"`` or ``"mosaic"``, ``config`` None where the caller's lookup
    should pick one.

    A ``config`` names its kernel by its type (``triton_type`` or ``mosaic_type``). Without one,
    the Mosaic kernel where a run measured it faster for the call's shape class
    (``measured_faster``) and it can run the call compiled (not in ``interpret`` mode, and
    ``refusal(mosaic_config())`` is None); the Triton kernel everywhere else.

    Raises:
      ValueError: a ``config`` of neither type.
    """
    if isinstance(config, mosaic_type):
        return "mosaic", config
    if isinstance(config, triton_type):
        return "pallas", config
    if config is not None:
        def named(t):
            return f"{'an' if t.__name__[0] in 'AEIOU' else 'a'} {t.__name__}"
        raise ValueError(f"config must be {named(triton_type)}, {named(mosaic_type)} or None"
                         f" for impl='auto', got {type(config).__name__}")
    if measured_faster and not interpret:
        chosen = mosaic_config()
        if refusal(chosen) is None:
            return "mosaic", chosen
    return "pallas", None
