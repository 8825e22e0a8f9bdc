"""The Mosaic decode as it is against a copy of its module before (GPU only), and the Triton kernel,
alternated twice per shape, each row checked against ``impl="xla"``: in dispatch mode, or for the
shapes whose call is too short for it (``b1_ctx32768``: the host's dispatch would set the time) in
loop mode, 16 straight-line calls per dispatch over 2 copies of the inputs (`benchmarks.bench`'s).

    git show bb542ef:pallas_paged/decode_attention/mosaic_gpu.py > DIR/mosaic_before.py
    PYTHONPATH=. python3 -m benchmarks.mosaic_against DIR b32_ctx4096,fp8_b32_ctx4096
"""
import functools
import importlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, sys.argv[1])
old = importlib.import_module("mosaic_before")
import pallas_paged as pp
from pallas_paged.decode_attention import api
from benchmarks.shapes import shape_by_name, make_decode_inputs
from benchmarks.timing import measure, measure_copy_bandwidth
from benchmarks.bench import Settings, compare, loop_args, loop_reps, repeated

LOOP_SHAPES = {"b1_ctx32768"}
COPIES = 2

s = Settings()
copy = measure_copy_bandwidth(s.copy_bytes, s)["tbps"]
print(f"copy {copy:.3f} TB/s", flush=True)

def timed(label, fn, args, nbytes, ref, loop=None):
    """``fn(*args)`` checked against ``ref``, then timed: one call per dispatch, or with ``loop =
    (inputs, reps)`` ``reps`` straight-line calls per dispatch over the inputs' copies."""
    out = jax.block_until_ready(fn(*args))
    c = compare(out, ref)
    assert c["correct"], (label, c)
    if loop is None:
        t = measure(lambda: fn(*args), 1, s)
    else:
        inputs, reps = loop
        many, many_args = repeated(fn, reps), loop_args(inputs, COPIES, reps)
        t = measure(lambda: many(*many_args), reps, s)
    frac = nbytes / (t.median_us * 1e-6) / 1e12 / copy
    print(f"  {label:30s} {t.median_us:8.2f} us  {frac:.3f} of copy  rel_err {c['rel_err']:.1e}", flush=True)
    return t.median_us

shapes = sys.argv[2].split(",")
for name in shapes:
    shape = shape_by_name(name)
    inputs = make_decode_inputs(shape, seed=0, copies=COPIES if name in LOOP_SHAPES else 1)
    args = inputs.args(0)
    loop = (inputs, loop_reps(COPIES, s.loop_ops)) if name in LOOP_SHAPES else None
    nbytes = inputs.tokens_read() * shape.kv_bytes_per_token
    ks, vs = shape.scales
    scales = {} if ks is None else dict(k_scale=ks, v_scale=vs)
    q, k, v, t, n = args
    cfg = api.picked_config(q, k, t, impl="mosaic")
    print(name, cfg, flush=True)
    ref = pp.decode(*args, impl="xla", **scales)
    before = jax.jit(lambda q, k, v, t, n: old.decode_mosaic(
        q, k, v, t, n, scale=1 / np.sqrt(q.shape[2]), config=cfg, interpret=False,
        logits_soft_cap=None, alibi_slopes=None, sliding_window=None, sinks=None,
        k_scale=None if ks is None else jnp.float32(ks), v_scale=None if vs is None else jnp.float32(vs))[0])
    after = jax.jit(functools.partial(pp.decode, impl="mosaic", **scales))
    triton = jax.jit(functools.partial(pp.decode, impl="pallas", **scales))
    res = {"before": [], "after": [], "triton": []}
    for rep in range(2):
        res["before"].append(timed(f"mosaic before #{rep}", before, args, nbytes, ref, loop))
        res["after"].append(timed(f"mosaic now #{rep}", after, args, nbytes, ref, loop))
        res["triton"].append(timed(f"triton #{rep}", triton, args, nbytes, ref, loop))
    med = {k_: statistics.median(v_) for k_, v_ in res.items()}
    print("  medians: " + ", ".join(f"{k_} {v_:.2f} us ({nbytes / (v_ * 1e-6) / 1e12 / copy:.3f})" for k_, v_ in med.items()), flush=True)
