"""MHA decode against the same cache read as kv-head pairs: one probe, kept for the record.

An MHA cache ``[blocks, bs, 32, 128]`` is also ``[blocks, bs, 16, 256]`` (a free reshape): each
token's two neighbouring kv heads become one 512-byte row. With a block-diagonal query (head
``h`` holds ``q_h`` in half ``h % 2`` of 256 columns and zeros in the other), group-2 decode over
the pairs gives each head's scores exactly, and its output's half ``h % 2`` is head ``h``'s
output. The same bytes, read in 512-byte runs instead of 256. Hypothesis: longer runs stream
closer to the device's read rate (``copy_bandwidth --read``). Each row is checked against the
MHA call.

    PYTHONPATH=. python3 -m benchmarks.mha_pairs            # on the GPU
    PYTHONPATH=. python3 -m benchmarks.mha_pairs --smoke    # a tiny MHA shape, interpret mode
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import pallas_paged as pp
from benchmarks.bench import Settings, config_label, parse_decode_config, smoke_settings
from benchmarks.shapes import make_decode_inputs, shape_by_name
from benchmarks.timing import (copy_summary, measure, measure_copy_bandwidth,
                               measure_read_bandwidth, read_summary)
from pallas_paged.decode_attention.api import picked_config
from pallas_paged.decode_attention.configs import DecodeConfig

MHA_CONFIGS = (None, "bk128/s1/w4/st3", "bk64/s1/w4/st2")
PAIR_CONFIGS = (None, "bk64/s1/w4/st2", "bk32/s1/w4/st3", "bk64/s1/w8/st2", "bk32/s1/w4/st2",
                "bk64/s1/w4/st3", "bk128/s1/w8/st2", "bk32/s1/w2/st3")


def pair_query(q):
    """``[B, H, D] -> [B, H, 2D]``: head ``h``'s query in half ``h % 2``, zeros in the other."""
    zeros = jnp.zeros_like(q)
    odd = (jnp.arange(q.shape[1]) % 2 == 1)[None, :, None]
    return jnp.where(odd, jnp.concatenate([zeros, q], -1), jnp.concatenate([q, zeros], -1))


def unpair_output(out, head_dim: int):
    """``[B, H, 2D] -> [B, H, D]``: half ``h % 2`` of head ``h``'s row."""
    odd = (jnp.arange(out.shape[1]) % 2 == 1)[None, :, None]
    return jnp.where(odd, out[..., head_dim:], out[..., :head_dim])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny MHA shape, interpret mode")
    args = parser.parse_args(argv)
    s = smoke_settings(Settings()) if args.smoke else Settings()
    nbytes = 1 << 20 if args.smoke else 4 << 30
    copy = measure_copy_bandwidth(nbytes, s)
    read = measure_read_bandwidth(nbytes, s)
    print(f"copy {copy_summary(copy)}\nread {read_summary(read)}", flush=True)
    shape = shape_by_name("small_mha_b2_ctx64" if args.smoke else "mha_b32_ctx4096")
    q, k, v, tables, lens = make_decode_inputs(shape, 0).args(0)
    _, heads, head_dim = q.shape
    k2 = k.reshape(*k.shape[:2], heads // 2, 2 * head_dim)
    v2 = v.reshape(*v.shape[:2], heads // 2, 2 * head_dim)
    q2 = pair_query(q)
    scale = head_dim ** -0.5
    nread = 2 * int(lens.sum()) * heads * head_dim * k.dtype.itemsize
    print(f"{shape.describe()}; picked: MHA {config_label(picked_config(q, k, tables))}, "
          f"pairs {config_label(picked_config(q2, k2, tables))}", flush=True)

    def decode(label):
        config = None if label is None else DecodeConfig(**parse_decode_config(label))
        return jax.jit(lambda *a: pp.decode(*a, scale=scale, impl="pallas", config=config))

    reference = decode(None)(q, k, v, tables, lens).astype(jnp.float32)
    worst = 0.0
    for name, labels, operands, unpair in (
            ("MHA", MHA_CONFIGS, (q, k, v, tables, lens), lambda o: o),
            ("pairs", PAIR_CONFIGS, (q2, k2, v2, tables, lens),
             lambda o: unpair_output(o, head_dim))):
        for label in labels:
            fn = decode(label)
            err = float(jnp.max(jnp.abs(unpair(fn(*operands)).astype(jnp.float32) - reference)))
            worst = max(worst, err)
            t = measure(lambda fn=fn, operands=operands: fn(*operands), 1, s)
            print(f"{name:5s} {label or 'picked':18s} {t.median_us:8.1f} µs "
                  f"({t.min_us:.1f}-{t.max_us:.1f}), {nread / t.median_us / 1e6 / copy['tbps']:.3f} "
                  f"of copy, {nread / t.median_us / 1e6 / read['tbps']:.3f} of read; "
                  f"max |out - MHA picked| {err:.2e}", flush=True)
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
