"""Launch costs around the decode kernels (GPU only): A, the Triton kernel with the fp8 scales as
two operands against a copy of the module before (where an XLA concatenate stacked them); B, the
Mosaic path's whole call against its kernel call and against the query's preparation alone.

    git show 1b35fa5:pallas_paged/decode_attention/pallas_triton.py > DIR/pallas_triton_before.py
    PYTHONPATH=. python3 -m benchmarks.launch_cost DIR

Each kernel's own duration: ``ncu --clock-control none --metrics gpu__time_duration.sum --csv
python3 -m benchmarks.profile_kernel --shape b32_ctx4096 --impl mosaic --calls 2`` (the last
launches are one call's kernels).
"""
import functools
import importlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, sys.argv[1])
old = importlib.import_module("pallas_triton_before")
import pallas_paged as pp
from pallas_paged.decode_attention import pallas_triton as new, mosaic_gpu, api
from benchmarks.shapes import shape_by_name, make_decode_inputs
from benchmarks.timing import measure, measure_copy_bandwidth
from benchmarks.bench import Settings, compare

s = Settings()
copy = measure_copy_bandwidth(s.copy_bytes, s)["tbps"]
print(f"copy {copy:.3f} TB/s", flush=True)

def timed(label, fn, args, nbytes, ref=None):
    out = jax.block_until_ready(fn(*args))
    if ref is not None:
        o = out[0] if isinstance(out, tuple) else out
        c = compare(o, ref)
        assert c["correct"], (label, c)
    t = measure(lambda: fn(*args), 1, s)
    print(f"  {label:44s} {t.median_us:8.2f} us  {nbytes / (t.median_us * 1e-6) / 1e12 / copy:.3f} of copy", flush=True)
    return t.median_us

def setup(name):
    shape = shape_by_name(name)
    inputs = make_decode_inputs(shape, seed=0)
    args = inputs.args(0)
    nbytes = inputs.tokens_read() * shape.kv_bytes_per_token
    ks, vs = shape.scales
    return shape, args, nbytes, ks, vs

print("== A: Triton fp8, scales stacked (before) vs two operands", flush=True)
for name in ("fp8_b32_ctx4096", "fp8_b8_ctx16384"):
    shape, args, nbytes, ks, vs = setup(name)
    q, k, v, t, n = args
    cfg = api.picked_config(q, k, t, impl="pallas")
    ref = pp.decode(*args, impl="xla", k_scale=ks, v_scale=vs)
    kw = dict(scale=1 / np.sqrt(q.shape[2]), config=cfg, interpret=False, logits_soft_cap=None,
              alibi_slopes=None, sliding_window=None, sinks=None)
    fns = {m: jax.jit(lambda q, k, v, t, n, a, b, m=m: m.decode_pallas(q, k, v, t, n, k_scale=a, v_scale=b, **kw)[0])
           for m in (old, new)}
    sa, sb = jnp.float32(ks), jnp.float32(vs)
    print(name, cfg, flush=True)
    res = {"before": [], "after": []}
    for rep in range(3):
        res["before"].append(timed(f"before (stack) #{rep}", fns[old], (*args, sa, sb), nbytes, ref))
        res["after"].append(timed(f"after (two operands) #{rep}", fns[new], (*args, sa, sb), nbytes, ref))
    print(f"  medians: before {statistics.median(res['before']):.2f} after {statistics.median(res['after']):.2f}", flush=True)

print("== B: Mosaic, the whole call against its parts", flush=True)
for name in ("b32_ctx4096", "fp8_b32_ctx4096", "fp8_b8_ctx16384", "b1_ctx32768"):
    shape, args, nbytes, ks, vs = setup(name)
    q, k, v, t, n = args
    scales = {} if ks is None else dict(k_scale=ks, v_scale=vs)
    cfg = api.picked_config(q, k, t, impl="mosaic")
    print(name, cfg, flush=True)
    ref = pp.decode(*args, impl="xla", **scales)
    timed("triton decode", jax.jit(functools.partial(pp.decode, impl="pallas", **scales)), args, nbytes, ref)
    timed("mosaic decode", jax.jit(functools.partial(pp.decode, impl="mosaic", **scales)), args, nbytes, ref)
    kc = functools.partial(mosaic_gpu.decode_kernel_call, scale=1 / np.sqrt(q.shape[2]), config=cfg,
                           interpret=False, logits_soft_cap=None, alibi_slopes=None, sliding_window=None,
                           k_scale=None if ks is None else jnp.float32(ks))
    timed("mosaic kernel call (prep + kernel + transpose)", jax.jit(kc), args, nbytes)
    group = q.shape[1] // k.shape[2]
    rows = mosaic_gpu.query_rows(group, cfg)
    def prep(q):
        qg = q.reshape(q.shape[0], k.shape[2], group, q.shape[2])
        if ks is not None and q.dtype == jnp.bfloat16:
            q32 = qg.astype(jnp.float32)
            qm = jnp.max(jnp.abs(q32), axis=(2, 3))
            sh = jnp.exp2(jnp.maximum(jnp.ceil(jnp.log2(qm / 32768.0)), 0.0))
            return jnp.pad((q32 / sh[..., None, None]).astype(jnp.float16), ((0, 0), (0, 0), (0, rows - group), (0, 0))), sh
        return jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    timed("the query's preparation alone", jax.jit(prep), (q,), nbytes)
