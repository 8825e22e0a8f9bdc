"""The benchmarks: every command's ``--smoke`` run end to end on this device (interpret mode on a
CPU: the numbers mean nothing, the plumbing must work) through its ``main(argv)``, the timer and
the ceilings' rules, the shapes and their inputs, tune's table printer and rewriter (on a copy of
a config module), and the profiling tools' parsers.

The Mosaic GPU kernel needs jax >= 0.11.2: where this jax is older, its rows say why they were
skipped, and the tests that run the kernel are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged as pp
from benchmarks import _cli, ceilings, decode, ragged, shapes, timing, tune, write
from pallas_paged import (AttentionConfig, DecodeConfig, MosaicAttentionConfig, MosaicDecodeConfig,
                          _mosaic_common)
from pallas_paged.ragged_attention import mosaic_gpu as ragged_mosaic
from pallas_paged._triton_common import kv_ring_depth
from pallas_paged.decode_attention.api import select_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_API = _mosaic_common.jax_version() >= _mosaic_common.MIN_JAX  # the Mosaic kernel runs
needs_mosaic = pytest.mark.skipif(not KERNEL_API, reason=f"impl='mosaic' needs jax >= 0.11.2;"
                                                         f" this is jax {jax.__version__}")
SMOKE_SHAPE = "smoke_b2_ctx64"
# The decode shapes by name: docs/PERFORMANCE.md's tables and the tuned tables' evidence.
DECODE_NAMES = ("b32_ctx4096", "b64_ctx2048", "b8_ctx16384", "b128_ctx1024", "b1_ctx32768",
                "b256_ctx512", "mha_b32_ctx4096", "bs64_b32_ctx4096", "b4_ctx131072",
                "ragged_b64_ctx8192", "fp16_b32_ctx4096", "d64_b32_ctx4096", "d256_b32_ctx4096",
                "fp8_b32_ctx4096", "fp8_b8_ctx16384", "swa1024_b8_ctx32768", "b8_ctx1024",
                "b64_ctx8192")
RAGGED_NAMES = ("prefill_b4_q2048", "chunk_b1_q2048_ctx32768", "mixed_4x512c2560_60dec4096",
                "spec_b32_q4_ctx4096", "decode_b32_ctx4096", "fp8_mixed_4x512c2560_60dec4096",
                "fp8_decode_b32_ctx4096", "d256_decode_b32_ctx4096")
# What a decode name leaves unsaid: 32 query heads, 8 kv heads, head_dim 128, block size 16, bf16,
# full attention, equal lengths; smoke shapes 8 query heads on 2, head_dim 64.
MODEL = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
             sliding_window=None, ragged=False)
SMOKE_MODEL = dict(MODEL, num_heads=8, num_kv_heads=2, head_dim=64)


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _rows(doc: dict) -> dict:
    return {(r["shape"], r["impl"]): r for r in doc["rows"]}


# ----------------------------------------------------------------------------------------------
# Shapes and inputs


def test_shape_names_are_unique_and_the_documented_ones():
    every = (shapes.DECODE_SHAPES + shapes.DECODE_SMOKE + shapes.RAGGED_SHAPES
             + shapes.RAGGED_SMOKE + (shapes.WRITE_SHAPE, shapes.WRITE_SMOKE))
    names = [s.name for s in every]
    assert len(names) == len(set(names))
    assert tuple(s.name for s in shapes.DECODE_SHAPES) == DECODE_NAMES
    assert tuple(s.name for s in shapes.RAGGED_SHAPES) == RAGGED_NAMES
    assert all(shapes.shape_by_name(n).name == n for n in names if not n.endswith("_t64")
               and not n.startswith("write_"))
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.shape_by_name("b3_ctx5")


def _named_parameters(name: str) -> dict:
    """The parameters a decode name states: ``b<batch>``, ``ctx<context>``, ``mha`` (as many kv
    heads as query heads), ``bs<n>``, ``d<n>``, ``fp16``, ``fp8``, ``swa<W>``, ``ragged``; the
    rest is the model's (a ``smoke_`` prefix: the smoke model)."""
    tokens = name.split("_")
    params = dict(SMOKE_MODEL if tokens[0] == "smoke" else MODEL)
    for token in tokens[tokens[0] == "smoke":]:
        for prefix, field in (("ctx", "context"), ("bs", "block_size"), ("swa", "sliding_window"),
                              ("b", "batch"), ("d", "head_dim")):
            if token.startswith(prefix) and token[len(prefix):].isdigit():
                params[field] = int(token[len(prefix):])
                break
        else:
            extra = {"mha": dict(mha=True), "ragged": dict(ragged=True),
                     "fp16": dict(dtype="float16"), "fp8": dict(dtype="float8_e4m3fn")}
            assert token in extra, f"{name}: unknown name token {token!r}"
            params.update(extra[token])
    return params


@pytest.mark.parametrize("shape", shapes.DECODE_SHAPES + shapes.DECODE_SMOKE,
                         ids=lambda s: s.name)
def test_decode_names_state_their_parameters(shape):
    expected = _named_parameters(shape.name)
    if expected.pop("mha", False):
        assert shape.num_kv_heads == shape.num_heads
        del expected["num_heads"], expected["num_kv_heads"]
    assert {k: getattr(shape, k) for k in expected} == expected


def test_smoke_shapes_cover_the_features():
    smoke = shapes.DECODE_SMOKE
    assert any(s.ragged for s in smoke) and any(s.sliding_window for s in smoke)
    assert any(s.dtype == "float8_e4m3fn" for s in smoke) and any(s.group == 1 for s in smoke)
    assert all(s.head_dim == 64 and s.block_size == 16 for s in smoke)  # Mosaic takes them
    assert any(not s.is_decode for s in shapes.RAGGED_SMOKE)
    assert any(s.dtype == "float8_e4m3fn" for s in shapes.RAGGED_SMOKE)


@pytest.mark.parametrize("bad", [dict(num_heads=6, num_kv_heads=4), dict(batch=0),
                                 dict(dtype="int8"), dict(sliding_window=0)])
def test_decode_shape_rejects_bad_parameters(bad):
    params = dict(name="x", batch=2, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                  context=64) | bad
    with pytest.raises(ValueError):
        shapes.DecodeBenchShape(**params)


@pytest.mark.parametrize("name,copies", [("smoke_ragged_b4_ctx96", 3), ("smoke_fp8_b2_ctx64", 2)])
def test_decode_inputs_are_well_formed(name, copies):
    shape = shapes.shape_by_name(name)
    inputs = shapes.make_decode_inputs(shape, seed=3, copies=copies)
    tables, lens = inputs.block_tables_np, inputs.context_lens_np
    assert tables.shape == (copies, shape.batch, shape.max_blocks) and tables.dtype == np.int32
    assert lens.dtype == np.int32 and (lens >= 1).all() and (lens <= shape.context).all()
    pages = -(-lens // shape.block_size)
    used = np.arange(shape.max_blocks)[None, :] < pages[:, None]  # [B, max_blocks]
    valid = tables[:, used]
    assert len(np.unique(valid)) == valid.size == copies * pages.sum()  # no block shared
    assert (valid >= 0).all() and (valid < inputs.num_blocks).all()
    assert (tables[:, ~used] == 0).all()  # tails: block 0, which JAX's kernel may read
    assert not (np.diff(valid.reshape(-1)) == 1).all()  # shuffled
    q, k_cache, v_cache, block_tables, context_lens = inputs.args(copies - 1)
    assert q.shape == (shape.batch, shape.num_heads, shape.head_dim)
    assert q.dtype == jnp.dtype(shape.query_dtype) and k_cache.dtype == jnp.dtype(shape.dtype)
    assert k_cache.shape == v_cache.shape == (inputs.num_blocks, shape.block_size,
                                              shape.num_kv_heads, shape.head_dim)
    np.testing.assert_array_equal(np.asarray(block_tables), tables[copies - 1])
    k = np.asarray(k_cache).astype(np.float32) * inputs.scales.get("k_scale", 1.0)
    assert np.isfinite(k).all() and 0.8 < k.std() < 1.2  # N(0, 1) as attention sees it
    assert not np.array_equal(np.asarray(inputs.q[0]), np.asarray(inputs.q[1]))
    again = shapes.make_decode_inputs(shape, seed=3, copies=copies)
    np.testing.assert_array_equal(np.asarray(again.k_cache).astype(np.float32),
                                  np.asarray(k_cache).astype(np.float32))


def test_ragged_inputs_and_work():
    shape = shapes.shape_by_name("smoke_mixed_2x8c20_6dec30")
    inputs = shapes.make_ragged_inputs(shape, seed=1, copies=2)
    q_lens, lens = shape.lengths()
    np.testing.assert_array_equal(inputs.query_start_loc_np, np.r_[0, np.cumsum(q_lens)])
    assert inputs.q.shape == (2, q_lens.sum(), shape.num_heads, shape.head_dim)
    assert inputs.block_tables.shape[:2] == (2, len(lens))
    pairs = sum(min(p + 1, n) for q, n in zip(q_lens, lens) for p in range(n - q, n))
    work = shape.work()
    assert work["pairs"] == pairs and work["flops"] == 4 * shape.head_dim * shape.num_heads * pairs
    assert shape.is_decode is False and shapes.shape_by_name("smoke_decode_b4_ctx40").is_decode


@pytest.mark.parametrize("name", ["smoke_swa16_b2_ctx128", "smoke_fp8_mixed_2x8c20_6dec30"])
def test_the_reference_rows_are_the_xla_paths_answer(name):
    """What every row is checked against (the float64 oracle on some rows of the last copy)
    agrees with the XLA path there, windows, fp8 scales and ragged rows included."""
    shape = shapes.shape_by_name(name)
    ragged_shape = isinstance(shape, shapes.RaggedBenchShape)
    inputs = (shapes.make_ragged_inputs if ragged_shape else shapes.make_decode_inputs)(
        shape, seed=0, copies=2)
    rows, values = inputs.reference()
    if ragged_shape:
        out = pp.paged_attention(*inputs.args(1), impl="xla", **shape.scales)
        assert len(rows) > len(set(rows.tolist())) / 2 and values.shape[0] == len(rows)
    else:
        out = pp.decode(*inputs.args(1), impl="xla", sliding_window=shape.sliding_window,
                        **shape.scales)
        np.testing.assert_array_equal(rows, np.arange(min(shapes.REF_ROWS, shape.batch)))
    assert _cli.compare(np.asarray(out)[rows], values)["rel_err"] < 1e-2
    assert not _cli.compare(np.asarray(out)[rows] + 0.5, values)["correct"]


def test_write_inputs_hold_the_ties_and_the_specials():
    rng = np.random.default_rng(0)
    rows = shapes.write_rows(rng, (64, 2, 32), np.float32, 0.25)
    assert np.isnan(rows).any() and np.isinf(rows).any() and (np.abs(rows) == 1e4).any()
    ties = np.float32(0.25) * np.array([-432.0, -0.0009765625, 0.0009765625, 1.0625, 432.0],
                                       np.float32)  # midpoints of fp8 neighbours
    assert np.isin(rows, ties).sum() >= 3
    slots = shapes.write_slots(rng, shapes.WRITE_SMOKE)
    assert slots.shape == (shapes.WRITE_SMOKE.reps, shapes.WRITE_SMOKE.tokens)
    assert len(np.unique(slots)) == slots.size
    assert slots.max() < shapes.WRITE_SMOKE.num_blocks * shapes.WRITE_SMOKE.block_size


def test_sharded_pools_hold_local_ids():
    tables = shapes.SHARDED_SMOKE.pool_tables(np.random.default_rng(0), 2)
    per_pool = shapes.SHARDED_SMOKE.batch // 2 * shapes.SHARDED_SMOKE.blocks_per_seq
    for pool in np.split(tables, 2):
        assert sorted(pool.reshape(-1)) == list(range(per_pool))


# ----------------------------------------------------------------------------------------------
# The timer and the ceilings


def test_measure_removes_what_a_batch_pays_once(monkeypatch):
    """The steady figure is the time of a call among others: a fixed cost paid once per batch
    (40 ms at the batch's end) cancels, where the batches' own time keeps its share. On a
    virtual clock (a call advances it 2 ms, the batch's end 40 ms), so a loaded machine's
    timing cannot move the figures."""
    clock = [0.0]

    def advance(seconds):
        clock[0] += seconds

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    s = timing.TimerSettings(windows=3, window_s=0.04, warmup_s=0.0, min_calls=4, max_calls=64)
    t = timing.measure(lambda: advance(0.002), 1, s, sync=lambda _: advance(0.04))
    assert t.median_us == pytest.approx(2000, rel=1e-6)
    assert t.batch_median_us > t.median_us + 0.6 * 40000 / (2 * t.calls_per_window)
    assert len(t.windows_us) == 3 and t.min_us <= t.median_us <= t.max_us


def test_loop_mode_runs_its_calls_in_one_program_each_on_its_own_query():
    assert timing.loop_reps(1, 16) == 16 and timing.loop_reps(3, 16) == 18
    stacked = jnp.arange(6.0).reshape(2, 3)
    qs = timing.per_call(stacked, copies=2, reps=4)
    assert len({q.unsafe_buffer_pointer() for q in qs}) == 4  # own buffers: never merged
    fn = timing.straight_line(lambda q, t, scale: q * scale + t, reps=4)
    out = fn(qs, [jnp.float32(i) for i in range(4)], jnp.float32(2.0))
    assert len(out) == 4 and np.asarray(out[3]).tolist() == [9.0, 11.0, 13.0]


def test_copy_bandwidth_measures_every_jax_way():
    s = timing.TimerSettings(windows=3, window_s=0.0, warmup_s=0.0, min_calls=1, max_calls=8)
    result = timing.measure_copy_bandwidth(1 << 20, s)
    ways = ("copy", "not") + (("torch_copy",) if "torch_copy" in result else ())
    for way in ways:
        assert _finite_positive(result[way]["tbps"]), result[way]
        windows = result[way]["windows_us"]
        assert len(windows) == 3 and result[way]["spread"] == pytest.approx(
            (max(windows) - min(windows)) / result[way]["median_us"])
    assert {k: result[k] for k in ("source", "tbps", "imprecise")} == timing.copy_ceiling(result)


def test_copy_ceiling_is_the_fastest_way_whose_windows_agree():
    """A way whose windows spread past `COPY_SPREAD_LIMIT` does not set the ceiling however fast
    its median; with no precise way, the largest of all, flagged."""
    ways = {"torch_copy": {"tbps": 4.30, "spread": 0.003},
            "copy": {"tbps": 4.41, "spread": 0.48},  # fastest, but its windows disagree
            "not": {"tbps": 4.29, "spread": timing.COPY_SPREAD_LIMIT},  # at the limit: counts
            "bytes": 1 << 32, "jax_error": "not a way"}
    assert timing.copy_ceiling(ways) == {"source": "torch_copy", "tbps": 4.30, "imprecise": False}
    ways["not"]["tbps"] = 4.35
    assert timing.copy_ceiling(ways) == {"source": "not", "tbps": 4.35, "imprecise": False}
    noisy = {k: {"tbps": v["tbps"], "spread": 0.2} for k, v in ways.items()
             if isinstance(v, dict)}
    assert timing.copy_ceiling(noisy) == {"source": "copy", "tbps": 4.41, "imprecise": True}
    result = timing.copy_ceiling({"copy": {"error": "RuntimeError: x"}, "bytes": 1})
    assert result["source"] is None and math.isnan(result["tbps"]) and not result["imprecise"]


def test_read_bandwidth_sums_the_bytes_once(monkeypatch):
    s = timing.TimerSettings(windows=3, window_s=0.0, warmup_s=0.0, min_calls=1, max_calls=8)
    result = timing.measure_read_bandwidth(1 << 20, s)
    way = result["sum"]
    assert way["tbps"] == pytest.approx((1 << 20) / (way["median_us"] * 1e-6) / 1e12)
    assert result["source"] in timing.READ_WAYS
    assert timing.read_summary(result).startswith(f"{result['tbps']:.3f} TB/s read (")
    monkeypatch.setattr(timing.jnp, "sum", lambda x: x[:-1024].sum())  # a sum that skips bytes
    result = timing.measure_read_bandwidth(1 << 20, s)
    assert "gave" in result["sum"]["error"] and "tbps" not in result["sum"]


def test_matmul_ceiling_prefers_torchs_cublas_rate():
    """torch's cuBLAS rate is the ceiling wherever it was measured, even where ``jnp.dot`` ran
    faster; ``jnp.dot``'s only where torch has no GPU."""
    ways = {"n": 8192, "torch_mm": {"tflops": 790.0}, "jnp_dot": {"tflops": 800.0}}
    assert timing.matmul_ceiling(ways) == {"source": "torch_mm", "tflops": 790.0}
    ways["torch_mm"] = {"error": "RuntimeError: no"}
    assert timing.matmul_ceiling(ways) == {"source": "jnp_dot", "tflops": 800.0}
    assert math.isnan(timing.matmul_ceiling({"n": 1})["tflops"])
    s = timing.TimerSettings(windows=2, window_s=0.0, warmup_s=0.0, min_calls=1, max_calls=2)
    result = timing.measure_matmul_peak(s, n=128)
    assert _finite_positive(result["jnp_dot"]["tflops"]) and len(result["jnp_dot"]["windows_us"])
    assert result["source"] == ("torch_mm" if "torch_mm" in result else "jnp_dot")
    assert "torch_mm" not in result or jax.default_backend() == "gpu"
    assert "TFLOP/s (" in timing.matmul_summary(result)


def test_jsonable_writes_strict_json():
    doc = {"a": np.float32(1.5), "b": (np.int64(3), float("nan")), 4: np.arange(2),
           "c": [float("inf"), -float("inf"), None, True, np.bool_(False)], "d": DecodeConfig}
    text = json.dumps(timing.jsonable(doc), allow_nan=False)
    assert json.loads(text) == {"a": 1.5, "b": [3, "nan"], "4": [0, 1],
                                "c": ["inf", "-inf", None, True, False], "d": str(DecodeConfig)}


# ----------------------------------------------------------------------------------------------
# What the commands share


@pytest.mark.parametrize("config,label", [
    (DecodeConfig(block_k=32, num_splits=4, num_warps=2, num_stages=5, fp8_v_at_load=True),
     "bk32/s4/w2/st5/vl1"),
    (DecodeConfig(num_splits=16, merge_in_kernel=True, fp8_pairs=True), "bk64/s16/w4/st2/mk1/pr1"),
    (DecodeConfig(persistent_programs=264, num_stages=5), "bk64/s1/w4/st5/p264"),
    (MosaicDecodeConfig(block_k=128, num_splits=4, num_stages=2, num_consumers=1,
                        queries_in_n=True), "bk128/s4/st2/c1/qn1"),
    (MosaicDecodeConfig(block_k=128, num_splits=4, num_stages=2, queries_in_n=True,
                        fp8_k_in_registers=True, fp8_v_in_producer=True),
     "bk128/s4/st2/c1/qn1/kr1/vp1"),
    (MosaicDecodeConfig(block_k=128, num_stages=2, queries_in_n=True, persistent=True),
     "bk128/s1/st2/c1/qn1/ps1"),
    (AttentionConfig(block_q=16, short_block_q=4, block_k=64, num_stages=3),
     "bq16/sq4/bk64/s1/w4/st3"),
    (AttentionConfig(block_q=1, fp8_pairs=True), "bq1/bk64/s1/w4/st2/pr1")])
def test_config_labels_round_trip(config, label):
    assert _cli.config_label(config) == label
    assert type(config)(**_cli.parse_config(label, type(config))) == config


def test_config_labels_refuse_unknown_repeated_or_empty_parts():
    assert _cli.parse_config("st4/c2", MosaicDecodeConfig) == {"num_stages": 4,
                                                               "num_consumers": 2}
    assert _cli.parse_config("qn0", MosaicDecodeConfig) == {"queries_in_n": False}
    assert _cli.parse_config("vl0", DecodeConfig) == {"fp8_v_at_load": False}
    for bad, config_type in [("bk64/s1/x2", MosaicDecodeConfig), ("bk64/s", MosaicDecodeConfig),
                             ("c2/c1", MosaicDecodeConfig), ("", MosaicDecodeConfig),
                             ("qn2", MosaicDecodeConfig), ("kr2", MosaicDecodeConfig),
                             ("vl2", DecodeConfig), ("bk64/bk32", DecodeConfig),
                             ("64", DecodeConfig), ("vl1", AttentionConfig)]:
        with pytest.raises(ValueError):
            _cli.parse_config(bad, config_type)
    assert _cli.config_label(None) == "-"


def test_a_row_is_timed_only_when_right():
    """`checked_timing`: a correct variant is timed; a wrong one is WRONG and not timed; one
    that raises is an error; neither stops the run."""
    s = timing.SMOKE_TIMER
    x = jnp.ones((4, 2))
    reference = (np.arange(2), np.ones((2, 2), np.float32))
    right = _cli.checked_timing(jax.jit(lambda a: (a, a)), (x,), 2, s, reference)
    assert right["status"] == "ok" and right["correct"] and _finite_positive(right["median_us"])
    wrong = _cli.checked_timing(jax.jit(lambda a: a * jnp.nan), (x,), 1, s, reference)
    assert wrong["status"] == "WRONG" and wrong["nan"] and "median_us" not in wrong
    failed = _cli.checked_timing(jax.jit(lambda a: a.reshape(3)), (x,), 1, s, reference)
    assert failed["status"] == "error" and "TypeError" in failed["error"]
    assert _cli.exit_status([right]) == 0 and _cli.exit_status([right, wrong]) == 1
    text = _cli.table([dict(right, shape="s", impl="i", config="c"),
                       dict(wrong, shape="s", impl="j", config="c")], [("us", "median_us", ".1f")])
    assert "WRONG: rel_err=" in text and f"{right['median_us']:.1f}" in text


@pytest.mark.parametrize("argv,message", [(["--shapes", "b3_ctx5"], "--shapes: unknown"),
                                          (["--impls", "pallas,cuda"], "--impls"),
                                          (["--impls", ""], "--impls")])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        decode.main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# The commands' smoke runs


@pytest.fixture(scope="module")
def decode_smoke(tmp_path_factory):
    path = tmp_path_factory.mktemp("decode") / "decode.json"
    status = decode.main(["--smoke", "--shapes", SMOKE_SHAPE, "--json", str(path)])
    return status, json.loads(path.read_text())


def test_decode_smoke_checks_and_times_every_impl(decode_smoke):
    status, doc = decode_smoke
    assert status == 0
    assert doc["command"] == "benchmarks.decode" and doc["versions"]["jax"] == jax.__version__
    assert doc["device"]["kind"] and doc["timer"] == dataclasses.asdict(timing.SMOKE_TIMER)
    assert _finite_positive(doc["ceilings"]["tbps"])
    rows = _rows(doc)
    assert set(rows) == {(SMOKE_SHAPE, impl) for impl in decode.DEFAULT_IMPLS}
    for impl in ("pallas", "xla"):
        row = rows[SMOKE_SHAPE, impl]
        assert row["status"] == "ok" and row["correct"] and row["rel_err"] < _cli.REL_TOL, row
        for key in ("median_us", "tbps", "of_copy", "bytes", "compile_s"):
            assert _finite_positive(row[key]), (impl, key)
        assert row["of_copy"] == pytest.approx(row["tbps"] / doc["ceilings"]["tbps"])
    assert rows[SMOKE_SHAPE, "pallas"]["config"] == "bk64/s1/w4/st2"
    mosaic, baseline = rows[SMOKE_SHAPE, "mosaic"], rows[SMOKE_SHAPE, "jax"]
    if KERNEL_API:
        assert mosaic["status"] == "ok" and mosaic["correct"], mosaic
        assert mosaic["config"].startswith("bk") and "/qn1" in mosaic["config"]
    else:
        assert mosaic["status"] == "skipped" and "needs jax >= 0.11.2" in mosaic["reason"]
    assert baseline["status"] in ("ok", "skipped")
    if baseline["status"] == "ok":  # JAX's paged_attention, where this jax ships it
        assert baseline["correct"] and baseline["tried"] and baseline["config"].startswith("pp")
    [auto] = doc["auto"]
    assert auto["auto"] == "pallas" and auto["class"] == ["bfloat16", 64, 4, 16, 2, 64]
    assert (auto["pallas_over_mosaic"] is not None) == KERNEL_API
    if doc["interpret"]:
        assert doc["impl_choice"] == {}  # interpret-mode times would say anything


def test_a_wrong_kernel_is_reported_wrong_and_exits_1(monkeypatch, tmp_path):
    real = decode.decode

    def shifted(*args, impl, **kwargs):  # a planted bug in the Triton kernel's row
        out = real(*args, impl=impl, **kwargs)
        return out + 0.5 if impl == "pallas" else out

    monkeypatch.setattr(decode, "decode", shifted)
    path = tmp_path / "decode.json"
    assert decode.main(["--smoke", "--shapes", SMOKE_SHAPE, "--impls", "pallas,xla", "--json",
                        str(path)]) == 1
    rows = _rows(json.loads(path.read_text()))
    assert rows[SMOKE_SHAPE, "pallas"]["status"] == "WRONG"
    assert "median_us" not in rows[SMOKE_SHAPE, "pallas"]
    assert rows[SMOKE_SHAPE, "xla"]["status"] == "ok"


def test_the_fused_layout_rows_are_checked_and_timed(tmp_path):
    """``--impls pallas_fused`` (decode and ragged): `decode_fused` / `paged_attention_fused` over
    the same K/V in one fused cache, each row checked against the oracle before it is timed."""
    path = tmp_path / "decode.json"
    assert decode.main(["--smoke", "--shapes", SMOKE_SHAPE, "--impls", "pallas,pallas_fused",
                        "--json", str(path)]) == 0
    rows = _rows(json.loads(path.read_text()))
    assert rows[SMOKE_SHAPE, "pallas_fused"]["config"] == rows[SMOKE_SHAPE, "pallas"]["config"]
    path = tmp_path / "ragged.json"
    assert ragged.main(["--smoke", "--shapes", "smoke_spec_b4_q4_ctx40", "--impls",
                        "pallas_fused", "--json", str(path)]) == 0
    for rows in (rows, _rows(json.loads(path.read_text()))):
        for row in rows.values():
            assert row["status"] == "ok" and row["correct"], row


def test_impl_choice_takes_mosaic_only_where_it_won_every_shape_of_a_class():
    by_name = {s.name: s for s in shapes.DECODE_SHAPES}
    picked = [by_name[n] for n in ("d64_b32_ctx4096", "b64_ctx8192", "ragged_b64_ctx8192")]
    rows = [{"shape": "d64_b32_ctx4096", "impl": "pallas", "status": "ok", "median_us": 75.0},
            {"shape": "d64_b32_ctx4096", "impl": "mosaic", "status": "ok", "median_us": 70.0},
            {"shape": "b64_ctx8192", "impl": "pallas", "status": "ok", "median_us": 500.0},
            {"shape": "b64_ctx8192", "impl": "mosaic", "status": "ok", "median_us": 480.0},
            {"shape": "ragged_b64_ctx8192", "impl": "pallas", "status": "ok", "median_us": 259.0},
            {"shape": "ragged_b64_ctx8192", "impl": "mosaic", "status": "ok", "median_us": 262.0}]
    assert decode.auto_choice(picked, rows, interpret=True)[1] == {}
    picks, choice = decode.auto_choice(picked, rows, interpret=False)
    assert choice == {("bfloat16", 64, 4, 16, 32, 4096): "mosaic"}  # b64: one shape lost
    assert [p["pallas_over_mosaic"] for p in picks] == pytest.approx([75 / 70, 500 / 480,
                                                                      259 / 262])
    text = _cli.impl_choice_snippet(choice, decode.KEY_COMMENT)
    namespace = {}
    exec("IMPL_CHOICE = {\n" + text + "\n}", namespace)  # noqa: S102 - our own generated code
    assert namespace["IMPL_CHOICE"] == {jax.devices()[0].device_kind: choice}
    assert '("bfloat16", 64, 4, 16, 32, 4096): "mosaic",' in text


@pytest.mark.parametrize("shape", shapes.DECODE_SHAPES, ids=lambda s: s.name)
def test_jax_baseline_configs_are_valid(shape):
    configs = decode.jax_configs(shape)
    assert 1 <= len(configs) <= decode.JAX_CONFIGS
    for c in configs:
        per_split = shape.max_blocks // c["k_splits"]
        assert shape.max_blocks % c["k_splits"] == 0
        block = c["pages_per_compute_block"]
        assert per_split % block == 0 and block & (block - 1) == 0
    if shape.max_blocks % 16 == 0:  # JAX's own defaults first where they are valid
        assert (configs[0]["k_splits"], configs[0]["num_warps"]) == (16, 8)


def test_ragged_smoke_checks_and_times_every_impl_beside_decode(tmp_path):
    path = tmp_path / "ragged.json"
    names = "smoke_decode_b4_ctx40,smoke_fp8_mixed_2x8c20_6dec30"
    assert ragged.main(["--smoke", "--shapes", names, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["ceilings"]["matmul"]["n"] == _cli.SMOKE_MATMUL_N
    assert _finite_positive(doc["ceilings"]["tflops"]) and _finite_positive(doc["ceilings"]["tbps"])
    rows = _rows(doc)
    assert set(rows) == {("smoke_decode_b4_ctx40", "pallas"), ("smoke_decode_b4_ctx40", "xla"),
                         ("smoke_decode_b4_ctx40", "mosaic"), ("smoke_decode_b4_ctx40", "decode"),
                         ("smoke_fp8_mixed_2x8c20_6dec30", "pallas"),
                         ("smoke_fp8_mixed_2x8c20_6dec30", "mosaic"),
                         ("smoke_fp8_mixed_2x8c20_6dec30", "xla")}
    for name in ("smoke_decode_b4_ctx40", "smoke_fp8_mixed_2x8c20_6dec30"):
        # head_dim 32: the Mosaic kernel refuses both shapes, in its own words
        skipped = rows.pop((name, "mosaic"))
        assert skipped["status"] == "skipped" and "impl='mosaic'" in skipped["reason"]
    for row in rows.values():
        assert row["status"] == "ok" and row["correct"], row
        for key in ("tflops", "of_peak", "tbps", "of_copy", "roofline"):
            assert _finite_positive(row[key]), key
        assert row["roofline"] == pytest.approx(max(row["of_peak"], row["of_copy"]))
    decode_row = rows["smoke_decode_b4_ctx40", "decode"]
    assert rows["smoke_decode_b4_ctx40", "pallas"]["vs_decode"] == pytest.approx(
        rows["smoke_decode_b4_ctx40", "pallas"]["median_us"] / decode_row["median_us"])
    assert "vs_decode" not in rows["smoke_fp8_mixed_2x8c20_6dec30", "pallas"]
    assert rows["smoke_fp8_mixed_2x8c20_6dec30", "pallas"]["config"].startswith("bq")


def test_write_smoke_is_torchs_bit_for_bit(tmp_path):
    path = tmp_path / "write.json"
    assert write.main(["--smoke", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["impl"], r["config"]) for r in rows] == [
        (impl, f"{a} -> {b}") for a, b in write.VARIANTS for impl in write.IMPLS]
    for row in rows:
        assert row["status"] == "ok" and row["differing_elements"] == 0, row
        assert _finite_positive(row["of_copy"]) and row["ops_per_call"] == 4


def test_a_write_that_differs_from_torchs_is_wrong(monkeypatch):
    real = write.write_kv
    monkeypatch.setattr(write, "write_kv", lambda *a, k_scale=None, **kw: real(
        *a, k_scale=None if k_scale is None else k_scale * 1.01, **kw))
    row = write.bench_variant(shapes.WRITE_SMOKE, "bfloat16", shapes.FP8, "xla",
                              timing.SMOKE_TIMER, True, "cpu", seed=0)
    assert row["status"] == "WRONG" and row["differing_elements"] > 0 and "median_us" not in row


def test_ceilings_smoke_measures_every_ceiling(tmp_path, capsys):
    path = tmp_path / "ceilings.json"
    assert ceilings.main(["--smoke", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    for name, rate in (("copy", "tbps"), ("read", "tbps"), ("matmul", "tflops")):
        assert _finite_positive(doc[name][rate]) and doc[name]["source"], name
    out = capsys.readouterr().out
    assert "copy bandwidth" in out and "of the copy" in out
    assert f"TFLOP/s ({doc['matmul']['source']};" in out
    with pytest.raises(SystemExit):
        ceilings.main(["--gib", "0"])


@pytest.mark.slow
def test_sharded_smoke_run(tmp_path):
    """On 2 virtual CPU devices (configured before JAX starts: a process of its own), every
    variant runs and agrees with one device."""
    path = tmp_path / "sharded.json"
    code = ("import sys; from benchmarks import sharded;"
            f" sys.exit(sharded.main(['--smoke', '--json', {str(path)!r}]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(path.read_text())
    assert {r["name"]: r["status"] for r in report["variants"]} == dict.fromkeys(
        ("1gpu", "tp2", "dp2", "dp2-weak", "tp2-weak"), "ok")
    assert all(r["max_abs_diff_vs_1gpu"] < 1e-2 for r in report["variants"])
    assert {n: report["copy_bandwidth"][n]["devices"] for n in ("1", "2")} == {"1": 1, "2": 2}


# ----------------------------------------------------------------------------------------------
# tune


def test_tune_smoke_checks_each_candidate_and_prints_the_entries(tmp_path, capsys):
    path = tmp_path / "tune.json"
    assert tune.main(["decode", "--smoke", "--shapes", SMOKE_SHAPE, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    [record] = doc["shapes"]
    assert record["heuristic"] == "bk64/s1/w4/st2" and record["class"] == \
        '("bfloat16", 64, 4, 16, 2, 64)'
    assert 2 <= len(record["rows"]) <= 2 + tune.SMOKE_CANDIDATES
    assert all(r["status"] == "ok" and r["correct"] for r in record["rows"])
    kind = jax.devices()[0].device_kind
    assert doc["snippet"].splitlines()[0].startswith(
        "    # TUNED in pallas_paged/decode_attention/pallas_triton_config.py; key: (cache dtype,")
    assert f"    {json.dumps(kind)}: {{" in doc["snippet"] and doc["snippet"] in \
        capsys.readouterr().out


def test_tune_ragged_smoke(tmp_path):
    path = tmp_path / "tune.json"
    assert tune.main(["ragged", "--smoke", "--shapes", "smoke_decode_b4_ctx40", "--json",
                      str(path)]) == 0
    [record] = json.loads(path.read_text())["shapes"]
    assert record["heuristic"].startswith("bq1/") and len(record["rows"]) >= 2
    with pytest.raises(SystemExit):
        tune.main(["ragged", "--impl", "triton"])


D256 = MosaicAttentionConfig(block_kv=64, num_stages=2, num_consumers=1, ping_pong=False)


@pytest.mark.parametrize("name,count,only", [
    ("prefill_b4_q2048", 32, None),      # the 12 of 18 that fit; 8 two-consumer ones persistent;
    #                                      12 without ping-pong overlapped
    ("fp8_mixed_4x512c2560_60dec4096", 16, None),  # the converted ring: 6 fit; 4 persistent,
    #                                      2 with decode_rows; 4 with the group packed; no overlap
    ("spec_b32_q4_ctx4096", 40, None),   # 32 as for prefill; 8 with the group (4) packed
    ("d256_decode_b32_ctx4096", 3, [D256, dataclasses.replace(D256, pack_heads=4),
                                    dataclasses.replace(D256, overlap_softmax=True)])])
def test_tune_ragged_mosaic_candidates_are_configs_the_kernel_takes(name, count, only):
    shape = shapes.shape_by_name(name)
    found = tune.ragged_mosaic_candidates(shape, None, [], 132)
    assert len(found) == len(set(found)) == count
    for config in found:
        ragged_mosaic.check_supported(*shape.abstract_args()[:2], config)
    assert only is None or found == only
    packed = [c.pack_heads for c in found if c.pack_heads > 1]
    assert set(packed) <= {4} and (packed != []) == ("prefill" not in name)


@needs_mosaic
@pytest.mark.slow
def test_tune_mosaic_smoke(tmp_path):
    """The Mosaic sweep in interpret mode: the heuristic's config and two candidates (with two
    consumer warpgroups), each checked against the oracle and timed."""
    path = tmp_path / "tune.json"
    assert tune.main(["decode", "--impl", "mosaic", "--smoke", "--shapes", SMOKE_SHAPE,
                      "--json", str(path)]) == 0
    [record] = json.loads(path.read_text())["shapes"]
    assert record["heuristic"] == "bk128/s1/st2/c1/qn1"
    assert all(r["status"] == "ok" for r in record["rows"]) and len(record["rows"]) == 3


@pytest.mark.parametrize("shape", [s for s in shapes.DECODE_SHAPES if not s.sliding_window],
                         ids=lambda s: s.name)
def test_tune_candidates_are_bounded_and_valid(shape):
    heuristic = DecodeConfig(block_k=64, num_splits=4, num_warps=4, num_stages=2)
    tiles = tune.decode_tiles(shape, heuristic, [], 132)
    assert len(tiles) == len(set(tiles)) <= 26
    assert {kv_ring_depth(c.num_stages) for c in tiles} == {1, 2}  # both ring depths
    persistent = [c for c in tiles if c.persistent_programs]
    assert persistent and all(c.persistent_programs == 264 and c.num_splits == 1
                              for c in persistent)
    warps = tune.decode_warps(shape, heuristic, tiles, 132)
    fp8 = shape.dtype == "float8_e4m3fn"
    assert len(warps) == len(set(warps)) <= (30 if fp8 else 10)
    assert any(c.fp8_pairs for c in warps) == fp8 and any(c.fp8_v_at_load for c in warps) == fp8
    assert {kv_ring_depth(c.num_stages) for c in warps} == {0, 1, 2, 3}
    assert len(tune.decode_runners_up(shape, heuristic, tiles, 132)) <= 3
    assert tune.decode_warps(shape, heuristic, [], 132) == []


def test_tune_mosaic_candidates_are_configs_the_kernel_takes():
    shape = shapes.shape_by_name("b32_ctx4096")
    heuristic = MosaicDecodeConfig(block_k=128, num_stages=2, queries_in_n=True, persistent=True)
    found = tune.mosaic_candidates(shape, heuristic, [], 132)
    assert 10 <= len(found) == len(set(found)) <= 96
    assert any(not c.queries_in_n for c in found) and any(c.num_consumers == 2 for c in found)
    assert all(not c.persistent or c.num_consumers == 1 for c in found)


def _config_module(tmp_path, name: str) -> tuple[str, str]:
    """A copy of a config module in ``tmp_path``, and the real file's text (never written)."""
    real = os.path.join(ROOT, name)
    copy = tmp_path / os.path.basename(name)
    shutil.copy(real, copy)
    with open(real) as f:
        return str(copy), f.read()


def test_tune_rewrites_one_device_kinds_entries_on_a_copy(tmp_path):
    module = "pallas_paged/decode_attention/pallas_triton_config.py"
    path, real_text = _config_module(tmp_path, module)
    before = tune.load_table(path, "TUNED")
    h100 = "NVIDIA H100 80GB HBM3"
    h100_block = re.search(r'\n    "NVIDIA H100 80GB HBM3": \{\n.*?\n    \},\n', real_text, re.S)
    kept, dropped = list(before["NVIDIA H200"])[:2]
    new_key = ("bfloat16", 128, 4, 16, 16, 2048)
    changed = DecodeConfig(block_k=32, num_splits=2, num_warps=8, num_stages=3,
                           merge_in_kernel=True)
    written = tune.rewrite_table(path, "TUNED", "NVIDIA H200",
                                 {kept: changed, dropped: None, new_key: DecodeConfig()})
    h200 = before["NVIDIA H200"] | {kept: changed, new_key: DecodeConfig()}
    del h200[dropped]
    assert written == {"NVIDIA H200": h200, h100: before[h100]}
    with open(path) as f:
        text = f.read()
    assert h100_block and h100_block.group(0) in text  # the other kind's lines, untouched
    assert "DecodeConfig(\n            block_k=32, num_splits=2, num_warps=8, num_stages=3," \
        " merge_in_kernel=True)," in text
    outside = real_text.split("TUNED: dict")[0]
    assert text.startswith(outside)  # nothing before the table moved
    tune.rewrite_table(path, "TUNED", "NVIDIA B200", {new_key: changed})  # a new kind
    assert tune.load_table(path, "TUNED")["NVIDIA B200"] == {new_key: changed}
    with open(os.path.join(ROOT, module)) as f:
        assert f.read() == real_text


@pytest.mark.parametrize("module,table,key,config", [
    ("pallas_paged/decode_attention/mosaic_gpu_config.py", "MOSAIC_TUNED",
     ("float8_e4m3fn", 128, 4, 16, 32, 4096),
     MosaicDecodeConfig(block_k=128, num_stages=2, queries_in_n=True, fp8_k_in_registers=True,
                        fp8_v_in_producer=True)),
    ("pallas_paged/ragged_attention/pallas_triton_config.py", "TUNED",
     ("bfloat16", 128, 4, 16, 64, 2048, 4096),
     AttentionConfig(block_q=16, short_block_q=4, num_stages=3)),
    ("pallas_paged/ragged_attention/mosaic_gpu_config.py", "MOSAIC_TUNED",
     ("bfloat16", 128, 4, 16, 4, 8192, 2048),
     MosaicAttentionConfig(block_kv=64, num_stages=3, num_consumers=2, ping_pong=False))])
def test_tune_rewrites_and_empties_the_other_tables_on_a_copy(tmp_path, module, table, key,
                                                             config):
    path, real_text = _config_module(tmp_path, module)
    before = tune.load_table(path, table)
    kind = "NVIDIA GH200"
    assert tune.rewrite_table(path, table, kind, {key: config}) == before | {kind: {key: config}}
    assert tune.rewrite_table(path, table, kind, {key: None}) == before
    with open(path) as f:
        assert f.read() == real_text  # back where it was, `{}` on one line included


def test_tune_snippet_is_the_config_modules_form():
    found = {("bfloat16", 128, 4, 16, 32, 4096): DecodeConfig(block_k=64, num_warps=8,
                                                              num_stages=5),
             ("float8_e4m3fn", 128, 4, 16, 8, 16384): DecodeConfig(block_k=64, num_splits=6,
                                                                   num_stages=5, fp8_pairs=True),
             ("bfloat16", 128, 4, 16, 1, 32768): None}
    text = tune.snippet("decode", "pallas", "NVIDIA H200", found)
    namespace = {"DecodeConfig": DecodeConfig}
    exec("TUNED = {\n" + text + "\n}", namespace)  # noqa: S102 - our own generated code
    assert namespace["TUNED"] == {"NVIDIA H200": {k: c for k, c in found.items() if c}}
    assert text.splitlines()[0].startswith("    # TUNED in pallas_paged/decode_attention/")
    assert '        ("float8_e4m3fn", 128, 4, 16, 8, 16384): DecodeConfig(\n' \
           '            block_k=64, num_splits=6, num_warps=4, num_stages=5, fp8_pairs=True),' \
           in text
    records = [{"class": ("x",), "gain": 1.01, "best": DecodeConfig(block_k=32),
                "heuristic": DecodeConfig()},
               {"class": ("y",), "gain": 1.2, "best": DecodeConfig(block_k=32),
                "heuristic": DecodeConfig()},
               {"class": ("y",), "gain": 0.9, "best": DecodeConfig(),
                "heuristic": DecodeConfig()},
               {"class": ("z",), "gain": None, "best": None, "heuristic": DecodeConfig()}]
    assert tune.entries(records) == {("x",): None, ("y",): DecodeConfig(block_k=32)}


# ----------------------------------------------------------------------------------------------
# Profiling tools


def test_ncu_opcodes_sums_the_source_page_by_opcode(tmp_path):
    from benchmarks.profiling import ncu_opcodes

    page = tmp_path / "source.csv"
    page.write_text(
        "==PROF== Connected to process 1\n"
        '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
        '"0x10","@P0 LDS.U8 R1, [R2]","10","1,000"\n'
        '"0x20","HMMA.16816.F32 R4, R8, R12, R4","30","500"\n'
        '"0x30","LDS.U8 R3, [R2+0x1]","5","1,000"\n'
        '"0x40","@!PT BAR.SYNC.DEFER_BLOCKING 0x0","55","100"\n')
    per_opcode, totals = ncu_opcodes.summarize(ncu_opcodes.read_source_page(str(page)))
    assert per_opcode["LDS.U8"][ncu_opcodes.INSTRUCTIONS] == 2000
    assert per_opcode["BAR.SYNC.DEFER_BLOCKING"][ncu_opcodes.STALLS] == 55
    assert totals[ncu_opcodes.INSTRUCTIONS] == 2600 and totals[ncu_opcodes.STALLS] == 100
    text = ncu_opcodes.table(per_opcode, totals, top=2)
    assert text.splitlines()[2].startswith("| LDS.U8 | 2,000 (76.9%) | 15 (15.0%) |")
    assert "BAR.SYNC" not in text
    (tmp_path / "empty.csv").write_text("nothing\n")
    assert ncu_opcodes.main([str(tmp_path / "empty.csv")]) == 2


_SASS_WITH_A_LOOP = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   HMMA.16816.F32 R4, R8, R12, RZ ;
        /*0030*/                   DEPBAR.LE SB0, 0x1 ;
        /*0040*/                   ISETP.NE.AND P0, PT, R2, R3, PT ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
"""
_TTGIR_RINGS = """
    %1 = ttg.local_alloc : () -> !ttg.memdesc<2x32x128xf8E4M3FN, #shared, #smem, mutable>
    %2 = ttg.local_alloc : () -> !ttg.memdesc<2x32x128xf8E4M3FN, #shared1, #smem, mutable>
    %3 = ttg.local_alloc : () -> !ttg.memdesc<2x32xi32, #shared2, #smem, mutable>
    %4 = ttg.local_alloc %0 : (tensor<16x128xf16, #blocked>) -> !ttg.memdesc<16x128xf16, #s>
"""


def test_triton_sass_reads_the_tile_loop_the_rings_and_the_residency():
    from benchmarks.profiling import triton_sass

    assert triton_sass.loop_instructions(_SASS_WITH_A_LOOP) == 4  # 0x20 .. 0x50
    assert triton_sass.copies_left_in_flight(_SASS_WITH_A_LOOP) == 1
    assert triton_sass.ring_depths_in_ttgir(_TTGIR_RINGS, block_k=32) == [2, 2]
    assert triton_sass.ring_depths_in_ttgir(_TTGIR_RINGS, block_k=64) == []
    assert triton_sass.programs_per_sm(128, 21504, 2) == (8, "registers")
    assert triton_sass.programs_per_sm(168, 55808, 2) == (4, "shared memory")
    assert triton_sass.programs_per_sm(24, 1024, 16) == (4, "warps")
    config = DecodeConfig(block_k=32, num_splits=4, num_warps=2, num_stages=5,
                          fp8_v_at_load=True)
    line = triton_sass.pipeline_summary("fp8_b32_ctx4096", config, dict(
        registers=128, shared_bytes=29952, loop_instructions=567, ring_depths=[2, 2],
        copies_left_in_flight=3))
    assert line.startswith("bk32/s4/w2/st5/vl1: 128 regs, 29952 B smem; tile loop 567"
                           " instrs/warp (35.4 per token), its wait leaves 3 copy groups in"
                           " flight; K/V ring 2 deep")
    assert "7 programs/SM (by shared memory), grid 1024 = 1.11 waves" in line
    assert line.endswith("K/V in flight <= 112 KiB/SM")
    ragged_config = AttentionConfig(block_q=16, short_block_q=4, block_k=64, num_stages=3)
    line = triton_sass.pipeline_summary("mixed_4x512c2560_60dec4096", ragged_config, dict(
        registers=255, shared_bytes=82944, loop_instructions=1017, ring_depths=[1, 1, 2, 1]))
    assert line == ("bq16/sq4/bk64/s1/w4/st3: 255 regs, 82944 B smem; tile loop 1017"
                    " instrs/warp (63.6 per token); K/V rings 1 deep x3, 2 deep x1; 2"
                    " programs/SM (by registers)")


def test_triton_sass_lowers_the_kernel_of_the_named_shape():
    """Lowered for CUDA on the CPU: a decode shape gives the decode kernel of its config (the
    name says the tile, splits and fp8 path), a ragged one the ragged kernel."""
    from benchmarks.profiling import triton_sass

    config = triton_sass.kernel_config("fp8_b32_ctx4096", {"fp8_v_at_load": True,
                                                            "fp8_pairs": False})
    ir_text = triton_sass.triton_ir("fp8_b32_ctx4096", config)
    head = ir_text.split("\n", 1)[0]
    assert f"pallas_paged_decode_bk{config.block_k}_s{config.num_splits}" in head
    assert head.rstrip(" {").endswith("_vload") and ir_text.count("tt.dot ") == 2
    fields = triton_sass.parse_config("bq16/sq4/st5", "mixed_4x512c2560_60dec4096")
    assert fields == dict(block_q=16, short_block_q=4, num_stages=5)
    ragged_config = triton_sass.kernel_config("mixed_4x512c2560_60dec4096", fields)
    head = triton_sass.triton_ir("mixed_4x512c2560_60dec4096", ragged_config).split("\n", 1)[0]
    assert "pallas_paged_ragged_bq16_sq4" in head
    for name, fields in (("mixed_4x512c2560_60dec4096", {}), ("b32_ctx4096", {})):
        head = triton_sass.triton_ir(name, triton_sass.kernel_config(name, fields),
                                     fused=True).split("\n", 1)[0]
        assert head.rstrip(" {").endswith("_fused"), head
    with pytest.raises(ValueError):
        triton_sass.parse_config("vl1", "mixed_4x512c2560_60dec4096")


def test_kv_ring_depth_follows_the_stages_split_between_table_and_tile_loads():
    """The model `triton_sass` checks compiled kernels against (and tune's stages span): two
    chained loads share ``num_stages - 1``: 2 to 4 stages keep one tile in flight, 5 and 6 two,
    7 and 8 three; 1 pipelines nothing."""
    assert [kv_ring_depth(st) for st in range(1, 9)] == [0, 1, 1, 1, 2, 2, 3, 3]


@pytest.mark.slow
@pytest.mark.parametrize("num_stages", [1, 2, 3, 5, 7])
def test_kv_ring_depth_is_what_triton_compiles(num_stages):
    """`kv_ring_depth`'s rule against the compiled bf16 decode kernel: its K and V rings' depth
    in the Triton GPU IR, and copies left in flight only with a ring two or more deep."""
    pytest.importorskip("triton")
    from benchmarks.profiling import triton_sass

    config = triton_sass.kernel_config("b32_ctx4096", {"num_stages": num_stages})
    with tempfile.TemporaryDirectory() as out:
        result = triton_sass.compile_sass(triton_sass.triton_ir("b32_ctx4096", config), config,
                                          out)
    depth = kv_ring_depth(num_stages)
    assert result["ring_depths"] == ([depth] * 2 if depth else [])
    if depth:
        assert (result["copies_left_in_flight"] > 0) == (depth > 1)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["b32_ctx4096", "prefill_b4_q2048"])
def test_the_fused_cache_compiles_to_the_pair_layouts_instructions(shape):
    """The Triton kernels over one fused cache (its `slot_major` view ``[slots, kvh, 2, D]``)
    compile to the same instructions, opcode for opcode, as over separate K and V caches: the
    fused layout costs no address arithmetic (indexing it by combined head ``2h``, ``2h + 1``
    gave the ragged prefill kernel about 500 more SASS instructions and cost it 15% on an H100)."""
    pytest.importorskip("triton")
    from benchmarks.profiling import triton_sass

    config = triton_sass.kernel_config(shape, {})

    def compiled(fused: bool) -> dict:
        with tempfile.TemporaryDirectory() as out:
            return triton_sass.compile_sass(triton_sass.triton_ir(shape, config, fused=fused),
                                            config, out)

    pair, fused = compiled(False), compiled(True)
    assert fused["opcodes"] == pair["opcodes"]
    assert (fused["registers"], fused["loop_instructions"]) == (
        pair["registers"], pair["loop_instructions"])


@pytest.mark.slow
def test_fp8_pairs_give_every_dot_16_bit_operand_layouts():
    """With `DecodeConfig.fp8_pairs` the fp8 kernel's four dots (each of half the head
    dimension) take operands laid out two elements per register along K (``kWidth = 2``), where
    fp8 tiles loaded as bytes make it four."""
    pytest.importorskip("triton")
    from benchmarks.profiling import triton_sass

    def compiled(fields):
        config = triton_sass.kernel_config("fp8_b32_ctx4096", fields)
        ir_text = triton_sass.triton_ir("fp8_b32_ctx4096", config)
        out = tempfile.mkdtemp()
        triton_sass.compile_sass(ir_text, config, out)
        with open(os.path.join(out, "kernel.ttgir")) as f:
            return ir_text, set(re.findall(r"kWidth = (\d+)", f.read()))

    ir_text, widths = compiled({"fp8_pairs": True})
    assert ir_text.count("tt.dot ") == 4 and "cvt.rn.f16x2.e4m3x2" in ir_text
    assert widths == {"2"}
    assert compiled({"fp8_pairs": False, "fp8_v_at_load": True})[1] == {"4"}


@pytest.mark.parametrize("name", ["smoke_b2_ctx64", "smoke_fp8_b2_ctx64"])
def test_profile_kernel_passes_the_caches_as_arguments(name):
    """Closed over, the caches would be captured as constants of the profiled program."""
    from benchmarks.profiling import profile_kernel

    _, fn, args = profile_kernel.decode_call(name, "xla", {})
    text = fn.lower(*args).as_text()
    constants = re.findall(r'dense<"0x([0-9A-F]+)">', text)  # hex: 2 digits a byte
    assert max((len(c) // 2 for c in constants), default=0) < args[1].nbytes


def test_profile_kernel_replaces_fields_of_the_config_a_windowed_decode_picks():
    """``--config`` over what ``decode`` picks for the call: a window's span, not the tables'
    capacity, sets the tile (here 16 tokens for a window of 16 over 128-token tables)."""
    from benchmarks.profiling import profile_kernel

    shape = shapes.shape_by_name("smoke_swa16_b2_ctx128")
    _, picked = select_kernel(*shape.abstract_args(), impl="pallas", config=None,
                              interpret=True, sliding_window=shape.sliding_window)
    describe, _, _ = profile_kernel.decode_call(shape.name, "pallas", {"num_warps": 2})
    assert str(dataclasses.replace(picked, num_warps=2)) in describe


def test_profile_kernel_takes_a_ragged_config():
    """``--config`` over the config a ragged call picks: the fields replaced, the rest kept."""
    from benchmarks.profiling import profile_kernel

    describe, fn, args = profile_kernel.ragged_call("smoke_prefill_b2_q24", "pallas",
                                                    {"block_k": 16, "num_warps": 2})
    assert "block_k=16" in describe and "num_warps=2" in describe
    assert fn(*args).shape == args[0].shape
    with pytest.raises(SystemExit):
        profile_kernel.main(["--shape", "smoke_prefill_b2_q24", "--config", "ov1"])


def test_program_timeline_phases_of_synthetic_stamps():
    """Each phase from known stamps, calls taken in the order they started (not as listed), the
    timer's 32-bit wrap-around undone."""
    from benchmarks.profiling import program_timeline as ptl

    def call(starts, ends, sms):  # ns -> i32[programs, STAMPS] as the kernel writes them
        stamps = np.zeros((len(starts), ptl.STAMPS), np.int64)
        stamps[:, 0], stamps[:, 1], stamps[:, 2] = starts, ends, sms
        return ((stamps + (1 << 31)) % (1 << 32) - (1 << 31)).astype(np.int32)

    wrap = (1 << 32) - 5_000  # the low word wraps 5 us after the first call starts
    first = call([wrap, wrap + 1_000, wrap + 2_000], [wrap + 90_000, wrap + 100_000,
                                                      wrap + 98_000], [0, 1, 1])
    second = call([wrap + 101_000] * 2, [wrap + 150_000, wrap + 160_000], [2, 3])
    phases = ptl.loop_phases([second, first])  # listed out of order
    p = phases[0]
    assert p["span"] == pytest.approx(100.0) and p["ramp"] == pytest.approx(2.0)
    assert p["full"] == pytest.approx(90.0) and p["tail"] == pytest.approx(10.0)
    assert p["gap"] == pytest.approx(1.0) and p["period"] == pytest.approx(101.0)
    assert phases[1]["span"] == pytest.approx(59.0) and phases[1]["gap"] is None
    assert ptl.median_phases(phases)["gap"] == pytest.approx(1.0)


def test_program_timeline_smoke_wraps_the_kernel_unchanged(tmp_path):
    """The timed wrapper of the grid kernel gives `decode`'s output (checked against
    impl="xla"), also timed one call per dispatch; a split merged by a second launch and
    persistent programs are refused with the config in the message."""
    from benchmarks.profiling import program_timeline as ptl

    path = tmp_path / "timeline.json"
    assert ptl.main(["--smoke", "--dispatch", "--config", "s2/mk1", "--json", str(path)]) == 0
    [shape] = json.loads(path.read_text())["shapes"]
    assert shape["status"] == "ok" and shape["rel_err"] < 1e-2
    assert shape["config"]["num_splits"] == 2 and shape["median"]["host_us"] > 0
    assert len(shape["dispatch"]["calls"]) == len(shape["calls"]) >= 1
    inputs = shapes.make_decode_inputs(shapes.shape_by_name(SMOKE_SHAPE), seed=0)
    for refused in (DecodeConfig(num_splits=2), DecodeConfig(persistent_programs=4)):
        with pytest.raises(ValueError, match="config="):
            ptl.timed_decode(*inputs.args(0), config=refused, interpret=True)



def test_shards_partition_the_tests_and_keep_the_huge_ones_together():
    """``--shard i/n`` (benchmarks/gpu_run.sh's processes): every test in exactly one shard,
    dealt in turn, and the ``huge`` ones, which share GBs of caches in order, all in shard 0."""
    import types

    import conftest

    def item(name, huge=False):
        return types.SimpleNamespace(name=name, get_closest_marker=lambda m: huge and m == "huge")

    tests = [item(f"t{i}", huge=i in (2, 5, 6)) for i in range(11)]
    shards, dropped = [], []
    for index in range(3):
        config = types.SimpleNamespace(
            getoption=lambda _, index=index: f"{index}/3",
            hook=types.SimpleNamespace(pytest_deselected=lambda items: dropped.append(items)))
        items = list(tests)
        conftest._shard(config, items)
        shards.append([t.name for t in items])
        assert len(dropped[-1]) + len(items) == len(tests)
    assert shards == [["t2", "t5", "t6", "t0", "t4", "t9"], ["t1", "t7", "t10"], ["t3", "t8"]]
