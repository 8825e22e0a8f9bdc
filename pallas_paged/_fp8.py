"""fp8 caches: per-tensor scales as fp32 operands, and the quantization bit-identical to
`torch_ref.write_kv` in XLA (``impl="xla"``; the Pallas kernel quantizes the rows it loads itself,
``pallas_triton.py``, with the same arithmetic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def scale_operand(scale):
    """A validated per-tensor scale (python float or float32 array of shape () / (1,)) as an
    ``f32[]`` operand, or None for None.

    A python float becomes a numpy fp32 scalar (rounded to nearest, as ``torch.tensor(scale,
    dtype=torch.float32)`` does), so that, like an array, it is an argument of the jitted program
    rather than a constant compiled into it: one program serves every scale.
    """
    if scale is None:
        return None
    if isinstance(scale, (int, float)):
        return np.float32(scale)
    return jnp.reshape(scale, ())


def kernel_scale_operands(k_scale, v_scale):
    """``(k_scale, v_scale)`` (``f32[]`` operands, or None) as the two ``f32[1]`` operands of a
    Pallas kernel, or ``(None, None)``.

    Two reshapes, which cost nothing: stacking the scales into one array would be an XLA kernel of
    its own, launched before the attention or write kernel on every call.
    """
    if k_scale is None:
        return None, None
    return tuple(jnp.reshape(s, (1,)).astype(jnp.float32) for s in (k_scale, v_scale))


def quantize_fp8(x: jax.Array, scale) -> jax.Array:
    """``clamp(x / scale, -448, 448)`` in fp32, cast to float8_e4m3fn (round to nearest even).

    Args:
      x: any float array.
      scale: a python float or an ``f32[]`` / ``f32[1]`` array (traced or not), ``> 0``.

    The quotient must be the correctly rounded fp32 one, as torch's, for the caches to be
    bit-identical; XLA's division is not (it may become ``x * (1 / s)``, and on a GPU it is PTX's
    approximate ``div.full.f32``), so `divide_rn` corrects it. The quotient is then rounded onto
    the fp8 grid in fp32 (`round_to_fp8_grid`), so that the cast itself is exact whatever route a
    backend's conversion takes.
    """
    scale = jnp.reshape(jnp.asarray(scale, jnp.float32), ())
    scaled = clamp_to_fp8_range(divide_rn(x.astype(jnp.float32), scale))
    return round_to_fp8_grid(scaled).astype(jnp.float8_e4m3fn)


def clamp_to_fp8_range(x: jax.Array) -> jax.Array:
    """``clamp(x, -448, 448)`` that keeps NaN: two selects, not ``jnp.clip``, because Triton
    lowers ``maximum`` / ``minimum`` to ``maxnumf`` / ``minnumf``, which would turn NaN into
    -448, while a comparison with NaN is false and leaves it as it is."""
    return jnp.where(x > FP8_MAX, FP8_MAX, jnp.where(x < -FP8_MAX, -FP8_MAX, x))


# `divide_rn` corrects quotients of magnitude and divisors inside this range (products and half
# ulps stay normal fp32 numbers); fp8 needs |x / s| from 2**-10 (its last rounding tie) to 448.
EXACT_RANGE = (2.0**-60, 2.0**60)


def divide_rn(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` correctly rounded (IEEE fp32 round to nearest even), for fp32 ``x`` and an
    ``f32[]`` ``scale > 0``, from whatever quotient XLA computes (`correct_quotient`)."""
    return correct_quotient(x, scale, x / scale)


def correct_quotient(x: jax.Array, scale: jax.Array, q: jax.Array) -> jax.Array:
    """The correctly rounded ``x / scale`` from ``q``, an fp32 quotient within 2 ulps of it.

    Two steps of: compute the residual ``|x| - |q| * scale`` exactly (``x - p`` with ``p =
    RN(|q| scale)`` is exact by Sterbenz's lemma, and ``|q| scale - p`` is exact by Dekker's
    product, with ``q`` and ``scale`` split into 12-bit halves by masking, so every partial
    product is exact and a fused multiply-add of one changes nothing; ``p`` itself is computed
    behind an optimization barrier, so that ``x - p`` cannot become a fused multiply-add), then
    move ``q`` one ulp toward
    the true quotient when the residual is beyond half an ulp (times ``scale``), ties to even. A
    step moves a quotient 2 ulps off by one ulp and leaves one within an ulp exact. Quotients or
    divisors outside `EXACT_RANGE`, zeros, infinities and NaN are returned as ``q`` is.
    """
    for _ in range(2):
        q = _nudge_quotient(x, scale, q)
    return q


def _high_half(v):
    """``v`` with its 12 low mantissa bits cleared: 12 significant bits, and ``v - high`` has
    at most 12 too."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32) & jnp.uint32(0xFFFFF000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _nudge_quotient(x, s, q):
    """One correction step of `correct_quotient`."""
    ax, aq = jnp.abs(x), jnp.abs(q)
    # p leaves the fusion: a backend that fuses multiply-adds would otherwise turn ``ax - p`` into
    # fma(-aq, s, ax), already the residual, from which err would be subtracted a second time
    p = jax.lax.optimization_barrier(aq * s)
    qh, sh = _high_half(aq), _high_half(s)
    ql, sl = aq - qh, s - sh
    err = (((qh * sh - p) + qh * sl) + ql * sh) + ql * sl  # aq * s - p, exactly
    r = (ax - p) - err  # |x| - |q| * s, exactly
    bits = jax.lax.bitcast_convert_type(aq, jnp.uint32)
    ulp = jax.lax.bitcast_convert_type(bits & jnp.uint32(0x7F800000), jnp.float32) * 2.0**-23
    ulp_below = jnp.where(bits & jnp.uint32(0x7FFFFF), ulp, ulp * 0.5)  # a power of two's gap
    half_up, half_down = s * (ulp * 0.5), s * (ulp_below * 0.5)
    odd = (bits & jnp.uint32(1)) == 1
    up = (r > half_up) | ((r == half_up) & odd)
    down = (r < -half_down) | ((r == -half_down) & odd)
    moved = jnp.where(up, bits + jnp.uint32(1), jnp.where(down, bits - jnp.uint32(1), bits))
    nudged = jnp.copysign(jax.lax.bitcast_convert_type(moved, jnp.float32), q)
    lo, hi = EXACT_RANGE
    ok = (aq >= lo) & (aq <= hi) & (s >= lo) & (s <= hi)  # False for NaN, inf and zeros
    return jnp.where(ok, nudged, q)


def round_to_fp8_grid(x: jax.Array) -> jax.Array:
    """fp32 ``x`` (``|x| <= 448`` or NaN) rounded to the nearest float8_e4m3fn value, ties to
    even, computed in fp32 and integer arithmetic; NaN stays NaN.

    The result is exactly representable in fp8 (and in fp16), so the cast that follows cannot
    round again: XLA on a GPU converts fp32 to fp8 through fp16, and rounding twice moves values
    just off a tie onto the wrong side of it.

    - ``|x| >= 2**-6`` (fp8 normals): keep 3 of fp32's 23 mantissa bits, rounding the 20 dropped
      ones to nearest even on the bit pattern (a carry into the exponent is the right result).
    - ``|x| < 2**-6`` (fp8 subnormals, multiples of ``2**-9``): ``round_half_even(x * 2**9) /
      2**9``, exact since the scaling is by a power of two.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    odd = (bits >> 20) & 1
    kept = (bits + jnp.uint32(0x7FFFF) + odd) & jnp.uint32(0xFFF00000)
    normal = jax.lax.bitcast_convert_type(kept, jnp.float32)
    subnormal = jnp.round(x * 512.0) / 512.0
    rounded = jnp.where(jnp.abs(x) < 2.0**-6, subnormal, normal)
    return jnp.where(jnp.isnan(x), x, rounded)
