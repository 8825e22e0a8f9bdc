"""The benchmarks' one timer, their ceilings, and one JSON sanitizer.

- `measure`: warm-up batches, then ``windows`` timed windows, each two batches of back-to-back
  calls (N and 2N, each closed by one synchronization); the median over windows of the batches'
  time difference / (N * operations per call): the steady time of a call among others.
- Loop mode (`straight_line`, `per_call`, `loop_reps`): a call timed as one of ``reps``
  straight-line calls inside one jitted program, each on its own query array, rotating over
  copies of the inputs that together exceed the L2.
- `measure_copy_bandwidth`: the device's streaming ceiling (bytes read + written per second), the
  reference of every memory-bound figure. Measured every way the device allows in the same run:
  torch's device-to-device copy (when torch sees a CUDA GPU and one device is asked for) and
  jitted JAX copy and bitwise-not (which XLA cannot elide) into donated buffers, over one or
  several devices at once; ``tbps`` is the largest rate among the ways whose windows agree
  (`COPY_SPREAD_LIMIT`).
- `measure_read_bandwidth`: the streaming read rate (a float32 sum), by the same rule: how far
  above the copy a kernel that only reads can go.
- `measure_matmul_peak`: the bf16 matmul rate, the ceiling of compute-bound figures: torch's cuBLAS
  ``torch.mm`` where torch sees a CUDA GPU, JAX's ``jnp.dot`` beside it (never the ceiling while
  torch's rate exists).
- `jsonable`: numpy scalars and arrays, tuples and non-finite floats made JSON-safe.

docs/design/measurement.md gives the measurement behind each rule.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TimerSettings:
    """How `measure` times a call."""

    windows: int = 7           # timed windows (the median is reported)
    window_s: float = 0.010    # target duration of a window's longer batch
    warmup_s: float = 0.2      # untimed calls before the windows (clocks up, caches warm)
    min_calls: int = 3         # calls of a window's shorter batch, at least
    max_calls: int = 2000      # calls per batch (warm-up included), at most
    loop_ops: int = 16         # loop mode: at least this many calls per dispatch


# The timer of ``--smoke`` runs (interpret mode on a CPU): each call once or twice.
SMOKE_TIMER = TimerSettings(windows=2, window_s=0.0, warmup_s=0.0, min_calls=1, max_calls=1,
                            loop_ops=1)


@dataclasses.dataclass
class Timing:
    median_us: float      # steady time per operation: the median of the windows' differences
    min_us: float
    max_us: float
    windows_us: list
    calls_per_window: int  # calls of the shorter batch of a window (the longer has twice as many)
    ops_per_call: int
    batch_median_us: float  # the longer batches' own time per operation (start and wait included)


def measure(step, ops_per_call: int, s: TimerSettings, sync=jax.block_until_ready) -> Timing:
    """Time ``step()`` (one dispatch, returning what to wait for).

    Warm-up: batches of 1, 2, 4, ... calls until ``s.warmup_s`` has passed (compile before calling
    this); the last batch estimates the time per call, which sets the calls per batch. Each of
    ``s.windows`` windows then times two batches of back-to-back calls from an idle device, ``N``
    calls and ``2N`` (the longer one about ``s.window_s`` long; ``N`` within ``[s.min_calls,
    s.max_calls // 2]``, at least 1), each closed by one synchronization; the window's time per
    operation is their difference over ``N * ops_per_call``. What a batch pays once, whatever its
    length, cancels: the host's enqueue of the first dispatch while the device idles, and the
    wait at the end. What remains is the steady time of a call among back-to-back calls.
    ``batch_median_us`` keeps the longer batches' own time per operation (that fixed cost
    included). Only the last output of a batch is waited for: calls on one device run in order,
    and earlier outputs may already be donated (writes).

    Args:
      step: a function of no argument that dispatches the work once.
      ops_per_call: operations one call performs (a loop of several): times are per operation.
      s: the `TimerSettings`.
      sync: waits for ``step``'s output (``torch.cuda.synchronize`` for torch work).
    """
    def batch_seconds(calls: int) -> float:
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = step()
        sync(out)
        return time.perf_counter() - t0

    batch, spent = 1, 0.0
    while True:
        elapsed = batch_seconds(batch)
        spent += elapsed
        per_call = max(elapsed / batch, 1e-7)
        if spent >= s.warmup_s or batch >= s.max_calls:
            break
        batch *= 2
    calls = max(1, int(min(s.max_calls // 2,
                           max(s.min_calls, math.ceil(s.window_s / per_call / 2)))))
    steady, batched = [], []
    for _ in range(s.windows):
        short = batch_seconds(calls)
        long = batch_seconds(2 * calls)
        steady.append(max(long - short, 1e-9) / (calls * ops_per_call) * 1e6)
        batched.append(long / (2 * calls * ops_per_call) * 1e6)
    return Timing(median_us=statistics.median(steady), min_us=min(steady), max_us=max(steady),
                  windows_us=[round(u, 3) for u in steady], calls_per_window=calls,
                  ops_per_call=ops_per_call, batch_median_us=statistics.median(batched))


# ----------------------------------------------------------------------------------------------
# Loop mode


def loop_reps(copies: int, loop_ops: int) -> int:
    """Calls per dispatch in loop mode: at least ``loop_ops``, whole passes over the ``copies``."""
    return copies * max(1, math.ceil(loop_ops / copies))


def per_call(stacked, copies: int, reps: int) -> list:
    """``reps`` arrays for `straight_line`'s calls: call ``i`` gets its own device copy of
    ``stacked[i % copies]``. Calls on the same arrays would be identical pure computations, which
    XLA merges into one, so each call has its own query array."""
    return [jnp.array(stacked[i % copies], copy=True) for i in range(reps)]


def straight_line(call, reps: int):
    """A jitted ``f(qs, tables, *shared)`` (``qs``, ``tables``: lists of ``reps`` arrays) making
    ``reps`` calls ``call(qs[i], tables[i], *shared)`` in straight-line code, every output
    returned. XLA launches them back to back with no host round trip between calls, as a model's
    jitted step runs its layers (a ``fori_loop`` would copy its condition to the host every
    iteration)."""

    def run(qs, tables, *shared):
        return tuple(call(qs[i], tables[i], *shared) for i in range(reps))

    return jax.jit(run)


def describe_error(e: BaseException) -> str:
    """``Type: message`` of an exception, cut at 2000 characters, for a JSON record."""
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


# ----------------------------------------------------------------------------------------------
# Ceilings


def _rate(nbytes: int, timing: Timing, passes: int = 2) -> dict:
    """Bytes moved per second of one call that passes over ``nbytes`` ``passes`` times (a copy
    reads and writes them: 2; a sum reads them: 1), and how far the windows' times spread
    around their median (``(max - min) / median``: `COPY_SPREAD_LIMIT`)."""
    windows = timing.windows_us
    return {"median_us": timing.median_us, "windows_us": windows,
            "spread": (max(windows) - min(windows)) / timing.median_us,
            "tbps": passes * nbytes / (timing.median_us * 1e-6) / 1e12}


def _jax_copies(n: int, s, devices) -> dict:
    """Jitted copy and bitwise-not of ``n`` uint32 per device, on ``devices`` at once, each call
    writing into a donated buffer: the copy from a source buffer into the destination it is
    handed back, the not in place. Nothing is allocated per call, so the batches are as long as
    torch's (with a fresh output per call a window held a few calls, whose times spread too far:
    docs/design/measurement.md, "The copy ceiling's rule")."""
    results = {}
    total = n * len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    placement = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    src = jax.jit(lambda: jax.lax.iota(jnp.uint32, total) * jnp.uint32(2654435761),
                  out_shardings=placement)()
    zeros = jax.jit(lambda: jnp.zeros(total, jnp.uint32), out_shardings=placement)
    dst = zeros()
    sample = np.r_[0:512, total - 512:total]
    src_sample = np.asarray(src[sample])
    # name: (fn, its operands before the destination, the destination's sample after one call
    # given the sample before)
    ways = {"copy": (jax.jit(lambda x, into: jnp.copy(x), donate_argnums=1, keep_unused=True,
                             out_shardings=placement), (src,), lambda before: src_sample),
            "not": (jax.jit(jnp.bitwise_not, donate_argnums=0, out_shardings=placement), (),
                    lambda before: ~before)}
    for name, (fn, sources, expect) in ways.items():
        state = {"dst": dst}

        def step(fn=fn, sources=sources):  # each output is the next call's destination
            state["dst"] = fn(*sources, state["dst"])
            return state["dst"]
        try:
            expected = expect(np.asarray(dst[sample]))
            step()
            if len(devices) == 1 and state["dst"].unsafe_buffer_pointer() == \
                    src.unsafe_buffer_pointer():
                raise RuntimeError(f"jitted {name} returned its source buffer: nothing was copied")
            if not np.array_equal(np.asarray(state["dst"][sample]), expected):
                raise RuntimeError(f"jitted {name} produced wrong values")
            results[name] = _rate(4 * total, measure(step, 1, _copy_settings(s)))
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            results[name] = {"error": describe_error(e)}
        dst = zeros() if state["dst"].is_deleted() else state["dst"]
    src.delete()
    dst.delete()
    return results


def _torch_copy(n: int, s) -> dict | None:
    """torch's device-to-device copy of ``n`` int32 on the first CUDA device, or None when torch
    is absent or sees no GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    try:
        src = torch.arange(n, dtype=torch.int32, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize()
        if not torch.equal(dst[-512:], src[-512:]):
            raise RuntimeError("torch's copy produced wrong values")
        timing = measure(lambda: dst.copy_(src), 1, _copy_settings(s),
                         sync=lambda _: torch.cuda.synchronize())
        return _rate(4 * n, timing)
    except Exception as e:  # noqa: BLE001
        return {"error": describe_error(e)}
    finally:
        src = dst = None
        torch.cuda.empty_cache()


# A ceiling's windows are this many times as long as ``s.window_s`` (default 10 ms -> 100 ms).
# Each call of the jitted JAX copies times within a few percent of the next, so their windows
# must hold many calls for the median to settle; the buffers are donated, so a window's length
# costs no memory.
COPY_WINDOW_FACTOR = 10


def _copy_settings(s: TimerSettings) -> TimerSettings:
    """The ceilings' `TimerSettings`: ``s``'s, with windows `COPY_WINDOW_FACTOR` times as long."""
    return dataclasses.replace(s, window_s=s.window_s * COPY_WINDOW_FACTOR)


COPY_WAYS = ("torch_copy", "copy", "not")  # `measure_copy_bandwidth`'s ways, by their keys

# The most a copy way's windows may spread, ``(max - min) / median``, for its rate to count
# toward the ceiling. The ceiling is the fastest copy the device does, so it must not be the
# fastest timing error (docs/design/measurement.md, "The copy ceiling's rule").
COPY_SPREAD_LIMIT = 0.05


def measure_copy_bandwidth(nbytes: int, s: TimerSettings, devices=None) -> dict:
    """The copy bandwidth (TB/s of bytes read + written) over ``nbytes`` per device.

    Args:
      nbytes: the buffer copied on each device.
      s: timer settings (see `measure`).
      devices: JAX devices copying at once (default: the first device). torch's copy is measured
        only for one device, when torch sees a CUDA GPU.

    Returns:
      ``{"bytes", "devices", "copy", "not"[, "torch_copy"], "tbps", "source", "imprecise"}``
      (``copy``, ``not``: the jitted JAX ones): each way's median time, windows, their spread
      and its rate (or its error); ``tbps``, the largest rate of the ways whose windows spread
      by at most `COPY_SPREAD_LIMIT`, and which way gave it (``imprecise``: no way was that
      precise, and ``tbps`` is the largest of all). Never raises: ``tbps`` is NaN when nothing
      could be measured.
    """
    devices = list(devices or jax.devices()[:1])
    n = max(1024, nbytes // 4)
    result = {"bytes": 4 * n, "devices": len(devices)}
    try:
        result.update(_jax_copies(n, s, devices))
    except Exception as e:  # noqa: BLE001
        result["jax_error"] = describe_error(e)
    if len(devices) == 1 and devices[0].platform == "gpu":
        torch_result = _torch_copy(n, s)
        if torch_result is not None:
            result["torch_copy"] = torch_result
    result.update(copy_ceiling(result))
    return result


def copy_ceiling(ways: dict, keys: tuple = COPY_WAYS) -> dict:
    """The ceiling of `measure_copy_bandwidth`'s result ``ways`` (its ``keys`` entries
    ``{"tbps", "spread", ...}``; failed ways are skipped): ``{"source", "tbps", "imprecise"}``,
    the largest rate among the ways whose windows spread by at most `COPY_SPREAD_LIMIT`, or,
    when none does (``imprecise``), among all; ``tbps`` NaN and ``source`` None when no way
    measured. `measure_read_bandwidth` picks its rate by the same rule (``keys=READ_WAYS``)."""
    measured = {k: ways[k] for k in keys if "tbps" in ways.get(k, {})}
    precise = {k: v for k, v in measured.items() if v["spread"] <= COPY_SPREAD_LIMIT}
    rates = {k: v["tbps"] for k, v in (precise or measured).items()}
    if not rates:
        return {"source": None, "tbps": float("nan"), "imprecise": False}
    source = max(rates, key=rates.get)
    return {"source": source, "tbps": rates[source], "imprecise": not precise}


def copy_summary(result: dict, keys: tuple = COPY_WAYS) -> str:
    """`measure_copy_bandwidth`'s result in one line: the ceiling, the way that gave it, then
    every way's rate and windows' spread (``imprecise`` when no way met `COPY_SPREAD_LIMIT`);
    ``keys``: the ways to show."""
    ways = [f"{k} {result[k]['tbps']:.3f} (spread {100 * result[k]['spread']:.1f}%)"
            if "tbps" in result[k] else f"{k} failed" for k in keys if k in result]
    flag = "; imprecise" if result.get("imprecise") else ""
    return f"{result['tbps']:.3f} TB/s ({result['source']}{flag}; {', '.join(ways)})"


READ_WAYS = ("torch_sum", "sum")  # `measure_read_bandwidth`'s ways, by their keys


def _counts(total: float, n: int) -> bool:
    """Whether a float32 sum of ``n`` ones is ``n``, up to float32's rounding of partial sums
    past 2**24 (relative 1e-5)."""
    return abs(total - n) <= 1e-5 * n


def measure_read_bandwidth(nbytes: int, s: TimerSettings) -> dict:
    """The streaming read rate (TB/s of bytes read) over ``nbytes`` on the first device: a sum of
    ``nbytes / 4`` float32 ones to one number, by torch (``torch_sum``, when torch sees a CUDA
    GPU) and by a jitted ``jnp.sum`` (``sum``), each checked against the count. Not a ceiling
    of this project's figures (those are fractions of `measure_copy_bandwidth`): it says how far
    above a copy a kernel that only reads can go on this device (decode reads its K/V and writes
    almost nothing, so its fraction of the copy can exceed 1).

    Returns:
      ``{"bytes", "torch_sum"?, "sum", "tbps", "source", "imprecise"}``: each way's median time,
      windows, spread and rate (or its error); ``tbps``, ``source`` and ``imprecise`` as
      `copy_ceiling` picks them among these ways. Never raises.
    """
    n = max(1024, nbytes // 4)
    result = {"bytes": 4 * n}
    try:
        ones = jnp.ones(n, jnp.float32)
        total = jax.jit(jnp.sum)
        if not _counts(float(total(ones)), n):
            raise RuntimeError(f"jitted sum of {n} ones gave {float(total(ones))}")
        result["sum"] = _rate(4 * n, measure(lambda: total(ones), 1, _copy_settings(s)), 1)
        ones.delete()
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        result["sum"] = {"error": describe_error(e)}
    try:
        import torch
        if torch.cuda.is_available():
            ones = torch.ones(n, dtype=torch.float32, device="cuda")
            if not _counts(float(ones.sum()), n):
                raise RuntimeError(f"torch's sum of {n} ones gave {float(ones.sum())}")
            timing = measure(ones.sum, 1, _copy_settings(s),
                             sync=lambda _: torch.cuda.synchronize())
            result["torch_sum"] = _rate(4 * n, timing, 1)
            ones = None
            torch.cuda.empty_cache()
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001
        result["torch_sum"] = {"error": describe_error(e)}
    result.update(copy_ceiling(result, READ_WAYS))
    return result


def read_summary(result: dict) -> str:
    """`measure_read_bandwidth`'s result in one line, as `copy_summary` writes a copy's."""
    return copy_summary(result, READ_WAYS).replace(" TB/s (", " TB/s read (", 1)


MATMUL_N = 8192  # `measure_matmul_peak`'s product: [N, N] @ [N, N] in bf16
MATMUL_WAYS = ("torch_mm", "jnp_dot")  # `measure_matmul_peak`'s ways, by their keys


def _matmul_rate(n: int, timing: Timing) -> dict:
    """``2 n^3`` FLOP per call over the median time, the windows and their spread."""
    windows = timing.windows_us
    return {"median_us": timing.median_us, "windows_us": windows,
            "spread": (max(windows) - min(windows)) / timing.median_us,
            "tflops": 2.0 * n**3 / (timing.median_us * 1e-6) / 1e12}


def _product_ok(first_row, a_row, b) -> bool:
    """Whether a product's first row matches float32 arithmetic on the same bf16 operands."""
    want = np.asarray(a_row, np.float32) @ np.asarray(b, np.float32)  # f32[n]
    got = np.asarray(first_row, np.float32)
    return bool(np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want))


def _torch_mm(n: int, s: TimerSettings) -> dict | None:
    """cuBLAS's bf16 ``torch.mm`` (fp32 accumulation, cuBLAS's default) on the first CUDA device,
    or None when torch is absent or sees no GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = b = out = None
    try:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)  # bf16[n, n]
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)  # bf16[n, n]
        out = torch.mm(a, b)  # bf16[n, n]
        if not _product_ok(out[0].float().cpu(), a[0].float().cpu(), b.float().cpu()):
            raise RuntimeError("torch.mm produced wrong values")
        timing = measure(lambda: torch.mm(a, b, out=out), 1, _copy_settings(s),
                         sync=lambda _: torch.cuda.synchronize())
        return _matmul_rate(n, timing)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return {"error": describe_error(e)}
    finally:
        a = b = out = None
        torch.cuda.empty_cache()


def _jnp_dot(n: int, s: TimerSettings) -> dict:
    """A jitted ``jnp.dot`` of bf16 operands with ``preferred_element_type=f32``, cast to bf16."""
    try:
        ka, kb = jax.random.split(jax.random.key(1))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)  # bf16[n, n]
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)  # bf16[n, n]
        product = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)
                          .astype(jnp.bfloat16))
        out = product(a, b)
        if not _product_ok(out[0], a[0], b):
            raise RuntimeError("jnp.dot produced wrong values")
        return _matmul_rate(n, measure(lambda: product(a, b), 1, _copy_settings(s)))
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return {"error": describe_error(e)}


def measure_matmul_peak(s: TimerSettings, n: int = MATMUL_N) -> dict:
    """The bf16 matmul rate (TFLOP/s) of an ``[n, n] @ [n, n]`` product on the first device, the
    fastest way the device allows: torch's cuBLAS ``torch.mm`` (``torch_mm``, when torch sees a
    CUDA GPU) and a jitted ``jnp.dot`` (``jnp_dot``), both with fp32 accumulation, each checked
    on its first row.

    Returns:
      ``{"n", "torch_mm"?, "jnp_dot", "tflops", "source"}``: each way's median time, windows,
      their spread and its rate (or its error); ``tflops`` and ``source`` as `matmul_ceiling`
      picks them. Never raises.
    """
    result = {"n": n, "jnp_dot": _jnp_dot(n, s)}
    torch_result = _torch_mm(n, s) if jax.devices()[0].platform == "gpu" else None
    if torch_result is not None:
        result["torch_mm"] = torch_result
    result.update(matmul_ceiling(result))
    return result


def matmul_ceiling(ways: dict) -> dict:
    """The matmul ceiling of `measure_matmul_peak`'s result: torch's cuBLAS rate where it was
    measured, else ``jnp.dot``'s (XLA's product runs slower than cuBLAS's on the same device, so
    it is a ceiling only where torch has no GPU); ``tflops`` NaN and ``source`` None when neither
    was."""
    for key in MATMUL_WAYS:
        if "tflops" in ways.get(key, {}):
            return {"source": key, "tflops": ways[key]["tflops"]}
    return {"source": None, "tflops": float("nan")}


def matmul_summary(result: dict) -> str:
    """`measure_matmul_peak`'s result in one line, as `copy_summary` writes a copy's."""
    ways = [f"{k} {result[k]['tflops']:.1f} (spread {100 * result[k]['spread']:.1f}%)"
            if "tflops" in result[k] else f"{k} failed" for k in MATMUL_WAYS if k in result]
    return f"{result['tflops']:.1f} TFLOP/s ({result['source']}; {', '.join(ways)})"


def jsonable(x):
    """``x`` with numpy scalars and arrays as Python numbers and lists, tuples as lists, dict keys
    as strings and non-finite floats as the strings ``"inf"``, ``"-inf"``, ``"nan"`` (JSON has no
    such numbers); anything else unknown as its ``str``."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else str(x)
    if x is None or isinstance(x, str):
        return x
    return str(x)
