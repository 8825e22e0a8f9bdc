"""Hardening runs of pallas_paged on a GPU: garbage inputs, caches past 2**31 elements, determinism.

One device call per mode, from the repository root::

    # bad tables, lengths and slots with the compiled kernels, under the CUDA memory checker
    # (the platform allocator gives every buffer its own allocation, so memcheck sees its bounds)
    PYTHONPATH=. XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \\
        --target-processes all python3 scripts/gpu_hardening.py garbage --out $OUT \\
        2>&1 | tee $OUT/garbage_memcheck.txt | tail -40
    # caches of 150,000 x 16 x 8 x 128 (> 2**31 elements) in bf16 and fp8, and 300,000 blocks in fp8
    PYTHONPATH=. python3 scripts/gpu_hardening.py huge --out $OUT
    # 20 repeated calls per split configuration at B=8, 2048 tokens, bf16, H=32, KVH=8, D=128
    PYTHONPATH=. python3 scripts/gpu_hardening.py determinism --out $OUT
    # huge, then determinism
    PYTHONPATH=. python3 scripts/gpu_hardening.py all --out $OUT

Each case prints one ``PASS`` / ``FAIL`` line, each mode a ``SUMMARY`` line; ``$OUT/<mode>.json``
holds the cases (rewritten after every case, so a crash keeps what ran before it). The exit
status is 1 when a case failed, 2 for a usage error. ``--small`` shrinks every shape (the huge
caches to a few dozen blocks, with a pretend 2**31 boundary) so that the code paths run on a CPU
in interpret mode; ``-k SUBSTRING`` runs only the cases whose name contains it. The script puts
the repository root on ``sys.path`` itself.

Why fp8 is in ``huge`` twice: Pallas' Triton lowering switches to 64-bit pointer offsets only
when an array has more than 2**32 *bytes*, so a 1-byte cache of 2**31..2**32 elements would keep
32-bit offsets past 2**31. pallas_paged refuses such caches in its kernels (ValueError; the default
write takes the XLA path): the ``fp8`` variant (150,000 blocks) checks the refusal and the XLA
paths, the ``fp8_past_2_32`` variant (300,000 blocks, 4.9e9 elements) the kernels with 64-bit
offsets past both boundaries.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import pallas_paged as pp  # noqa: E402

C = pp.DecodeConfig
BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
ATOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 3e-3}  # tests/test_decode.py, per q dtype
INT32_MAX, INT32_MIN = 2**31 - 1, -2**31
PAD_SENTINEL = 1000.0


# --- the case runner -----------------------------------------------------------------------------

class CaseFailure(AssertionError):
    """A check that did not hold; ``detail`` goes into the JSON."""

    def __init__(self, message: str, **detail):
        super().__init__(message)
        self.detail = detail


def check(condition: bool, message: str, **detail) -> None:
    if not condition:
        raise CaseFailure(message, **detail)


class Runner:
    """Runs named cases, one PASS / FAIL line each, and keeps ``<out>/<mode>.json`` current."""

    def __init__(self, mode: str, out_dir: str, args, only: str | None):
        self.mode, self.only = mode, only
        self.path = os.path.join(out_dir, f"{mode}.json")
        self.cases: list[dict] = []
        self.failed_names: set[str] = set()
        self.start = time.perf_counter()
        self.header = dict(mode=mode, small=args.small, argv=sys.argv, environment=environment())
        self._write()

    def case(self, name: str, fn, *, requires: tuple[str, ...] = (), always: bool = False,
             skip: str | None = None):
        """Run ``fn()`` (returns a dict of details, or None) as case ``name``.

        ``requires``: cases that must have passed first; ``always``: run even when ``-k`` does not
        select it (setup that later cases need); ``skip``: the reason this case does not apply.
        """
        if self.only and self.only not in name and not always:
            return None
        missing = [r for r in requires if r in self.failed_names]
        start = time.perf_counter()
        detail, message, result = {}, "", None
        if skip:
            status, message = "SKIP", skip
        elif missing:
            status, message = "FAIL", f"not run: {', '.join(missing)} failed"
        else:
            try:
                result = fn()
                detail = result if isinstance(result, dict) else {}
                status = "PASS"
            except CaseFailure as e:
                status, message, detail = "FAIL", str(e), e.detail
            except Exception as e:  # noqa: BLE001  a crash in one case is that case's failure
                status, message = "FAIL", f"{type(e).__name__}: {e}"
                detail = dict(traceback=traceback.format_exc(limit=8))
        seconds = time.perf_counter() - start
        if status == "FAIL":
            self.failed_names.add(name)
        brief = {k: v for k, v in detail.items() if k != "traceback"}
        line = f"{status} {self.mode}/{name} ({seconds:.2f} s)"
        if message:
            line += f": {message}"
        elif brief:
            line += f" {json.dumps(brief, default=str)[:300]}"
        print(line, flush=True)
        if status == "FAIL" and "traceback" in detail:
            print(detail["traceback"], flush=True)
        self.cases.append(dict(name=name, status=status, seconds=round(seconds, 4),
                               message=message, detail=_jsonable(detail)))
        self._write()
        return result

    def failed(self, name: str) -> bool:
        return name in self.failed_names

    def counts(self) -> dict:
        return {status: sum(c["status"] == status for c in self.cases)
                for status in ("PASS", "FAIL", "SKIP")}

    def summary(self) -> bool:
        counts = self.counts()
        wall = time.perf_counter() - self.start
        print(f"SUMMARY {self.mode}: {counts['PASS']} passed, {counts['FAIL']} failed,"
              f" {counts['SKIP']} skipped (of {len(self.cases)}) in {wall:.1f} s -> {self.path}",
              flush=True)
        self._write(final=True)
        return counts["FAIL"] == 0

    def _write(self, final: bool = False):
        counts = self.counts()
        doc = dict(self.header, complete=final, passed=counts["PASS"], failed=counts["FAIL"],
                   skipped=counts["SKIP"], total=len(self.cases),
                   wall_s=round(time.perf_counter() - self.start, 3), cases=self.cases)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def environment() -> dict:
    device = jax.devices()[0]
    return dict(python=platform.python_version(), jax=jax.__version__,
                jaxlib=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
                backend=jax.default_backend(), device=str(device),
                device_kind=getattr(device, "device_kind", None),
                allocator=os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"),
                interpret=jax.default_backend() != "gpu")


def _jaxlib_version():
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


def timed(fn, *args, repeat: int = 1, **kwargs):
    """``(result, seconds of the first call, mean seconds of ``repeat`` further calls)``."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args, **kwargs))
    first = time.perf_counter() - start
    if repeat <= 0:
        return result, first, None
    start = time.perf_counter()
    for _ in range(repeat):
        result = jax.block_until_ready(fn(*args, **kwargs))
    return result, first, (time.perf_counter() - start) / repeat


def raw_bits(x) -> np.ndarray:
    x = np.asarray(x)
    return np.ascontiguousarray(x).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def quantize_fp8_host(x: np.ndarray, scale: float) -> np.ndarray:
    """SPEC.md's fp8 store: ``clamp(x / scale, -448, 448)`` in fp32, rounded to nearest even."""
    scaled = np.asarray(x, np.float32) / np.float32(scale)
    return np.clip(scaled, -448.0, 448.0).astype(FP8)


# --- a float64 reference for a handful of sequences ------------------------------------------

def reference_decode(q, k_blocks, v_blocks, lens, block_size, scale=None, k_scale=None,
                     v_scale=None, window=None, soft_cap=None, alibi=None, sinks=None):
    """Decode attention in float64 on host arrays.

    Args:
      q: ``[B, H, D]``; k_blocks, v_blocks: per sequence, ``[nb, block_size, KVH, D]`` (the blocks
      of its table, in order, already fetched); lens: ``[B]``.

    Returns:
      ``(out f64[B, H, D], lse f64[B, H])``, zeros / -inf for empty rows.
    """
    q = np.asarray(q, np.float32).astype(np.float64)
    batch, heads, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((batch, heads, d))
    lse = np.full((batch, heads), -np.inf)
    for b in range(batch):
        n = int(lens[b])
        if n <= 0:
            continue
        kvh = k_blocks[b].shape[2]
        group = heads // kvh
        k = np.asarray(k_blocks[b], np.float32).astype(np.float64).reshape(-1, kvh, d)[:n]
        v = np.asarray(v_blocks[b], np.float32).astype(np.float64).reshape(-1, kvh, d)[:n]
        if k_scale is not None:
            k, v = k * k_scale, v * v_scale
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [n, H, D]
        s = np.einsum("hd,phd->hp", q[b], k) * scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        if alibi is not None:
            s = s + np.asarray(alibi, np.float64)[:, None] * (np.arange(n) - (n - 1))[None, :]
        if window is not None:
            s[:, : max(0, n - window)] = -np.inf
        m = s.max(axis=1)
        if sinks is not None:
            m = np.maximum(m, np.asarray(sinks, np.float64))
        e = np.exp(s - m[:, None])
        denom = e.sum(axis=1)
        if sinks is not None:
            denom = denom + np.exp(np.asarray(sinks, np.float64) - m)
        out[b] = np.einsum("hp,phd->hd", e, v) / denom[:, None]
        lse[b] = m + np.log(denom)
    return out, lse


def compare_decode(out, expected, lens, q_dtype: str) -> dict:
    """Per-row ``max|out - ref| <= ATOL * max(1, max|ref row|)``; finite; zeros for empty rows."""
    got = np.asarray(out).astype(np.float64)
    check(np.isfinite(got).all(), "NaN or Inf in the output")
    empty = np.asarray(lens) <= 0
    check(bool((got[empty] == 0).all()), "a zero-length row is not zero")
    err = np.abs(got - expected).max(axis=(1, 2))
    bound = ATOL[q_dtype] * np.maximum(1.0, np.abs(expected).max(axis=(1, 2)))
    check(bool((err <= bound).all()), f"max errors {err.tolist()} exceed {bound.tolist()}",
          max_err=err.tolist(), bound=bound.tolist())
    return dict(max_err=float(err.max()), bound=float(bound.min()))


_take_blocks = jax.jit(lambda cache, ids: cache[ids])


def fetch_blocks(cache, tables, lens, block_size):
    """The blocks each sequence reads, pulled to the host (only those)."""
    take = _take_blocks
    out = []
    for row, n in zip(np.asarray(tables), np.asarray(lens)):
        nb = -(-int(max(n, 0)) // block_size)
        ids = np.asarray(row[:nb], np.int32) if nb else np.zeros(1, np.int32)
        out.append(np.asarray(take(cache, jnp.asarray(ids))))
    return out


# --- garbage ---------------------------------------------------------------------------------

def mode_garbage(args, runner: Runner):
    """Small decode and write cases with garbage ids and lengths, compiled kernels, bitwise
    comparisons with clean / clamped / expected results."""
    rng = np.random.default_rng(0)
    b, h, kvh, d, bs, width = 4, 8, 2, 64, 16, 8
    if args.small:
        d = 32
    num_blocks = b * width + 5
    capacity = width * bs
    shape = (num_blocks, bs, kvh, d)
    k_cache = jnp.asarray(rng.standard_normal(shape).astype(BF16))
    v_cache = jnp.asarray(rng.standard_normal(shape).astype(BF16))
    q = jnp.asarray(rng.standard_normal((b, h, d)).astype(BF16))
    tables = rng.permutation(num_blocks)[:b * width].reshape(b, width).astype(np.int32)
    lens = np.array([capacity, 17, 0, 20], np.int32)  # 20 < one 64-token tile: masked pages
    used = np.arange(width)[None, :] < (-(-lens // bs))[:, None]
    options = dict(logits_soft_cap=30.0, sliding_window=40, return_lse=True,
                   alibi_slopes=jnp.asarray(np.exp2(-np.arange(1, h + 1)).astype(np.float32)),
                   sinks=jnp.asarray(rng.standard_normal(h).astype(np.float32)))
    runs = [("xla", None), ("pallas", C(64, 1)), ("pallas", C(16, 3))]

    def decode_bits(impl, config, tables_, lens_, opts=options, qq=q, kc=k_cache, vc=v_cache,
                    **scales):
        out, lse = pp.decode(qq, kc, vc, jnp.asarray(np.asarray(tables_, np.int32)),
                             jnp.asarray(np.asarray(lens_, np.int32)), impl=impl, config=config,
                             **opts, **scales)
        return raw_bits(out), raw_bits(lse)

    def same(a, b_, what):
        for x, y, part in ((a[0], b_[0], "out"), (a[1], b_[1], "lse")):
            diff = int((x != y).sum())
            check(diff == 0, f"{what}: {diff} {part} elements differ", differing=diff)

    clean_tables = np.where(used, tables, 0).astype(np.int32)
    for impl, config in runs:
        tag = run_tag(impl, config)

        def tails(impl=impl, config=config):
            clean = decode_bits(impl, config, clean_tables, lens)
            for garbage in (INT32_MAX, INT32_MIN, num_blocks, num_blocks + 12345, -1):
                same(decode_bits(impl, config, np.where(used, tables, garbage), lens), clean,
                     f"tail {garbage}")
            return dict(garbage=[INT32_MAX, INT32_MIN, num_blocks, num_blocks + 12345, -1])

        def valid_part(impl=impl, config=config):
            bad = tables.copy()
            bad[0, [0, 3, 7]] = [INT32_MAX, INT32_MIN, num_blocks]
            bad[1, 1] = -1
            bad[3, 0] = num_blocks + 999
            same(decode_bits(impl, config, bad, lens),
                 decode_bits(impl, config, np.clip(bad, 0, num_blocks - 1), lens), "clamped ids")

        def before_window(impl=impl, config=config):
            bad = tables.copy()
            for row, n in enumerate(lens):
                before = max(0, int(n) - options["sliding_window"]) // bs
                bad[row, :before] = INT32_MIN
            same(decode_bits(impl, config, bad, lens), decode_bits(impl, config, tables, lens),
                 "ids before the window")

        def lengths(impl=impl, config=config):
            full = np.array([capacity, 0, capacity, 0], np.int32)
            bad = np.array([capacity + 1, -1, INT32_MAX, INT32_MIN], np.int32)
            same(decode_bits(impl, config, tables, bad), decode_bits(impl, config, tables, full),
                 "clamped lengths")

        runner.case(f"decode/{tag}/table_tails", tails)
        runner.case(f"decode/{tag}/ids_in_valid_part", valid_part)
        runner.case(f"decode/{tag}/ids_before_window", before_window)
        runner.case(f"decode/{tag}/lengths", lengths)

    # fp8 cache through the kernel, with garbage tails
    k8 = jnp.asarray(rng.standard_normal(shape).astype(FP8))
    v8 = jnp.asarray(rng.standard_normal(shape).astype(FP8))

    def fp8_tails():
        scales = dict(k_scale=0.5, v_scale=0.25)
        plain = dict(return_lse=True)
        clean = decode_bits("pallas", C(32, 2), clean_tables, lens, plain, kc=k8, vc=v8, **scales)
        bad = np.where(used, tables, INT32_MAX)
        same(decode_bits("pallas", C(32, 2), bad, lens, plain, kc=k8, vc=v8, **scales), clean,
             "fp8 tails")
    runner.case("decode/pallas_fp8/table_tails", fp8_tails)

    # writes under jit with donated caches: out-of-range slots are dropped
    num_slots = num_blocks * bs
    for impl in ("xla", "pallas"):
        def slots_case(impl=impl):
            write = jax.jit(functools.partial(pp.write_kv, impl=impl), donate_argnums=(0, 1))
            kc = rng.standard_normal(shape).astype(BF16)
            vc = rng.standard_normal(shape).astype(BF16)
            slots = np.array([3, num_slots, -1, num_slots - 1, num_slots + 10**6, INT32_MAX, -2,
                              INT32_MIN, 17], np.int32)
            new = rng.standard_normal((2, len(slots), kvh, d)).astype(BF16)
            new[:, slots < 0] = PAD_SENTINEL
            got_k, got_v = write(jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(new[0]),
                                 jnp.asarray(new[1]), jnp.asarray(slots))
            for cache, rows, got, name in ((kc, new[0], got_k, "k"), (vc, new[1], got_v, "v")):
                expected = cache.reshape(num_slots, kvh, d).copy()
                keep = (slots >= 0) & (slots < num_slots)
                expected[slots[keep]] = rows[keep]
                diff = np.argwhere((raw_bits(got).reshape(num_slots, -1)
                                    != raw_bits(expected).reshape(num_slots, -1)).any(axis=1))
                check(diff.size == 0, f"{name}_cache slots {diff.ravel()[:8].tolist()} differ")
            return dict(slots=slots.tolist())
        runner.case(f"write/{impl}/slots_out_of_range", slots_case)

        def nan_payloads(impl=impl):
            raw = rng.integers(0, 2**10, shape).astype(np.uint16)
            raw.reshape(-1)[::3] = np.resize(np.array([0x7FC1, 0x7F81, 0xFFA5, 0x7FFF],
                                                      np.uint16), raw.size)[::3]
            cache = raw.view(BF16)
            slots = np.array([5, 70, -1], np.int32)
            new = rng.standard_normal((3, kvh, d)).astype(BF16)
            got, _ = pp.write_kv(jnp.asarray(cache), jnp.asarray(cache), jnp.asarray(new),
                                 jnp.asarray(new), jnp.asarray(slots), impl=impl)
            untouched = np.ones(num_slots, bool)
            untouched[[5, 70]] = False
            diff = (raw_bits(got).reshape(num_slots, -1) != raw.reshape(num_slots, -1))
            bad = int(diff[untouched].sum())
            check(bad == 0, f"{bad} untouched bf16 elements (NaN payloads) changed bits",
                  changed=bad)
        runner.case(f"write/{impl}/bf16_nan_payloads_kept", nan_payloads,
                    skip=None if jax.default_backend() == "gpu" else
                    "XLA:CPU scatter canonicalizes bf16 NaN payloads (tests/test_hardening.py)")


# --- huge ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HugeShape:
    num_blocks: int
    block_size: int
    kvh: int
    head_dim: int
    num_heads: int
    width: int  # max_blocks of the tables
    boundaries: tuple[int, ...]  # first blocks wholly past 2**31 (and 2**32) elements (or pretend)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def elements(self) -> int:
        return self.num_slots * self.kvh * self.head_dim


def huge_variants(small: bool):
    """``(name, dtype, fp8 scales, shape)`` of the huge caches, in the order they run."""
    fp8_scales = dict(k_scale=0.5, v_scale=0.25)
    if small:
        tiny = dict(block_size=4, kvh=2, head_dim=16, num_heads=4, width=8)
        base = HugeShape(num_blocks=48, boundaries=(24,), **tiny)
        past = HugeShape(num_blocks=96, boundaries=(24, 72), **tiny)
    else:
        row = 16 * 8 * 128
        dims = dict(block_size=16, kvh=8, head_dim=128, num_heads=32, width=80)
        at_2_31, at_2_32 = -(-2**31 // row), -(-2**32 // row)  # blocks 131072 and 262144
        base = HugeShape(num_blocks=150_000, boundaries=(at_2_31,), **dims)
        past = HugeShape(num_blocks=300_000, boundaries=(at_2_31, at_2_32), **dims)
    return (("bf16", jnp.bfloat16, {}, base),
            ("fp8", jnp.float8_e4m3fn, fp8_scales, base),  # 2**31..2**32 one-byte elements
            ("fp8_past_2_32", jnp.float8_e4m3fn, fp8_scales, past))


def huge_layout(s: HugeShape, rng):
    """Tables and lengths of 4 sequences living past the boundaries and at the very end."""
    bs, nb, w = s.block_size, s.num_blocks, s.width
    tables = np.empty((4, w), np.int64)
    tails = np.array([INT32_MAX, -1, nb, INT32_MIN])
    tables[:] = rng.choice(tails, (4, w))
    n0 = w * 4 // 5
    tables[0, :n0] = rng.choice(np.arange(s.boundaries[-1], nb), n0, replace=False)
    edges = [b for boundary in s.boundaries for b in (boundary - 1, boundary)] + [nb - 1]
    tables[1, :len(edges)] = edges  # straddles each boundary, ends in the last block
    tables[2, :] = np.arange(nb - w, nb)[::-1]
    # seq 1 ends on the second-to-last slot of the cache, which the writes write
    lens = np.array([n0 * bs - 5, len(edges) * bs - 1, w * bs, 0], np.int32)
    return tables.astype(np.int32), lens


def huge_write_slots(s: HugeShape):
    bs, ns = s.block_size, s.num_slots
    real = [slot for boundary in s.boundaries
            for slot in (boundary * bs - 1, boundary * bs, boundary * bs + 7)]
    # the very last slot stays unwritten, so that a -1 wrapping onto it would show
    real += [(s.num_blocks - 10) * bs + 3, (s.num_blocks - 1) * bs, ns - 2]
    return np.array(real + [-1, ns, INT32_MAX], np.int32), len(real)


def kernel_refuses(shape, dtype) -> bool:
    """Whether pallas_paged refuses this cache for its kernels (1-byte caches of 2**31..2**32
    elements: Triton keeps 32-bit offsets below 2**32 bytes)."""
    try:
        from pallas_paged._platform import kernel_addresses_overflow
    except ImportError:  # a version without the check: expect the kernels to run
        return False
    return kernel_addresses_overflow(shape, dtype)


def expect_refusal(fn):
    """Run ``fn``; PASS when it raises the documented ValueError, FAIL when it runs."""
    try:
        jax.block_until_ready(fn())
    except ValueError as e:
        check("cannot address" in str(e), f"a different ValueError: {e}")
        return dict(refused=True, message=str(e)[:200])
    raise CaseFailure("the kernel ran on a cache it cannot address (expected a ValueError)")


def mode_huge(args, runner: Runner):
    for name, dtype, scales, s in huge_variants(args.small):
        huge_variant(args, runner, name, dtype, scales, s)


def huge_variant(args, runner: Runner, dtype_name: str, dtype, scales: dict, s: HugeShape):
    on_gpu = jax.default_backend() == "gpu"
    shape = (s.num_blocks, s.block_size, s.kvh, s.head_dim)
    refuses = kernel_refuses(shape, dtype)
    row = s.block_size * s.kvh * s.head_dim
    print(f"huge/{dtype_name}: cache {list(shape)} {jnp.dtype(dtype).name} ="
          f" {s.elements:,} elements"
          f" ({s.elements * jnp.dtype(dtype).itemsize:,} bytes; 2**31 = {2**31:,}, 2**32 ="
          f" {2**32:,}); boundary blocks {list(s.boundaries)} (first element offsets"
          f" {[b * row for b in s.boundaries]}); kernels refuse it: {refuses}", flush=True)
    rng = np.random.default_rng(1)
    tables, lens = huge_layout(s, rng)
    slots, num_real = huge_write_slots(s)
    q = rng.standard_normal((4, s.num_heads, s.head_dim)).astype(BF16)
    state = {}

    @functools.partial(jax.jit, static_argnums=(1,))
    def build(key, dtype):
        x = jax.random.normal(key, shape, jnp.bfloat16)
        return x.astype(dtype)

    @functools.partial(jax.jit, static_argnums=(1,))
    def build_from_pool(key, dtype):
        """Fallback: 4099 random blocks repeated (a prime period, so neighbours differ)."""
        pool = jax.random.normal(key, (4099, *shape[1:]), jnp.bfloat16).astype(dtype)
        return pool[jnp.arange(shape[0]) % 4099]

    @jax.jit
    def changed_slots(after, before):
        a = jax.lax.bitcast_convert_type(after, _uint_for(after.dtype))
        b_ = jax.lax.bitcast_convert_type(before, _uint_for(before.dtype))
        return jnp.any((a != b_).reshape(s.num_slots, -1), axis=1)

    @jax.jit
    def rows_at(cache, idx):
        return cache.reshape(s.num_slots, s.kvh, s.head_dim)[idx]

    def make_caches():
        state.clear()
        start = time.perf_counter()
        key = jax.random.PRNGKey(7)
        how = "jax.random.normal"
        try:
            state["k"] = build(jax.random.fold_in(key, 0), dtype)
            state["v"] = build(jax.random.fold_in(key, 1), dtype)
            jax.block_until_ready((state["k"], state["v"]))
        except Exception as e:  # noqa: BLE001
            print(f"random fill of the whole cache failed ({type(e).__name__}: {e});"
                  " using a repeated pool of random blocks", flush=True)
            state.clear()
            how = "pool of 4099 random blocks"
            state["k"] = build_from_pool(jax.random.fold_in(key, 0), dtype)
            state["v"] = build_from_pool(jax.random.fold_in(key, 1), dtype)
            jax.block_until_ready((state["k"], state["v"]))
        nbytes = state["k"].size * state["k"].dtype.itemsize
        return dict(seconds=round(time.perf_counter() - start, 3), fill=how,
                    elements=int(state["k"].size), bytes_per_cache=int(nbytes),
                    over_2_32_bytes=nbytes > 2**32, over_2_31_elements=state["k"].size > 2**31)

    def write_case(impl):
        write = jax.jit(functools.partial(pp.write_kv, impl=impl, **scales), donate_argnums=(0, 1))
        new_dtype = np.float32 if scales else BF16
        new = (rng.standard_normal((2, len(slots), s.kvh, s.head_dim)) * 0.3).astype(new_dtype)
        new[:, slots < 0] = PAD_SENTINEL
        args_ = (jnp.asarray(new[0]), jnp.asarray(new[1]), jnp.asarray(slots))
        if impl == "pallas" and refuses:
            return expect_refusal(lambda: jax.eval_shape(write, state["k"], state["v"], *args_))
        before = [jnp.copy(state["k"]), jnp.copy(state["v"])]
        start = time.perf_counter()
        state["k"], state["v"] = write(state["k"], state["v"], *args_)
        jax.block_until_ready((state["k"], state["v"]))
        seconds = time.perf_counter() - start
        real = slots[:num_real]
        for i, (name, rows, scale) in enumerate((("k", new[0], scales.get("k_scale")),
                                                 ("v", new[1], scales.get("v_scale")))):
            changed = np.flatnonzero(np.asarray(changed_slots(state[name], before[i])))
            stray = sorted(set(changed.tolist()) - set(real.tolist()))
            check(not stray, f"{name}_cache: slots {stray[:8]} changed that no token targets",
                  changed=changed[:16].tolist())
            got = np.asarray(rows_at(state[name], jnp.asarray(real)))
            want = rows[:num_real] if scale is None else quantize_fp8_host(rows[:num_real], scale)
            diff = (raw_bits(got) != raw_bits(want.astype(got.dtype))).any(axis=(1, 2))
            check(not diff.any(), f"{name}_cache: wrong bits at slots {real[diff].tolist()}",
                  wrong_slots=real[diff].tolist())
        del before
        state.pop("ref", None)  # the caches changed: recompute the reference
        return dict(seconds_incl_compile=round(seconds, 3), slots=real.tolist())

    def decode_case(impl, config):
        fn = functools.partial(pp.decode, impl=impl, config=config, return_lse=True, **scales)
        call_args = (jnp.asarray(q), state["k"], state["v"], jnp.asarray(tables),
                     jnp.asarray(lens))
        if impl == "pallas" and refuses:
            return expect_refusal(lambda: jax.eval_shape(fn, *call_args))
        if "ref" not in state:
            kb = fetch_blocks(state["k"], tables, lens, s.block_size)
            vb = fetch_blocks(state["v"], tables, lens, s.block_size)
            state["ref"] = reference_decode(q, kb, vb, lens, s.block_size,
                                            k_scale=scales.get("k_scale"),
                                            v_scale=scales.get("v_scale"))
        (out, lse), first, steady = timed(fn, *call_args, repeat=3 if on_gpu else 0)
        result = compare_decode(out, state["ref"][0], lens, "bfloat16")
        lse = np.asarray(lse)
        live = lens > 0
        lse_err = float(np.abs(lse[live] - state["ref"][1][live]).max())
        check(lse_err < 1e-3, f"lse error {lse_err}", lse_err=lse_err)
        check(bool(np.isneginf(lse[~live]).all()), "lse of the empty row is not -inf")
        return dict(result, lse_err=lse_err, first_call_s=round(first, 3),
                    steady_s=None if steady is None else round(steady, 5))

    order = [("write", "xla"), ("write", "pallas"), ("write", None)]
    order += [("decode", run) for run in (("xla", None), ("pallas", None), ("pallas", C(64, 4)))]
    names = [huge_case_name(dtype_name, kind, what) for kind, what in order]
    built = f"{dtype_name}/build"
    if runner.only and not any(runner.only in n for n in names + [built]):
        return  # -k selects none of this variant's cases: do not build its caches
    runner.case(built, make_caches, always=True)
    for (kind, what), name in zip(order, names):
        if kind == "write":
            runner.case(name, functools.partial(write_case, what), requires=(built,))
        else:
            runner.case(name, functools.partial(decode_case, *what), requires=(built,))
    state.clear()


def huge_case_name(dtype_name: str, kind: str, what) -> str:
    if kind == "write":
        return f"{dtype_name}/write/{what or 'default'}"
    impl, config = what
    return f"{dtype_name}/decode/{run_tag(impl, config)}"


def run_tag(impl: str, config) -> str:
    if impl == "xla":
        return "xla"
    if config is None:
        return f"{impl}_default"
    return f"{impl}_bk{config.block_k}_s{config.num_splits}"


def _uint_for(dtype):
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


# --- determinism ---------------------------------------------------------------------------------

def mode_determinism(args, runner: Runner):
    """Repeated calls on one mid-size input give identical bits, for every split configuration."""
    if args.small:
        b, h, kvh, d, bs, ctx, repeats = 2, 4, 2, 32, 16, 64, 3
        configs = [None, C(16, 1), C(16, 2), C(16, 4)]
    else:
        b, h, kvh, d, bs, ctx, repeats = 8, 32, 8, 128, 16, 2048, args.repeats
        configs = [None, C(64, 1), C(64, 2), C(64, 4), C(32, 8), C(16, 16), C(32, 32)]
    rng = np.random.default_rng(3)
    width = ctx // bs
    num_blocks = b * width + 13
    key = jax.random.PRNGKey(3)
    shape = (num_blocks, bs, kvh, d)
    k_cache = jax.random.normal(jax.random.fold_in(key, 0), shape, jnp.bfloat16)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
    q = rng.standard_normal((b, h, d)).astype(BF16)
    tables = rng.permutation(num_blocks)[:b * width].reshape(b, width).astype(np.int32)
    lens = rng.integers(1, ctx + 1, b).astype(np.int32)
    lens[0] = ctx
    options = dict(logits_soft_cap=30.0, sliding_window=ctx // 2, return_lse=True,
                   alibi_slopes=jnp.asarray(
                       np.exp2(-8.0 * np.arange(1, h + 1) / h).astype(np.float32)),
                   sinks=jnp.asarray(rng.standard_normal(h).astype(np.float32)))
    args_ = (jnp.asarray(q), k_cache, v_cache, jnp.asarray(tables), jnp.asarray(lens))
    kb = fetch_blocks(k_cache, tables, lens, bs)
    vb = fetch_blocks(v_cache, tables, lens, bs)
    ref = reference_decode(q, kb, vb, lens, bs)
    ref_opts = reference_decode(q, kb, vb, lens, bs, window=options["sliding_window"],
                                soft_cap=options["logits_soft_cap"],
                                alibi=np.asarray(options["alibi_slopes"]),
                                sinks=np.asarray(options["sinks"]))

    runs = [("xla", None, False)] + [("pallas", c, False) for c in configs]
    runs += [("xla", None, True), ("pallas", C(64 if not args.small else 16, 4), True)]
    for impl, config, with_options in runs:
        tag = run_tag(impl, config)
        if with_options:
            tag += "_all_options"

        def case(impl=impl, config=config, with_options=with_options):
            opts = options if with_options else dict(return_lse=True)
            fn = functools.partial(pp.decode, impl=impl, config=config, **opts)
            (out, lse), first, _ = timed(fn, *args_, repeat=0)
            first_bits = (raw_bits(out), raw_bits(lse))
            mismatches = 0
            start = time.perf_counter()
            for _ in range(repeats - 1):
                out2, lse2 = fn(*args_)
                mismatches += int((raw_bits(out2) != first_bits[0]).any()
                                  or (raw_bits(lse2) != first_bits[1]).any())
            steady = (time.perf_counter() - start) / max(1, repeats - 1)
            check(mismatches == 0, f"{mismatches} of {repeats - 1} repeated calls differ",
                  mismatching_calls=mismatches)
            accuracy = compare_decode(out, (ref_opts if with_options else ref)[0], lens, "bfloat16")
            return dict(accuracy, calls=repeats, first_call_s=round(first, 3),
                        mean_call_s=round(steady, 5))
        runner.case(f"decode/{tag}", case)

    for impl in ("xla", "pallas"):
        def write_case(impl=impl):
            write = jax.jit(functools.partial(pp.write_kv, impl=impl))
            n_tok = b + 3
            slots = rng.choice(num_blocks * bs, n_tok, replace=False).astype(np.int32)
            slots[-2:] = -1
            new = rng.standard_normal((2, n_tok, kvh, d)).astype(BF16)
            inputs = (k_cache, v_cache, jnp.asarray(new[0]), jnp.asarray(new[1]),
                      jnp.asarray(slots))
            first = [raw_bits(x) for x in write(*inputs)]
            mismatches = 0
            for _ in range(repeats - 1):
                again = write(*inputs)
                mismatches += int(any((raw_bits(x) != y).any() for x, y in zip(again, first)))
            check(mismatches == 0, f"{mismatches} of {repeats - 1} repeated writes differ")
            return dict(calls=repeats)
        runner.case(f"write/{impl}", write_case)


# --- main ------------------------------------------------------------------------------------

MODES = {"garbage": (mode_garbage,), "huge": (mode_huge,), "determinism": (mode_determinism,),
         "all": (mode_huge, mode_determinism)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--out", required=True, help="directory for the JSON summaries")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes: runs on a CPU (interpret mode) in a minute or two")
    parser.add_argument("-k", dest="only", default=None,
                        help="run only the cases whose name contains this")
    parser.add_argument("--repeats", type=int, default=20, help="calls per determinism case")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    print("environment:", json.dumps(env), flush=True)
    if env["backend"] != "gpu" and not args.small:
        print("no GPU visible to JAX: pass --small to run the shrunken cases in interpret mode",
              file=sys.stderr)
        return 2
    ok = True
    for fn in MODES[args.mode]:
        name = fn.__name__.removeprefix("mode_")
        runner = Runner(name, args.out, args, args.only)
        try:
            fn(args, runner)
        except Exception as e:  # noqa: BLE001  setup failed outside any case
            def reraise(e=e):
                raise e
            runner.case("setup", reraise, always=True)
        ok &= runner.summary()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
