"""`benchmarks.shapes` (the named shapes and their inputs) and `benchmarks.bench` end to end.

The benchmark runs in ``--smoke`` mode on one tiny shape (Pallas interpret mode on a CPU): the
numbers mean nothing there, but every impl, the correctness check, the donated writes, the JSON and
the plot must come out, with positive, finite figures. The Mosaic kernel's row says "not run" with
the kernel's reason where it cannot run (head_dim 32 there; jax 0.10.2), and a second smoke run on
a head_dim-64 shape runs it beside the Triton kernel where it can (interpret mode, jax >= 0.11.2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from benchmarks import bench, bench_mosaic, bench_ragged
from pallas_paged.decode_attention import mosaic_gpu
from pallas_paged.decode_attention.configs import DecodeConfig
from pallas_paged.ragged_attention.configs import AttentionConfig
from pallas_paged.decode_attention.pallas_triton import kv_ring_depth
from benchmarks.shapes import (ALL_SHAPES, BENCH_SHAPES, EXTENSION_SHAPES, SMALL_SHAPES,
                                 DecodeBenchShape, make_block_tables, make_decode_inputs,
                                 shape_by_name)

# The benchmark's required shapes (13) and its extensions (5), by name; `test_shape_names_state_
# their_parameters` holds every shape to what its name says.
REQUIRED = ("b32_ctx4096", "b64_ctx2048", "b8_ctx16384", "b128_ctx1024", "b1_ctx32768",
            "b256_ctx512", "mha_b32_ctx4096", "bs64_b32_ctx4096", "b4_ctx131072",
            "ragged_b64_ctx8192", "fp16_b32_ctx4096", "d64_b32_ctx4096", "d256_b32_ctx4096")
EXTENSIONS = ("fp8_b32_ctx4096", "fp8_b8_ctx16384", "swa1024_b8_ctx32768", "b8_ctx1024",
              "b64_ctx8192")
# What a name leaves unsaid: the model of the required shapes (32 query heads, 8 kv heads,
# head_dim 128, block size 16, bf16, full attention, equal lengths).
MODEL = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
             sliding_window=None, ragged=False)
SMALL_MODEL = dict(MODEL, num_heads=8, num_kv_heads=2, head_dim=32)
SMOKE_SHAPE = "small_b2_ctx64"


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# ----------------------------------------------------------------------------------------------
# shapes


def test_names_are_unique():
    names = [s.name for s in ALL_SHAPES + SMALL_SHAPES]
    assert len(names) == len(set(names))


def _named_parameters(name: str) -> dict:
    """The parameters a shape's name states: ``b<batch>``, ``ctx<context>``, ``mha`` (as many kv
    heads as query heads), ``bs<n>``, ``d<n>``, ``fp16``, ``fp8``, ``swa<W>``, ``ragged``; the rest
    is the model's (a ``small_`` prefix picks the small model)."""
    tokens = name.split("_")
    params = dict(SMALL_MODEL if tokens[0] == "small" else MODEL)
    for token in tokens[tokens[0] == "small":]:
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


@pytest.mark.parametrize("shape", ALL_SHAPES + SMALL_SHAPES, ids=lambda s: s.name)
def test_shape_names_state_their_parameters(shape):
    expected = _named_parameters(shape.name)
    if expected.pop("mha", False):  # as many kv heads as query heads, however many that is
        assert shape.num_kv_heads == shape.num_heads
        del expected["num_heads"], expected["num_kv_heads"]
    assert {k: getattr(shape, k) for k in expected} == expected


def test_bench_shapes_are_exactly_the_required_thirteen():
    assert [s.name for s in BENCH_SHAPES] == list(REQUIRED)
    assert [s.name for s in EXTENSION_SHAPES] == list(EXTENSIONS)
    assert {s.name for s in ALL_SHAPES} == set(REQUIRED) | set(EXTENSIONS)
    assert len(BENCH_SHAPES) == 13


def test_small_shapes_cover_the_features():
    assert any(s.ragged for s in SMALL_SHAPES)
    assert any(s.dtype == "float8_e4m3fn" for s in SMALL_SHAPES)
    assert any(s.sliding_window for s in SMALL_SHAPES)
    assert any(s.group == 1 for s in SMALL_SHAPES)
    assert all(s.capacity <= 256 for s in SMALL_SHAPES)


@pytest.mark.parametrize("bad", [dict(num_heads=6, num_kv_heads=4), dict(batch=0),
                                 dict(dtype="int8"), dict(sliding_window=0)])
def test_shape_rejects_bad_parameters(bad):
    params = dict(name="x", batch=2, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                  context=64) | bad
    with pytest.raises(ValueError):
        DecodeBenchShape(**params)


@pytest.mark.parametrize("name,copies", [("ragged_b64_ctx8192", 1), ("b4_ctx131072", 1),
                                         ("swa1024_b8_ctx32768", 8), ("b256_ctx512", 1),
                                         ("small_ragged_b4_ctx96", 3), ("small_bs8_b2_ctx64", 2)])
def test_block_tables_are_valid(name, copies):
    shape = shape_by_name(name)
    lens, tables, num_blocks = make_block_tables(shape, np.random.default_rng(1), copies)
    assert lens.dtype == np.int32 and tables.dtype == np.int32
    assert tables.shape == (copies, shape.batch, shape.max_blocks)
    assert (lens >= 1).all() and (lens <= shape.capacity).all()
    if not shape.ragged:
        assert (lens == shape.context).all()
    nb = -(-lens // shape.block_size)
    used = np.arange(shape.max_blocks)[None, :] < nb[:, None]
    valid = tables[:, used]
    assert valid.size == copies * nb.sum()
    assert len(np.unique(valid)) == valid.size  # no physical block is shared
    assert (tables >= 0).all() and (tables < num_blocks).all()  # tails too: valid ids
    assert num_blocks - valid.size <= valid.size // 100 + 1  # only a little spare
    assert not (np.diff(valid.reshape(-1)) == 1).all()  # shuffled, not sequential


def test_ragged_lengths_spread():
    shape = shape_by_name("ragged_b64_ctx8192")
    lens, _, _ = make_block_tables(shape, np.random.default_rng(0))
    assert lens.min() < 2048 and lens.max() > 6144 and len(np.unique(lens)) > 32


@pytest.mark.parametrize("name,backend", [("small_ragged_b4_ctx96", "numpy"),
                                          ("small_fp8_b2_ctx64", "numpy"),
                                          ("small_fp8_b2_ctx64", "jax")])
def test_make_decode_inputs(name, backend):
    shape = shape_by_name(name)
    inputs = make_decode_inputs(shape, seed=3, copies=2, backend=backend)
    q, k_cache, v_cache, tables, lens = inputs.args(1)
    assert q.shape == (shape.batch, shape.num_heads, shape.head_dim)
    assert str(q.dtype) == shape.query_dtype
    assert k_cache.shape == v_cache.shape == (inputs.num_blocks, shape.block_size,
                                              shape.num_kv_heads, shape.head_dim)
    assert str(k_cache.dtype) == shape.dtype
    np.testing.assert_array_equal(np.asarray(tables), inputs.block_tables_np[1])
    np.testing.assert_array_equal(np.asarray(lens), inputs.context_lens_np)
    k = np.asarray(k_cache).astype(np.float32)
    assert np.isfinite(k).all() and (k != 0).mean() > 0.9  # random normal, not zeros
    dequantized_std = k.std() * (inputs.k_scale or 1.0)
    assert 0.8 < dequantized_std < 1.2
    assert inputs.k_scale == (1 / 16 if shape.dtype == "float8_e4m3fn" else None)
    assert not np.array_equal(np.asarray(inputs.q[0]), np.asarray(inputs.q[1]))
    assert inputs.tokens_read() == int(np.asarray(lens).sum())


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_make_decode_inputs_is_reproducible(backend):
    shape = shape_by_name("small_fp8_b2_ctx64")  # the shapes of test_make_decode_inputs: no recompile
    a, b, c = (make_decode_inputs(shape, seed=seed, copies=2, backend=backend)
               for seed in (5, 5, 6))
    for name in ("q", "k_cache", "v_cache"):
        x, y, z = (np.asarray(getattr(i, name)).astype(np.float32) for i in (a, b, c))
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)
    np.testing.assert_array_equal(a.block_tables_np, b.block_tables_np)


def test_sliding_window_reads_only_the_window():
    shape = shape_by_name("swa1024_b8_ctx32768")
    assert shape.tokens_read(np.full(8, 32768)) == 8 * 1024
    assert shape.tokens_read([10, 5000]) == 10 + 1024


# ----------------------------------------------------------------------------------------------
# bench pieces that need no device work


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: s.name)
def test_jax_paged_attention_configs_are_valid(shape):
    configs = bench.jax_pa_configs(shape, shape.max_blocks, 6, 132)
    assert 1 <= len(configs) <= 6
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for c in configs:
        assert shape.max_blocks % c["k_splits"] == 0
        per_partition = shape.max_blocks // c["k_splits"]
        ppcb = c["pages_per_compute_block"]
        assert per_partition % ppcb == 0 and ppcb & (ppcb - 1) == 0
    assert len({c["k_splits"] for c in configs}) >= 2  # the short sweep spans k_splits


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: s.name)
def test_tune_candidates_are_bounded(shape):
    default = DecodeConfig(block_k=64, num_splits=4, num_warps=4, num_stages=2)
    stage1 = bench.tune_stage1(shape, default, default, persistent_programs=264)
    stage2 = bench.tune_stage2(shape, stage1[0])
    stage3 = bench.tune_stage3(stage1, stage2[0])
    assert len(stage1) <= 26 and len(stage2) <= (30 if shape.cache_itemsize == 1 else 10)
    persistent = [c for c in stage1 if c.persistent_programs]
    assert persistent and all(c.persistent_programs == 264 and c.num_splits == 1
                              for c in persistent)
    assert not any(c.persistent_programs for c in bench.tune_stage1(shape, default, default))
    # stage 1 at rings one and two tiles deep, wherever the tiles fit
    assert {kv_ring_depth(c.num_stages) for c in stage1} == {1, 2}
    assert len(stage3) <= 3
    assert len(set(stage2)) == len(stage2)
    # one config per K/V ring depth, not two programs of one depth (4 stages compile as 3)
    depths = {(c.num_warps, c.fp8_v_at_load, c.fp8_pairs, c.num_stages):
              kv_ring_depth(c.num_stages) for c in stage2}
    assert {c.num_stages for c in stage2} <= set(bench.TUNE_STAGES)
    assert {kv_ring_depth(st) for st in bench.TUNE_STAGES} == {0, 1, 2, 3}
    assert len(depths) == len(stage2)
    assert any(c.fp8_v_at_load for c in stage2) == (shape.cache_itemsize == 1)
    assert any(c.fp8_pairs for c in stage2) == (shape.cache_itemsize == 1)
    assert {c.block_k for c in stage1} <= {16, 32, 64, 128}
    assert len(set(stage1)) == len(stage1)


def test_tuned_snippet_is_python():
    rec = {"name": "b32_ctx4096", "shape": {"sliding_window": None},
           "shape_class": ["bfloat16", 128, 4, 16, 32, 4096],
           "tune": {"best": dict(block_k=32, num_splits=2, num_warps=8, num_stages=3),
                    "default": dict(block_k=64, num_splits=1, num_warps=4, num_stages=2),
                    "best_us": 100.0, "default_us": 120.0}}
    window = dict(rec, name="swa", shape={"sliding_window": 1024},
                  shape_class=["bfloat16", 128, 4, 16, 8, 32768])
    doc = {"meta": {"device": {"device_kind": "NVIDIA H200", "sm_count": 132},
                    "date": "2026-01-01T00:00:00"}, "shapes": [rec, window]}
    snippet = bench.tuned_snippet(doc)
    namespace = {"DecodeConfig": DecodeConfig}
    exec(snippet, namespace)  # noqa: S102 - our own generated code
    assert namespace["TUNED"] == {("bfloat16", 128, 4, 16, 32, 4096):
                                  DecodeConfig(block_k=32, num_splits=2, num_warps=8,
                                               num_stages=3)}


@pytest.mark.parametrize("flags", [dict(merge_in_kernel=True), dict(fp8_v_at_load=True),
                                   dict(fp8_pairs=True)])
def test_tuned_snippet_keeps_the_boolean_fields(flags):
    best = dict(block_k=64, num_splits=64, num_warps=4, num_stages=2, **flags)
    rec = {"name": "b1_ctx32768", "shape": {"sliding_window": None},
           "shape_class": ["bfloat16", 128, 4, 16, 1, 32768],
           "tune": {"best": best, "default": dict(best, **dict.fromkeys(flags, False)),
                    "best_us": 40.0, "default_us": 42.0}}
    doc = {"meta": {"device": {"device_kind": "NVIDIA H200", "sm_count": 132},
                    "date": "2026-01-01T00:00:00"}, "shapes": [rec]}
    namespace = {"DecodeConfig": DecodeConfig}
    exec(bench.tuned_snippet(doc), namespace)  # noqa: S102 - our own generated code
    assert namespace["TUNED"] == {("bfloat16", 128, 4, 16, 1, 32768): DecodeConfig(**best)}


@pytest.mark.parametrize("name", ["small_b2_ctx64", "small_fp8_b2_ctx64"])
def test_profile_kernel_passes_the_caches_as_arguments(name):
    """Closed over, the caches would be captured as constants of the profiled program (a copy
    of every cache byte in its lowering and each compile)."""
    from benchmarks import profile_kernel

    _, fn, args = profile_kernel.decode_call(name, "xla", None)
    text = fn.lower(*args).as_text()
    cache_bytes = args[1].nbytes
    constants = re.findall(r'dense<"0x([0-9A-F]+)">', text)  # hex: 2 digits a byte
    assert max((len(c) // 2 for c in constants), default=0) < cache_bytes


def test_decode_anatomy_times_the_other_fp8_pair_conversion(tmp_path):
    from benchmarks import decode_anatomy
    from pallas_paged.decode_attention import pallas_triton

    path = tmp_path / "anatomy.json"
    assert decode_anatomy.main(["--smoke", "--shapes", "small_fp8_b2_ctx64", "--configs", "none",
                                "--only", "words per", "--json", str(path)]) == 0
    other = 3 - pallas_triton.PAIR_WORDS_PER_CONVERSION
    [row] = json.loads(path.read_text())["rows"]
    assert row["variant"] == f"decode, {other} words per fp8 pair conversion"
    assert row["status"] == "ok" and row["config"]["fp8_pairs"]


def test_decode_anatomy_smoke_runs_only_the_chosen_variants(tmp_path):
    from benchmarks import decode_anatomy

    path = tmp_path / "anatomy.json"
    code = decode_anatomy.main(["--smoke", "--shapes", "small_b2_ctx64", "--configs", "none",
                                "--only", "decode,empty kernel", "--json", str(path)])
    assert code == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["decode", "decode, contiguous pages",
                                            "decode, libdevice expf",
                                            "decode, K/V loads evict_first",
                                            "empty kernel (launch only)"]
    assert all(r["status"] == "ok" and r["median_us"] > 0 for r in rows)


def test_decode_anatomy_times_named_configs_over_the_default(tmp_path):
    from benchmarks import decode_anatomy

    path = tmp_path / "anatomy.json"
    code = decode_anatomy.main(["--smoke", "--shapes", "small_b2_ctx64", "--configs", "none",
                                "--only", "=decode,st3", "--config", "bk16/s2/st3/mk1",
                                "--json", str(path)])
    assert code == 0
    [default, named] = json.loads(path.read_text())["rows"]
    assert default["variant"] == "decode"
    assert named["config"] == {**default["config"], "block_k": 16, "num_splits": 2,
                               "num_stages": 3, "merge_in_kernel": True}
    assert named["variant"] == "decode " + bench.config_label(DecodeConfig(**named["config"]))
    assert named["status"] == "ok" and named["rel_err"] < 1e-2
    with pytest.raises(SystemExit):
        decode_anatomy.main(["--smoke", "--config", "bk16/zz3"])


@pytest.mark.parametrize("parse,label,expected", [
    (bench_mosaic.parse_config, "bk64/st4/c2", {"block_k": 64, "num_stages": 4,
                                                "num_consumers": 2}),
    (bench_mosaic.parse_config, "s8", {"num_splits": 8}),
    (bench_ragged.parse_config, "bq16/sq4/w8", {"block_q": 16, "short_block_q": 4,
                                                "num_warps": 8}),
    (bench_ragged.parse_config, "st2/bk32", {"num_stages": 2, "block_k": 32}),
])
def test_config_labels_parse(parse, label, expected):
    assert parse(label) == expected


@pytest.mark.parametrize("label", ["bk", "x4", "bk64/bk32", "bk64/", "64"])
def test_config_labels_refuse_unknown_repeated_or_empty_parts(label):
    for parse in (bench_mosaic.parse_config, bench_ragged.parse_config):
        with pytest.raises(ValueError, match="expected distinct parts among"):
            parse(label)


@pytest.mark.parametrize("text,expected", [("approx_math=1", ("approx_math", True)),
                                           ("approx_math=0", ("approx_math", False)),
                                           ("reduction_scratch_bytes=4096",
                                            ("reduction_scratch_bytes", 4096))])
def test_mosaic_compiler_params_parse(text, expected):
    assert bench_mosaic.parse_compiler_param(text) == expected


@pytest.mark.parametrize("text", ["approx_math", "approx_math=yes", "=1", "approx_math="])
def test_mosaic_compiler_params_refuse_what_is_not_name_equals_int(text):
    with pytest.raises(ValueError, match="expected NAME=INT"):
        bench_mosaic.parse_compiler_param(text)


def test_kernel_variant_swaps_and_always_restores():
    """`benchmarks.timing.kernel_variant` puts the replacement in place inside, and the original
    back afterwards, also when the body raises."""
    from benchmarks import timing
    from pallas_paged.decode_attention import pallas_triton
    from pallas_paged.ragged_attention import pallas_triton as ragged_triton
    original = pallas_triton.softmax_exp
    replacements = timing.libdevice_exp_variant()
    assert set(replacements) == {(pallas_triton, "softmax_exp"),
                                 (ragged_triton, "softmax_exp")}
    with pytest.raises(RuntimeError):
        with timing.kernel_variant(replacements):
            assert pallas_triton.softmax_exp is not original
            assert ragged_triton.softmax_exp is pallas_triton.softmax_exp
            x = jax.numpy.linspace(-3.0, 3.0, 7)
            np.testing.assert_array_equal(pallas_triton.softmax_exp(x, interpret=False),
                                          jax.numpy.exp(x))
            raise RuntimeError("the body failed")
    assert pallas_triton.softmax_exp is original and ragged_triton.softmax_exp is original


def test_softmax_exp_in_interpret_mode_is_jnp_exp():
    """The kernels' exp without PTX (interpret mode) is exactly ``jnp.exp``, -inf giving 0."""
    from pallas_paged.decode_attention.pallas_triton import softmax_exp
    x = jax.numpy.array([-jax.numpy.inf, -80.0, -1.5, 0.0, 2.0], jax.numpy.float32)
    np.testing.assert_array_equal(softmax_exp(x, interpret=True), jax.numpy.exp(x))


def test_decode_anatomy_times_the_libdevice_exp_variant(tmp_path):
    """The anatomy's A/B row of the softmax's exp runs, is checked and is timed (smoke)."""
    from benchmarks import decode_anatomy

    path = tmp_path / "anatomy.json"
    code = decode_anatomy.main(["--smoke", "--shapes", "small_b2_ctx64", "--configs", "none",
                                "--only", "libdevice", "--json", str(path)])
    assert code == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["variant"] == "decode, libdevice expf"
    assert row["status"] == "ok" and row["rel_err"] < bench.REL_TOL and row["median_us"] > 0


def test_decode_anatomy_times_the_fp8_value_conversion_both_ways(tmp_path, monkeypatch):
    """On an fp8 cache the anatomy's A/B row of `DecodeConfig.fp8_v_at_load` (the default
    config with the field the other way) runs, is checked and is timed (smoke) where the
    default does not read column pairs (which replace it; here the pick is made without them);
    a 16-bit cache has no such row. The read-only probe runs on both."""
    from benchmarks import decode_anatomy

    picked = decode_anatomy.picked_config

    def without_pairs(q, k_cache, tables):
        config = picked(q, k_cache, tables)
        return dataclasses.replace(config, fp8_pairs=False) if config.fp8_pairs else config
    monkeypatch.setattr(decode_anatomy, "picked_config", without_pairs)
    path = tmp_path / "anatomy.json"
    code = decode_anatomy.main(["--smoke", "--shapes", "small_fp8_b2_ctx64,small_b2_ctx64",
                                "--configs", "none", "--only", "fp8 V,read only,words per",
                                "--json", str(path)])
    assert code == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["shape"], r["variant"]) for r in rows] == [
        ("small_fp8_b2_ctx64", "decode, fp8 V converted at load"),
        ("small_fp8_b2_ctx64", "read only bk64 s1 w4 st5"),
        ("small_b2_ctx64", "read only bk64 s1 w4 st2")]
    assert rows[0]["config"]["fp8_v_at_load"] is True
    assert rows[0]["rel_err"] < bench.REL_TOL
    assert all(r["status"] == "ok" and r["median_us"] > 0 for r in rows)


def test_read_only_probe_reads_exactly_the_decode_tiles(rng):
    """`decode_anatomy.read_only_call` sums, per (sequence, kv head, split), the 32-bit words of
    exactly the K and V rows that sequence's first ``n`` positions map to through its table:
    a probe that read other rows (or fewer) would stream other bytes than decode does."""
    from benchmarks import decode_anatomy
    from paged_inputs import make_paged

    paged = make_paged(rng, lens=[37, 0, 16], num_heads=4, num_kv_heads=2, block_size=8,
                       head_dim=32, dtype="bfloat16")
    q, kc, vc, tables, lens = paged.jax()
    config = DecodeConfig(block_k=16, num_splits=2)
    got = np.asarray(decode_anatomy.read_only_call(
        q, decode_anatomy.as_words(kc), decode_anatomy.as_words(vc), tables, lens,
        block_size=8, config=config, interpret=True))
    k_words = np.asarray(decode_anatomy.as_words(kc)).astype(np.uint64)
    v_words = np.asarray(decode_anatomy.as_words(vc)).astype(np.uint64)
    tables_np, lens_np = np.asarray(tables), np.asarray(lens)
    for b, n in enumerate(lens_np):
        tiles = -(-int(n) // 16)
        for split in range(2):  # `split_share`'s balanced shares
            lo, hi = (0, -(-tiles // 2)) if split == 0 else (-(-tiles // 2), tiles)
            positions = np.arange(lo * 16, min(hi * 16, n))
            slots = tables_np[b, positions // 8] * 8 + positions % 8
            for h in range(2):
                want = (k_words[slots, h].sum() + v_words[slots, h].sum()) % 2**32
                assert got[b, h, split] == want, (b, h, split)


def test_bench_ragged_times_config_overrides_and_the_exp_variant(tmp_path, capsys):
    """``--config`` rows are the default config with the named fields replaced (an invalid
    combination is an error row, not a crash), ``--libdevice-exp`` adds the exp A/B row, and the
    table's "best" is a config, never the exp variant."""
    path = tmp_path / "ragged.json"
    code = bench_ragged.main(["--smoke", "--shapes", "smoke_mixed_2x8c20_6dec30", "--config",
                              "w8", "--config", "bq3", "--libdevice-exp", "--json", str(path)])
    assert code == 0
    (record,) = json.loads(path.read_text())["shapes"]
    rows = {r["variant"]: r for r in record["rows"]}
    default = rows["pallas"]
    configured = [r for r in record["rows"] if r["variant"] == "pallas_config"]
    by_status = {r["status"]: r for r in configured}
    assert sorted(by_status) == ["error", "ok"]
    assert "block_q=3 must be a power of two" in by_status["error"]["error"]
    assert by_status["ok"]["config"] == {**default["config"], "num_warps": 8}
    exp_row = rows["pallas_libdevice_exp"]
    assert exp_row["status"] == "ok" and exp_row["config"] == default["config"]
    assert exp_row["label"].endswith("libdevice expf")
    table = bench_ragged.format_table(json.loads(path.read_text()))
    assert "libdevice" not in table


def test_bench_ragged_runs_an_fp8_cache_with_and_without_the_pairs(tmp_path):
    """An fp8 shape gets its scales and bf16 queries, its bytes count one per K/V element, and
    the ``pr1`` row (`AttentionConfig.fp8_pairs`) is checked against the reference like the
    default."""
    path = tmp_path / "ragged.json"
    code = bench_ragged.main(["--smoke", "--shapes", "smoke_fp8_mixed_2x8c20_6dec30", "--config",
                              "pr1", "--json", str(path)])
    assert code == 0
    (record,) = json.loads(path.read_text())["shapes"]
    shape = next(x for x in bench_ragged.SMOKE_SHAPES if x.name == record["name"])
    assert shape.scales == dict(k_scale=1 / 16, v_scale=1 / 16)
    assert shape.query_dtype == "bfloat16"
    q_lens, lens = shape.lengths()
    kv_bytes = int(lens.sum()) * shape.num_kv_heads * shape.head_dim * 2  # K and V, 1 byte each
    assert record["bytes"] == kv_bytes + int(q_lens.sum()) * shape.num_heads * shape.head_dim * 4
    rows = {r["variant"]: r for r in record["rows"]}
    assert rows["pallas"]["status"] == rows["pallas_config"]["status"] == "ok"
    assert rows["pallas_config"]["config"] == {**rows["pallas"]["config"], "fp8_pairs": True}
    assert rows["pallas_config"]["label"].endswith(" pr1")


# ----------------------------------------------------------------------------------------------
# the smoke run


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    path, plot = out / "bench.json", out / "bench.png"
    doc = bench.main(["--smoke", "--shapes", SMOKE_SHAPE, "--json", str(path), "--plot",
                      str(plot)])
    with open(path) as f:
        return doc, json.load(f), plot


def test_smoke_json_has_the_run_facts(smoke):
    _, doc, _ = smoke
    meta = doc["meta"]
    assert meta["device"]["device_kind"] and meta["device"]["backend"] == jax.default_backend()
    assert meta["versions"]["jax"] == jax.__version__ and "jaxlib" in meta["versions"]
    assert meta["date"] and meta["argv"][1:3] == ["--smoke", "--shapes"]
    assert set(meta["impls"]) == set(bench.IMPLS)
    copy = doc["copy_bandwidth"]
    assert _finite_positive(copy["tbps"]) and _finite_positive(copy["start"]["copy"]["tbps"])
    assert _finite_positive(copy["end"]["tbps"])
    assert doc["table"] and any("DECODE" in line for line in doc["table"])


def test_smoke_decode_rows(smoke):
    _, doc, _ = smoke
    (record,) = doc["shapes"]
    assert record["name"] == SMOKE_SHAPE and record["status"] == "done"
    assert record["copies"] >= 1 and record["mode"] == "loop"
    assert record["decode_bytes"] > record["tokens_read"] > 0
    rows = {r["impl"]: r for r in record["results"]}
    assert {"pallas", "xla", "jax_paged_attention"} <= set(rows)
    for impl in ("pallas", "xla", "jax_paged_attention"):
        r = rows[impl]
        assert r["status"] == "ok", r.get("error")
        for key in ("median_us", "min_us", "tbps", "frac_copy_bw", "bytes", "compile_s"):
            assert _finite_positive(r[key]), (impl, key, r[key])
        assert r["min_us"] <= r["median_us"] <= r["max_us"]
        assert r["bytes"] == record["decode_bytes"]
    for impl in ("pallas", "jax_paged_attention"):
        assert rows[impl]["correct"] is True and not rows[impl]["nan"]
        assert rows[impl]["rel_err"] < bench.REL_TOL
        assert _finite_positive(rows[impl]["speedup_vs_jax"])
    assert rows["xla"]["correct"] is True  # every impl is held to the float64 oracle
    assert rows["pallas"]["config"] == record["default_config"]
    # head_dim 32: the Mosaic kernel refuses it (and jax 0.10.2 any shape), with its reason.
    mosaic = rows["mosaic"]
    assert mosaic["status"] == "not run" and "median_us" not in mosaic
    reason = ("needs jax >= 0.11.2" if mosaic_gpu.jax_version() < mosaic_gpu.MIN_JAX
              else "head_dim in (64, 128, 192, 256)")
    assert reason in mosaic["reason"]
    assert mosaic["config"] == record["mosaic_config"]
    assert any("NOT RUN: impl='mosaic'" in line for line in doc["table"])
    # impl="auto": no table entry for the class, so the Triton kernel (on a CPU, interpret mode
    # would rule Mosaic out anyway).
    assert record["auto"]["impl"] == "pallas" and record["auto"]["table"] is None
    if jax.default_backend() != "gpu":
        assert record["auto"]["mosaic_refusal"] == "interpret mode"


def test_smoke_runs_mosaic_beside_pallas(tmp_path, monkeypatch):
    """On a head_dim-64 shape the Mosaic kernel runs where it can (interpret mode with jax >=
    0.11.2, or an sm_90 GPU), checked against the oracle and timed like the Triton kernel, with
    its speed-up over it; elsewhere (jax 0.10.2) its row says why not."""
    shape = bench_mosaic.SMOKE_SHAPES[0]  # bf16, H=8, KVH=2, D=64, bs=16, ctx 128
    by_name = bench.shape_by_name
    monkeypatch.setattr(bench, "shape_by_name",
                        lambda name: shape if name == shape.name else by_name(name))
    path = tmp_path / "bench.json"
    doc = bench.main(["--smoke", "--shapes", shape.name, "--impls", "pallas,mosaic",
                      "--json", str(path)])
    (record,) = json.loads(path.read_text())["shapes"]
    rows = {r["impl"]: r for r in record["results"]}
    _, refusal = bench.mosaic_plan(shape, not bench.has_gpu(), bench.sm_count())
    if jax.default_backend() != "gpu":  # interpret mode: the version alone decides
        assert (refusal is None) == (mosaic_gpu.jax_version() >= mosaic_gpu.MIN_JAX)
    mosaic = rows["mosaic"]
    assert mosaic["config"] == record["mosaic_config"]
    if refusal is None:
        assert mosaic["status"] == "ok", mosaic.get("error")
        assert mosaic["correct"] is True and mosaic["rel_err"] < bench.REL_TOL
        assert _finite_positive(mosaic["median_us"]) and _finite_positive(mosaic["frac_copy_bw"])
        assert _finite_positive(mosaic["speedup_vs_pallas"])
        assert mosaic["speedup_vs_pallas"] == pytest.approx(
            rows["pallas"]["median_us"] / mosaic["median_us"])
        assert "IMPL_CHOICE" in doc["impl_choice"]
    else:
        assert mosaic["status"] == "not run" and mosaic["reason"] == refusal
        assert "needs jax >= 0.11.2" in refusal or jax.default_backend() == "gpu"
    assert rows["pallas"]["status"] == "ok" and rows["pallas"]["correct"] is True
    assert bench.exit_status(doc) == 0


def test_impl_choice_snippet_is_python():
    """Mosaic where it beat the Triton kernel by the margin on every shape of the class, else
    pallas; a class measured only with a window is a comment."""
    def rec(name, key, pallas_us, mosaic_us, window=None):
        timed = dict(status="ok", correct=True)
        return {"name": name, "shape": {"sliding_window": window}, "shape_class": list(key),
                "results": [dict(timed, impl="pallas", median_us=pallas_us),
                            dict(timed, impl="mosaic", median_us=mosaic_us)]}
    b1 = ("bfloat16", 128, 4, 16, 1, 32768)
    b32 = ("bfloat16", 128, 4, 16, 32, 4096)
    close = ("float16", 128, 4, 16, 32, 4096)
    mixed = ("bfloat16", 128, 4, 16, 64, 8192)
    window = ("bfloat16", 128, 4, 16, 8, 65536)
    doc = {"meta": {"device": {"device_kind": "NVIDIA H200", "sm_count": 132},
                    "date": "2026-01-01T00:00:00"},
           "shapes": [rec("b1", b1, 60.0, 55.0), rec("b32", b32, 100.0, 120.0),
                      rec("fp16", close, 100.0, 99.0), rec("m1", mixed, 100.0, 80.0),
                      rec("m2", mixed, 100.0, 101.0), rec("swa", window, 50.0, 40.0, 1024),
                      {"name": "not_run", "shape": {"sliding_window": None},
                       "shape_class": ["float32", 128, 4, 16, 32, 4096],
                       "results": [{"impl": "pallas", "status": "ok", "correct": True,
                                    "median_us": 1.0},
                                   {"impl": "mosaic", "status": "not run", "reason": "fp32"}]}]}
    snippet = bench.impl_choice_snippet(doc)
    namespace = {}
    exec(snippet, namespace)  # noqa: S102 - our own generated code
    assert namespace["IMPL_CHOICE"] == {"NVIDIA H200": {
        b1: "mosaic", b32: "pallas", close: "pallas", mixed: "pallas"}}
    assert "swa" in snippet and "not_run" not in snippet


def test_plan_names_the_mosaic_rows_and_auto():
    s = bench.build_settings(bench.parse_args(["--smoke"]))
    shapes = [bench.shape_by_name(n) for n in (SMOKE_SHAPE, "fp16_b32_ctx4096")]
    text = bench.plan(shapes, ("pallas", "mosaic"), s, False, 132).splitlines()
    assert "mosaic not run" in text[1] and "auto=pallas" in text[1]  # head_dim 32
    runs = bench.mosaic_plan(shapes[1], s.interpret, 132)[1] is None
    assert ("mosaic 1" if runs else "mosaic not run") in text[2]


def test_smoke_write_rows(smoke):
    _, doc, _ = smoke
    rows = {(r["impl"], r["key"][4]): r for r in doc["writes"]}
    assert set(rows) == {(i, k) for i in ("write_xla", "write_pallas") for k in ("step", "prefill")}
    for r in rows.values():
        assert r["status"] == "ok", r.get("error")
        assert r["write_ok"] is True and r["donated"] is True
        for key in ("median_us", "tbps", "frac_copy_bw", "rw_tbps", "rw_frac_copy_bw"):
            assert _finite_positive(r[key]), key
        assert r["rw_bytes"] > r["bytes"] and r["rw_tbps"] > r["tbps"]


def test_smoke_outputs(smoke):
    returned, doc, plot = smoke
    assert returned["shapes"][0]["name"] == doc["shapes"][0]["name"]
    assert plot.exists() and plot.stat().st_size > 1000


def test_unknown_shape_is_an_error():
    with pytest.raises(ValueError, match="unknown shape"):
        bench.resolve_shapes("b32_ctx4096,nope", smoke=False)


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "b32_ctx4096,nope"], "unknown shape 'nope'"),
    (["--shapes", ","], "names no shape"),
    (["--impls", "pallas,triton"], r"unknown \['triton'\]"),
    (["--impls", ","], "--impls"),
    (["--repeats", "0"], "--repeats: 0 must be >= 1"),
    (["--repeats", "two"], "--repeats: 'two' is not a whole number"),
    (["--window-ms", "-1"], "--window-ms: -1.0 must be >= 0.0"),
    (["--copy-gib", "0"], "--copy-gib: 0.0 must be > 0.0"),
    (["--copies", "-1"], "--copies: -1 must be >= 0"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(argv)
    assert stop.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_arguments_resolve_shapes_and_impls():
    args = bench.parse_args(["--shapes", "small_b2_ctx64", "--impls", "pallas, write,pallas"])
    assert [s.name for s in args.shape_list] == ["small_b2_ctx64"]
    assert args.impl_list == ("pallas", "write")
    assert bench.parse_args(["--tune"]).impl_list == ("pallas",)
    assert bench.parse_args([]).impl_list == bench.IMPLS
    assert "mosaic" in bench.IMPLS and "mosaic" in bench.DECODE_IMPLS
    assert bench.parse_args(["--impls", "mosaic"]).impl_list == ("mosaic",)


def test_exit_status_counts_wrong_rows():
    ok = {"shapes": [{"results": [{"shape": "s", "impl": "pallas", "label": "c", "correct": True},
                                  {"shape": "s", "impl": "xla", "status": "error"}]}],
          "writes": [{"shape": "s", "impl": "write_xla", "label": "w", "write_ok": True}]}
    assert bench.exit_status(ok) == 0
    wrong_decode = {"shapes": [{"results": [{"shape": "s", "impl": "pallas", "label": "c",
                                             "correct": False}]}], "writes": []}
    assert bench.wrong_rows(wrong_decode) == ["s/pallas/c"]
    assert bench.exit_status(wrong_decode) == 1
    wrong_write = dict(ok, writes=[{"shape": "s", "impl": "write_pallas", "label": "w",
                                    "write_ok": False}])
    assert bench.exit_status(wrong_write) == 1
    assert bench.exit_status(dict(ok, interrupted="signal 15")) == 130


def test_smoke_run_is_right_and_exits_0(smoke):
    returned, _, _ = smoke
    assert bench.wrong_rows(returned) == [] and bench.exit_status(returned) == 0


def test_a_wrong_kernel_is_reported_wrong(monkeypatch):
    """A planted bug (pallas output shifted by 0.5) is caught against the float64 oracle."""
    real = bench.decode

    def shifted(*args, impl, **kwargs):
        out = real(*args, impl=impl, **kwargs)
        return out + 0.5 if impl == "pallas" else out

    monkeypatch.setattr(bench, "decode", shifted)
    doc = bench.main(["--smoke", "--shapes", SMOKE_SHAPE, "--impls", "pallas,xla"])
    rows = {r["impl"]: r for r in doc["shapes"][0]["results"]}
    assert rows["pallas"]["correct"] is False and rows["xla"]["correct"] is True
    assert bench.wrong_rows(doc) == [f"{SMOKE_SHAPE}/pallas/{rows['pallas']['label']}"]
    assert bench.exit_status(doc) == 1


def test_cli_usage_error_exits_2():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--repeats", "0"],
                          capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert done.returncode == 2 and "--repeats: 0 must be >= 1" in done.stderr


def test_cli_lists_shapes():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--list"], check=True,
                         capture_output=True, text=True, timeout=120, cwd=root, env=env).stdout
    assert all(s.name in out for s in ALL_SHAPES + SMALL_SHAPES)


def test_sharded_smoke_run(tmp_path):
    """bench_sharded on 2 virtual CPU devices: every variant runs and agrees with one device;
    the copy bandwidth of one and of two devices at once is measured."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "sharded.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_sharded", "--smoke", "--json",
                           str(path)], capture_output=True, text=True, timeout=300, cwd=root,
                          env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(path.read_text())
    assert {r["name"]: r["status"] for r in report["variants"]} == {
        name: "ok" for name in ("1gpu", "tp2", "dp2", "dp2-weak", "tp2-weak")}
    assert all(r["max_abs_diff_vs_1gpu"] < 1e-2 for r in report["variants"])
    for n in ("1", "2"):
        copy = report["copy_bandwidth"][n]
        assert copy["devices"] == int(n) and _finite_positive(copy["tbps"])
        assert copy["source"] in ("copy", "not")


def test_copy_bandwidth_measures_every_jax_way():
    from benchmarks.timing import TimerSettings, copy_ceiling, measure_copy_bandwidth
    s = TimerSettings(windows=3, window_s=0.0, warmup_s=0.0, min_calls=1, max_calls=8)
    result = measure_copy_bandwidth(1 << 20, s)
    ways = ("copy", "not") + (("torch_copy",) if "torch_copy" in result else ())
    assert "torch_copy" not in result or jax.default_backend() == "gpu"
    for way in ways:
        assert _finite_positive(result[way]["tbps"]), result[way]
        windows = result[way]["windows_us"]
        assert len(windows) == 3
        assert result[way]["spread"] == pytest.approx(
            (max(windows) - min(windows)) / result[way]["median_us"])
    assert {k: result[k] for k in ("source", "tbps", "imprecise")} == copy_ceiling(result)
    assert result["source"] in ways


def test_copy_bandwidth_tool_prints_and_writes_every_way(tmp_path, capsys):
    """`python -m benchmarks.copy_bandwidth --smoke`: one line with the ceiling and every way's
    rate and spread, and the measurement as JSON."""
    from benchmarks import copy_bandwidth

    path = tmp_path / "copy.json"
    assert copy_bandwidth.main(["--smoke", "--json", str(path)]) == 0
    line = capsys.readouterr().out
    copy = json.loads(path.read_text())["copy"]
    assert copy["bytes"] == 1 << 20 and copy["source"] in ("copy", "not", "torch_copy")
    for way in ("copy", "not"):
        assert _finite_positive(copy[way]["tbps"]) and copy[way]["spread"] >= 0
        assert f"{way} {copy[way]['tbps']:.3f} (spread " in line
    with pytest.raises(SystemExit):
        copy_bandwidth.main(["--gib", "0"])


def test_read_bandwidth_sums_the_bytes_once():
    """`measure_read_bandwidth`: the jitted sum's rate counts each byte once (half a copy's count
    for the same time), its windows and spread as the copy's ways; torch's way only on a GPU."""
    from benchmarks.timing import (READ_WAYS, TimerSettings, copy_ceiling, measure_read_bandwidth,
                                   read_summary)
    s = TimerSettings(windows=3, window_s=0.0, warmup_s=0.0, min_calls=1, max_calls=8)
    result = measure_read_bandwidth(1 << 20, s)
    assert result["bytes"] == 1 << 20
    assert "torch_sum" not in result or jax.default_backend() == "gpu"
    way = result["sum"]
    assert len(way["windows_us"]) == 3
    assert way["tbps"] == pytest.approx((1 << 20) / (way["median_us"] * 1e-6) / 1e12)
    assert {k: result[k] for k in ("source", "tbps", "imprecise")} == \
        copy_ceiling(result, READ_WAYS)
    assert result["source"] in READ_WAYS
    assert read_summary(result).startswith(f"{result['tbps']:.3f} TB/s read ({result['source']}")


def test_read_bandwidth_records_a_wrong_sum(monkeypatch):
    """A way whose sum is not the count of what it read is an error in the result, not a rate."""
    from benchmarks import timing
    monkeypatch.setattr(timing.jnp, "sum", lambda x: x[:-1024].sum())
    s = timing.TimerSettings(windows=2, window_s=0.0, warmup_s=0.0, min_calls=1, max_calls=2)
    result = timing.measure_read_bandwidth(1 << 20, s)
    assert "gave" in result["sum"]["error"] and "tbps" not in result["sum"]


def test_copy_bandwidth_tool_reads_too(tmp_path, capsys):
    """``copy_bandwidth --read``: a second line with the read rate and its ratio to the copy, and
    the measurement under ``read`` in the JSON."""
    from benchmarks import copy_bandwidth

    path = tmp_path / "copy.json"
    assert copy_bandwidth.main(["--smoke", "--read", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    read = doc["read"]
    assert read["bytes"] == 1 << 20 and _finite_positive(read["sum"]["tbps"])
    assert f"sum {read['sum']['tbps']:.3f} (spread " in out
    assert "read rate over 0.001 GiB:" in out and "of the copy" in out


def test_copy_ceiling_is_the_fastest_way_whose_windows_agree():
    """A way whose windows spread past `COPY_SPREAD_LIMIT` does not set the ceiling however fast
    its median; with no precise way, the largest of all, flagged."""
    from benchmarks.timing import COPY_SPREAD_LIMIT, copy_ceiling
    ways = {"torch_copy": {"tbps": 4.30, "spread": 0.003},
            "copy": {"tbps": 4.41, "spread": 0.48},  # fastest, but its windows disagree
            "not": {"tbps": 4.29, "spread": COPY_SPREAD_LIMIT},  # at the limit: counts
            "bytes": 1 << 32, "jax_error": "not a way"}
    assert copy_ceiling(ways) == {"source": "torch_copy", "tbps": 4.30, "imprecise": False}
    ways["not"]["tbps"] = 4.35
    assert copy_ceiling(ways) == {"source": "not", "tbps": 4.35, "imprecise": False}
    noisy = {k: {"tbps": v["tbps"], "spread": 0.2} for k, v in ways.items()
             if isinstance(v, dict)}
    assert copy_ceiling(noisy) == {"source": "copy", "tbps": 4.41, "imprecise": True}
    failed = {"copy": {"error": "RuntimeError: x"}, "bytes": 1}
    result = copy_ceiling(failed)
    assert result["source"] is None and math.isnan(result["tbps"]) and not result["imprecise"]


def test_jsonable_writes_strict_json():
    from benchmarks.timing import jsonable
    doc = {"a": np.float32(1.5), "b": (np.int64(3), float("nan")), 4: np.arange(2),
           "c": [float("inf"), -float("inf"), None, True, np.bool_(False)], "d": DecodeConfig}
    text = json.dumps(jsonable(doc), allow_nan=False)
    assert json.loads(text) == {"a": 1.5, "b": [3, "nan"], "4": [0, 1],
                                "c": ["inf", "-inf", None, True, False], "d": str(DecodeConfig)}



def test_ncu_opcodes_sums_the_source_page_by_opcode(tmp_path):
    """`benchmarks.ncu_opcodes`: instructions and stall samples summed per opcode (predicates
    dropped), shares of the totals, ncu's own lines before the header skipped."""
    from benchmarks import ncu_opcodes

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
    assert "BAR.SYNC" not in text  # third by instructions: cut by top=2
    (tmp_path / "empty.csv").write_text("nothing\n")
    assert ncu_opcodes.main([str(tmp_path / "empty.csv")]) == 2


@pytest.mark.parametrize("label,expected", [
    ("bk32/s4/w2/st2/vl1", dict(block_k=32, num_splits=4, num_warps=2, num_stages=2,
                                fp8_v_at_load=True)),
    ("vl0", dict(fp8_v_at_load=False)),
    ("s16/st9/mk1", dict(num_splits=16, num_stages=9, merge_in_kernel=True)),
    ("bk64/pr1", dict(block_k=64, fp8_pairs=True)),
    ("bk64/p33", dict(block_k=64, persistent_programs=33))])
def test_decode_config_labels_round_trip(label, expected):
    from benchmarks import triton_sass
    assert bench.parse_decode_config(label) == expected
    assert triton_sass.parse_config(label) == expected
    config = DecodeConfig(**{**dict(block_k=64, num_splits=1, num_warps=4, num_stages=2),
                             **expected})
    omitted_when_off = ("merge_in_kernel", "fp8_v_at_load", "fp8_pairs", "persistent_programs")
    assert bench.parse_decode_config(bench.config_label(config)) == {
        k: v for k, v in dataclasses.asdict(config).items() if k not in omitted_when_off or v}
    with pytest.raises(ValueError, match="vl takes 0 or 1"):
        bench.parse_decode_config("vl2")
    with pytest.raises(ValueError, match="mk takes 0 or 1"):
        bench.parse_decode_config("mk3")


def test_kv_ring_depth_follows_the_stages_split_between_table_and_tile_loads():
    """Two chained loads (block ids, then the K/V rows they address) share ``num_stages - 1``:
    2 to 4 stages keep one tile in flight, 5 and 6 two, 7 and 8 three; 1 pipelines nothing."""
    assert [kv_ring_depth(st) for st in range(1, 9)] == [0, 1, 1, 1, 2, 2, 3, 3]


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
    """What `benchmarks.triton_sass` prints besides opcodes, on text of the forms it reads: the
    longest backward branch's span (the tile loop), the K/V rings' depth (not the block ids'),
    programs per sm_90 multiprocessor by their binding limit (figures of compiled kernels)."""
    from benchmarks import triton_sass

    assert triton_sass.loop_instructions(_SASS_WITH_A_LOOP) == 4  # 0x20 .. 0x50
    assert triton_sass.copies_left_in_flight(_SASS_WITH_A_LOOP) == 1
    assert triton_sass.copies_left_in_flight(_SASS_WITH_A_LOOP.replace("DEPBAR.LE SB0, 0x1",
                                                                       "NOP")) is None
    assert triton_sass.ring_depths_in_ttgir(_TTGIR_RINGS, block_k=32) == [2, 2]
    assert triton_sass.ring_depths_in_ttgir(_TTGIR_RINGS, block_k=64) == []
    assert triton_sass.programs_per_sm(128, 21504, 2) == (8, "registers")
    assert triton_sass.programs_per_sm(109, 55808, 4) == (4, "registers")
    assert triton_sass.programs_per_sm(168, 55808, 2) == (4, "shared memory")
    assert triton_sass.programs_per_sm(32, 1024, 1) == (32, "blocks")
    assert triton_sass.programs_per_sm(24, 1024, 16) == (4, "warps")
    config = DecodeConfig(block_k=32, num_splits=4, num_warps=2, num_stages=5,
                          fp8_v_at_load=True)
    line = triton_sass.pipeline_summary("fp8_b32_ctx4096", config, dict(
        registers=128, shared_bytes=29952, loop_instructions=567, ring_depths=[2, 2],
        copies_left_in_flight=3))
    assert line.startswith("bk32/s4/w2/st5/vl1: 128 regs, 29952 B smem; tile loop 567"
                           " instrs/warp (35.4 per token), its wait leaves 3 copy groups in"
                           " flight; K/V ring 2 deep")
    # 1024 programs, 7 per multiprocessor (shared memory): 7 x 2 tiles x 8 KiB
    assert "K/V ring 2 deep; 7 programs/SM (by shared memory), grid 1024 = 1.11 waves" in line
    assert line.endswith("K/V in flight <= 112 KiB/SM")
    wrong = triton_sass.pipeline_summary("fp8_b32_ctx4096", config, dict(
        registers=128, shared_bytes=29952, loop_instructions=567, ring_depths=[1, 2],
        opcodes={"STL.64": 3, "LDL": 2, "HMMA.16816.F32": 32}))
    assert "(kv_ring_depth says 2)" in wrong
    assert "29952 B smem, 5 local-memory (spill) instructions; tile loop" in wrong
    ragged = AttentionConfig(block_q=16, short_block_q=4, block_k=64, num_stages=3)
    line = triton_sass.pipeline_summary("mixed_4x512c2560_60dec4096", ragged, dict(
        registers=255, shared_bytes=82944, loop_instructions=1017, ring_depths=[1, 1, 2, 1]))
    assert line == ("bq16/sq4/bk64/s1/w4/st3: 255 regs, 82944 B smem; tile loop 1017"
                    " instrs/warp (63.6 per token); K/V rings 1 deep x3, 2 deep x1; 2"
                    " programs/SM (by registers)")


def test_triton_sass_lowers_the_ragged_kernel_of_a_ragged_shape():
    """A ragged shape's name gives the ragged kernel, configured from its own labels."""
    from benchmarks import triton_sass

    fields = triton_sass.parse_config("bq16/sq4/st5", "mixed_4x512c2560_60dec4096")
    assert fields == dict(block_q=16, short_block_q=4, num_stages=5)
    config = triton_sass.kernel_config("mixed_4x512c2560_60dec4096", fields)
    assert isinstance(config, AttentionConfig) and config.num_stages == 5
    head = triton_sass.triton_ir("mixed_4x512c2560_60dec4096", config).split("\n", 1)[0]
    assert "pallas_paged_ragged_bq16_sq4" in head
    with pytest.raises(ValueError):
        triton_sass.parse_config("vl1", "mixed_4x512c2560_60dec4096")


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 5, 7])
def test_kv_ring_depth_is_what_triton_compiles(num_stages):
    """The rule of `kv_ring_depth` against the compiled bf16 decode kernel: the depth of its K
    and V rings in the Triton GPU IR, and whether the tile loop's wait leaves copies in flight
    (only with a ring two or more deep)."""
    pytest.importorskip("triton")
    import tempfile
    from benchmarks import triton_sass

    config = triton_sass.kernel_config("b32_ctx4096", {"num_stages": num_stages})
    with tempfile.TemporaryDirectory() as out:
        result = triton_sass.compile_sass(triton_sass.triton_ir("b32_ctx4096", config), config,
                                          out)
    depth = kv_ring_depth(num_stages)
    assert result["ring_depths"] == ([depth] * 2 if depth else [])
    if depth:
        assert (result["copies_left_in_flight"] > 0) == (depth > 1)


def test_triton_sass_takes_the_decode_kernel_of_the_named_shape():
    """Lowered for CUDA on the CPU, the IR is the decode kernel of the shape's config (its name
    says the tile, splits and ``fp8_v_at_load``), with both dots; compiled to SASS where the
    ``triton`` package is installed."""
    from benchmarks import triton_sass

    config = triton_sass.kernel_config("fp8_b32_ctx4096", {"fp8_v_at_load": True,
                                                            "fp8_pairs": False,
                                                            "num_stages": 2})
    ir_text = triton_sass.triton_ir("fp8_b32_ctx4096", config)
    head = ir_text.split("\n", 1)[0]
    assert f"pallas_paged_decode_bk{config.block_k}_s{config.num_splits}" in head
    assert head.rstrip(" {").endswith("_vload")
    assert ir_text.count("tt.dot ") == 2
    plain = triton_sass.triton_ir("fp8_b32_ctx4096", dataclasses.replace(config,
                                                                          fp8_v_at_load=False))
    assert "_vload" not in plain.split("\n", 1)[0]
    pytest.importorskip("triton")
    import tempfile
    result = triton_sass.compile_sass(ir_text, config, tempfile.mkdtemp())
    assert result["registers"] and result["opcodes"]["HMMA.16816.F32"] > 0
    assert "LDS.U8" not in result["opcodes"]
    assert set(result["ring_depths"]) == {kv_ring_depth(config.num_stages)}
    assert result["copies_left_in_flight"] == 0  # one tile deep: waits for all its copies
    assert result["loop_instructions"] > 0
    deeper = dataclasses.replace(config, num_stages=5)
    result = triton_sass.compile_sass(triton_sass.triton_ir("fp8_b32_ctx4096", deeper), deeper,
                                      tempfile.mkdtemp())
    assert result["ring_depths"] == [kv_ring_depth(5)] * 2 == [2, 2]
    assert result["copies_left_in_flight"] > 0  # the next tile's copies stay in flight


def test_fp8_pairs_give_every_dot_16_bit_operand_layouts():
    """With `DecodeConfig.fp8_pairs` the fp8 kernel has four dots (each of half the head
    dimension) whose operands Triton lays out two elements per register along K (``kWidth =
    2``), as for a bf16 cache, where the fp8 tiles loaded as bytes make it four."""
    pytest.importorskip("triton")
    import tempfile
    from benchmarks import triton_sass

    def compiled(fields):
        config = triton_sass.kernel_config("fp8_b32_ctx4096", fields)
        ir_text = triton_sass.triton_ir("fp8_b32_ctx4096", config)
        out = tempfile.mkdtemp()
        triton_sass.compile_sass(ir_text, config, out)
        with open(os.path.join(out, "kernel.ttgir")) as f:
            return ir_text, set(re.findall(r"kWidth = (\d+)", f.read()))

    ir_text, widths = compiled({"fp8_pairs": True})
    assert ir_text.split("\n", 1)[0].rstrip(" {").endswith("_pairs")
    assert ir_text.count("tt.dot ") == 4 and "cvt.rn.f16x2.e4m3x2" in ir_text
    assert widths == {"2"}
    assert compiled({"fp8_pairs": False, "fp8_v_at_load": True})[1] == {"4"}


def test_fp8_pairs_two_words_per_conversion_share_the_byte_permutes():
    """`pallas_triton.PAIR_WORDS_PER_CONVERSION` = 2, compiled for sm_90 on the CPU: the same
    conversions and 16-bit operand layouts, one byte permute per two conversions where one
    word per conversion takes one per conversion, a shorter tile loop."""
    pytest.importorskip("triton")
    import tempfile
    from benchmarks import triton_sass
    from benchmarks.timing import kernel_variant
    from pallas_paged.decode_attention import pallas_triton

    config = triton_sass.kernel_config("fp8_b32_ctx4096", {"fp8_pairs": True})
    compiled = {}
    for words in (1, 2):
        with kernel_variant({(pallas_triton, "PAIR_WORDS_PER_CONVERSION"): words}):
            ir_text = triton_sass.triton_ir("fp8_b32_ctx4096", config)
        out = tempfile.mkdtemp()
        result = triton_sass.compile_sass(ir_text, config, out)
        with open(os.path.join(out, "kernel.ttgir")) as f:
            widths = set(re.findall(r"kWidth = (\d+)", f.read()))
        compiled[words] = result, widths, ir_text
    (one, one_widths, one_ir), (two, two_widths, two_ir) = compiled[1], compiled[2]
    assert one_widths == two_widths == {"2"}
    assert "prmt.b32" in two_ir and "prmt.b32" not in one_ir
    conversions = "F2FP.F16.E4M3.UNPACK_B"
    assert one["opcodes"][conversions] == two["opcodes"][conversions] > 0
    assert one["opcodes"]["PRMT"] - two["opcodes"]["PRMT"] >= one["opcodes"][conversions] // 4
    assert two["loop_instructions"] < one["loop_instructions"]


@pytest.mark.skipif(mosaic_gpu.jax_version() < mosaic_gpu.MIN_JAX,
                    reason="plgpu.kernel needs jax >= 0.11.2")
def test_mosaic_reduce_race_checks_every_variant(capsys):
    """The two-consumer race's reproducer runs its variants (one and two warpgroups reducing over
    axis 1 and over axis 0, and two and four over axis 0 with their scratch apart) and compares
    each with numpy; in interpret mode (as on a GPU where Mosaic GPU is right) every tile is
    exact, so it exits 0."""
    from benchmarks import mosaic_reduce_race

    if jax.default_backend() == "gpu":
        pytest.skip("compiled, the outcome is what the reproducer measures")
    with pytest.raises(SystemExit):  # argparse: --iters must be a positive int
        mosaic_reduce_race.main(["--iters", "0"])
    assert mosaic_reduce_race.main(["--iters", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("interpret mode")
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        f"{w} warpgroup(s), axis {axis}" + (", scratch apart" if apart else "")
        for w, axis, apart in mosaic_reduce_race.VARIANTS]
    assert all(": 0 of" in line for line in lines[1:])
    one = mosaic_reduce_race.check(2, 0, 1, interpret=True, seed=3)
    assert one == dict(warpgroups=2, axis=0, apart=False, tiles=2, wrong_tiles=0,
                       max_rel_err=one["max_rel_err"]) and one["max_rel_err"] < 1e-6


def test_bench_mosaic_times_rotated_copies_in_straight_line_calls():
    """`benchmarks.bench_mosaic` with several copies of a problem (those that fit in L2) times
    `bench.repeated`'s straight-line calls over them, as `benchmarks.bench`'s loop mode does,
    and reports the time per call."""
    shape = bench_mosaic.SMOKE_SHAPES[0]
    s = dataclasses.replace(bench.smoke_settings(bench.Settings(interpret=True)), loop_ops=4)
    inputs = bench_mosaic.make_decode_inputs(shape, 0, copies=2)
    ref = bench_mosaic._call("xla", inputs, None, True)(*inputs.args(0))
    row = bench_mosaic._run("pallas", inputs, None, True, ref, 2, 1e6, 1.0, s)
    assert row["correct"], row
    assert row["mode"] == "loop" and row["reps_per_call"] == 4
    assert row["us"] > 0 and row["of_copy"] > 0


@pytest.mark.skipif(mosaic_gpu.jax_version() < mosaic_gpu.MIN_JAX,
                    reason="plgpu.kernel needs jax >= 0.11.2")
def test_mosaic_stream_counts_every_tile_of_both_layouts(capsys, monkeypatch):
    """`benchmarks.mosaic_stream` streams decode's pages one TMA copy per (page, kv head) and one
    per page: each consumer's count of the tiles it waited for must equal the tiles its split
    walks (`expected_tiles`, checked here against a direct count), else the row is WRONG and the
    run exits 1."""
    from benchmarks import mosaic_stream

    if jax.default_backend() == "gpu":
        pytest.skip("compiled, the rows are timings")
    lens, block_size = np.array([0, 1, 16, 17, 100]), 16
    for variant in (mosaic_stream.Stream("head", 2, 3, 32), mosaic_stream.Stream("page", 2, 2)):
        block_k = variant.tile_tokens if variant.layout == "head" else block_size
        got = mosaic_stream.expected_tiles(lens, variant, block_size, heads=2)
        for b, n in enumerate(lens):
            tiles = list(range(-(-n // block_k)))
            share = -(-len(tiles) // variant.splits)
            for split in range(variant.splits):
                assert (got[b, :, split] == len(tiles[split * share:(split + 1) * share])).all()
    with pytest.raises(SystemExit) as exit_info:  # a usage error names the known shapes
        mosaic_stream.main(["--shapes", "b32_ctx4096,nope"])
    assert exit_info.value.code == 2 and "unknown ['nope']" in capsys.readouterr().err
    assert mosaic_stream.main(["--smoke"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[1] for row in rows] == ["head", "page", "page"]
    assert all("of copy" in row for row in rows)
    real = mosaic_stream.expected_tiles
    monkeypatch.setattr(mosaic_stream, "expected_tiles", lambda *a, **k: real(*a, **k) + 1)
    assert mosaic_stream.main(["--smoke"]) == 1
    assert "WRONG tile counts" in capsys.readouterr().out


def test_profile_kernel_reads_mosaic_config_labels():
    """``profile_kernel --impl mosaic --config st3/vp1`` takes `bench_mosaic`'s labels (the
    Triton kernel's parts are not `MosaicDecodeConfig` fields): a wrong part is a usage error."""
    from benchmarks import profile_kernel

    for argv in (["--impl", "mosaic", "--config", "pr1"], ["--config", "vp1"]):
        with pytest.raises(SystemExit) as exit_info:
            profile_kernel.main(["--shape", "small_b2_ctx64", *argv])
        assert exit_info.value.code == 2


def test_batch_waves_smoke_checks_and_times_each_config(tmp_path):
    from benchmarks import batch_waves

    path = tmp_path / "waves.json"
    assert batch_waves.main(["--smoke", "fp8:3=s2", "bfloat16:2:64", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["dtype"], r["batch"], r["picked"]) for r in rows] == [
        ("float8_e4m3fn", 3, True), ("float8_e4m3fn", 3, False), ("bfloat16", 2, True)]
    assert rows[1]["config"] == rows[0]["config"].replace("/s1/", "/s2/")
    assert rows[1]["programs"] == 2 * rows[0]["programs"] == 3 * 2 * 2  # batch, kv heads, splits
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-2 and r["median_us"] > 0 for r in rows)
    for bad in ("fp8:x", "int8:4", "fp8:4=zz2"):
        with pytest.raises(SystemExit) as e:
            batch_waves.main(["--smoke", bad])
        assert e.value.code == 2


@pytest.mark.skipif(mosaic_gpu.jax_version() < mosaic_gpu.MIN_JAX,
                    reason="plgpu.kernel needs jax >= 0.11.2")
def test_mosaic_interpret_limits_reports_every_case(capsys):
    """The reproducers of what Mosaic GPU's interpret mode does not run print one line per case:
    the exception it raised, or that it ran and whether its output is right (never WRONG)."""
    from benchmarks import mosaic_interpret_limits

    if jax.default_backend() == "gpu":
        pytest.skip("interpret mode belongs on the CPU (docs/RELIABILITY.md)")
    assert mosaic_interpret_limits.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"jax {jax.__version__}, interpret mode")
    assert [line.split(":")[0] for line in lines[1:]] == list(mosaic_interpret_limits.CASES)
    for line in lines[1:]:
        outcome = line.split(": ", 1)[1]
        assert outcome == "runs, output right" or outcome.split(":")[0].endswith("Error"), line


# ----------------------------------------------------------------------------------------------
# benchmarks.bars: the bars judged over several bench processes


def _bars_doc(fractions: dict, copy_tbps: float = 4.2) -> dict:
    """A bench JSON with one pallas row per shape (None: the row is WRONG); each row's kernel
    time is 100 us over its fraction."""
    shapes = []
    for name, frac in fractions.items():
        row = {"impl": "pallas", "status": "ok", "correct": frac is not None,
               "frac_copy_bw": 0.5 if frac is None else frac,
               "median_us": 200.0 if frac is None else 100.0 / frac}
        shapes.append({"name": name, "results": [{"impl": "xla", "status": "ok", "correct": True,
                                                  "frac_copy_bw": 0.1}, row]})
    start = {"torch_copy": {"tbps": copy_tbps - 0.1, "spread": 0.003},
             "not": {"tbps": copy_tbps, "spread": 0.02}}
    return {"copy_bandwidth": {"tbps": copy_tbps, "start": start}, "shapes": shapes}


def test_bars_judges_by_the_median_and_the_minimum_of_the_runs():
    from benchmarks import bars
    docs = [_bars_doc({"b1_ctx32768": 0.81, "b32_ctx4096": 0.96, "fp8_b8_ctx16384": None}),
            _bars_doc({"b1_ctx32768": 0.79, "b32_ctx4096": 0.98, "fp8_b8_ctx16384": 0.86}),
            _bars_doc({"b1_ctx32768": 0.82, "b32_ctx4096": 0.965}),
            {}]  # a run whose process wrote nothing
    rows = {r["shape"]: r for r in bars.judge(docs, ["b1_ctx32768", "b32_ctx4096",
                                                     "fp8_b8_ctx16384", "b256_ctx512",
                                                     "small_b2_ctx64"])}
    assert rows["b1_ctx32768"]["runs"] == [0.81, 0.79, 0.82, None]
    assert rows["b1_ctx32768"]["median"] == 0.81 and rows["b1_ctx32768"]["min"] == 0.79
    assert rows["b1_ctx32768"]["verdict"] == "met (median)"      # 0.80: one run under it
    assert rows["b32_ctx4096"]["verdict"] == "missed (median)"   # 0.97: median 0.965
    assert rows["b32_ctx4096"]["us"] == pytest.approx([100 / 0.96, 100 / 0.98, 100 / 0.965, None])
    assert rows["b32_ctx4096"]["median_us"] == pytest.approx(100 / 0.965)
    assert rows["fp8_b8_ctx16384"]["runs"] == [None, 0.86, None, None]  # a WRONG row never counts
    assert rows["fp8_b8_ctx16384"]["us"] == [None, pytest.approx(100 / 0.86), None, None]
    assert rows["b256_ctx512"]["median_us"] is None
    assert rows["fp8_b8_ctx16384"]["verdict"] == "met in every run"
    assert rows["b256_ctx512"]["verdict"] == "not measured"
    assert rows["small_b2_ctx64"]["verdict"] == "no bar"
    docs[2]["copy_bandwidth"]["start"]["imprecise"] = True  # no way's windows agreed
    assert bars.imprecise_runs(docs) == [False, False, True, False]
    table = bars.format_table(list(rows.values()), bars.copy_rates(docs), bars.copy_ways(docs),
                              bars.imprecise_runs(docs))
    assert ("| `b1_ctx32768` | 0.810 | 0.790 | 0.820 | - | 0.810 | 0.790-0.820 | 123.5 | 0.800 |"
            in table)
    assert "| `b256_ctx512` | - | - | - | - | - | - | - | 0.880 | not measured |" in table
    # the ceiling and each way with its windows' spread, per run (the JAX copy measured by none)
    assert "| copy TB/s | 4.200 | 4.200 | 4.200 (imprecise) | - |" in table
    assert "| copy TB/s, torch_copy (spread) | 4.100 (0.3%) | 4.100 (0.3%) | 4.100 (0.3%) | - |" \
        in table
    assert "| copy TB/s, not (spread) | 4.200 (2.0%) |" in table and "copy TB/s, copy" not in table


def test_bars_runs_bench_processes_in_alternating_order(tmp_path, monkeypatch):
    """Two real ``bench --smoke`` processes (the second in reverse shape order), then the verdict
    from their JSONs; ``--from`` judges the same directory again without running anything."""
    from benchmarks import bars
    monkeypatch.setitem(bars.BARS, "small_b2_ctx64", (0.0, "test"))
    monkeypatch.setitem(bars.BARS, "small_mha_b2_ctx64", (1e9, "test"))
    out = tmp_path / "bars"
    shapes = "small_b2_ctx64,small_mha_b2_ctx64"
    assert bars.main(["--runs", "2", "--out", str(out), "--shapes", shapes,
                      "--bench-args=--smoke"]) == 0
    docs = bars.load_runs(str(out))
    assert [d["meta"]["argv"][d["meta"]["argv"].index("--shapes") + 1] for d in docs] == [
        shapes, "small_mha_b2_ctx64,small_b2_ctx64"]
    with open(out / "bars.json") as f:
        summary = json.load(f)
    rows = {r["shape"]: r for r in summary["rows"]}
    assert rows["small_b2_ctx64"]["verdict"] == "met in every run"
    assert rows["small_mha_b2_ctx64"]["verdict"] == "missed (median)"
    assert all(f is not None and f > 0 for r in rows.values() for f in r["runs"])
    assert all(t is not None and t > 0 for r in rows.values() for t in r["us"])
    if bars.gpu_identity() is None:  # no nvidia-smi here: nothing recorded
        assert summary["gpu"] is None and not (out / "gpu.txt").exists()
    else:
        assert summary["gpu"] == (out / "gpu.txt").read_text().strip()
    (out / "bars.json").unlink()
    (out / "gpu.txt").write_text("NVIDIA H200, GPU-1234, 1650, 00000000:19:00.0, 580.1\n")
    assert bars.main(["--from", str(out), "--shapes", shapes]) == 0
    with open(out / "bars.json") as f:
        summary = json.load(f)
    assert summary["gpu"] == "NVIDIA H200, GPU-1234, 1650, 00000000:19:00.0, 580.1"
    assert summary["bars_device"] == "NVIDIA H200" and summary["on_bars_device"] is True


H100 = "NVIDIA H100 80GB HBM3, GPU-e22a, 1652, 00000000:00:06.0, 580.159.04"
H200 = "NVIDIA H200, GPU-1234, 1650, 00000000:19:00.0, 580.1"


def test_bars_say_whether_the_gpu_is_the_bars_device():
    """Only a GPU named exactly as the bars' device gives a verdict; every GPU of a multi-GPU
    identity must be one; no identity is neither."""
    from benchmarks import bars
    assert bars.on_bars_device(H200) is True
    assert bars.on_bars_device(H200 + "\n" + H200) is True
    assert bars.on_bars_device(H100) is False
    assert bars.on_bars_device(H200 + "\n" + H100) is False
    assert bars.on_bars_device("NVIDIA H200 NVL, GPU-9, 1, 0:1, 580") is False
    assert bars.on_bars_device(None) is None and bars.on_bars_device("") is None
    assert bars.device_line(H200).startswith("Verdict:")
    assert bars.device_line(H100) == ("Not a verdict: the bars are fractions peers reached on an "
                                      "NVIDIA H200; this run's GPU is NVIDIA H100 80GB HBM3.")
    assert bars.device_line(None).endswith("this run's GPU is unknown.")


def test_bars_from_another_gpu_are_not_a_verdict(tmp_path, capsys):
    """``--from`` a run recorded on an H100: the table comes under the line that says so, and
    ``bars.json`` records it."""
    from benchmarks import bars
    (tmp_path / "bench_1.json").write_text(json.dumps(_bars_doc({"b32_ctx4096": 0.99})))
    (tmp_path / "gpu.txt").write_text(H100 + "\n")
    assert bars.main(["--from", str(tmp_path), "--shapes", "b32_ctx4096"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"GPU: {H100}" and lines[1].startswith("Not a verdict:")
    with open(tmp_path / "bars.json") as f:
        assert json.load(f)["on_bars_device"] is False


@pytest.mark.parametrize("identity", [H100, None])
def test_bars_require_the_bars_device_before_running(identity, tmp_path, monkeypatch, capsys):
    """``--require-bars-device`` on another GPU, or with none: exit 3, no process run, no file."""
    from benchmarks import bars
    monkeypatch.setattr(bars, "gpu_identity", lambda: identity)
    monkeypatch.setattr(bars, "run", lambda *a, **k: pytest.fail("ran on the wrong device"))
    out = tmp_path / "bars"
    assert bars.main(["--out", str(out), "--require-bars-device"]) == bars.EXIT_NOT_BARS_DEVICE
    assert "Nothing was run (--require-bars-device)." in capsys.readouterr().out
    assert not out.exists()


def test_bars_require_the_bars_device_runs_on_it(tmp_path, monkeypatch, capsys):
    """``--require-bars-device`` on the bars' device: the runs go ahead and are a verdict."""
    from benchmarks import bars
    runs = []

    def fake_run(out, n, shapes, extra, timeout_s, identity):
        runs.append(shapes)
        os.makedirs(out)
        with open(os.path.join(out, "gpu.txt"), "w") as f:
            f.write(H200 + "\n")
        with open(os.path.join(out, "bench_1.json"), "w") as f:
            json.dump(_bars_doc({"b32_ctx4096": 0.98}), f)

    monkeypatch.setattr(bars, "gpu_identity", lambda: H200)
    monkeypatch.setattr(bars, "run", fake_run)
    out = tmp_path / "bars"
    assert bars.main(["--out", str(out), "--shapes", "b32_ctx4096",
                      "--require-bars-device"]) == 0
    assert runs == [["b32_ctx4096"]]
    printed = capsys.readouterr().out
    assert "Verdict: the bars were measured on an NVIDIA H200" in printed
    assert "| `b32_ctx4096` | 0.980 |" in printed and "met in every run" in printed


@pytest.mark.parametrize("argv", [["--runs", "0", "--out", "x"], ["--timeout", "0", "--out", "x"],
                                  ["--runs", "2"], ["--from", "x", "--require-bars-device"]])
def test_bars_usage_errors(argv, capsys):
    """No runs, no time per run, neither ``--out`` nor ``--from``, or a device requirement on
    runs already made: a usage error (exit 2)."""
    from benchmarks import bars
    with pytest.raises(SystemExit) as e:
        bars.main(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_call_overhead_fits_the_line_it_was_given():
    """`call_overhead.fit_line` recovers the fixed cost and the rate of exact points, and says NaN
    where one size cannot fix a line."""
    from benchmarks import call_overhead

    nbytes = [1e8, 2e8, 4e8]
    times = [3.0 + b / (4.0e12 * 1e-6) for b in nbytes]  # 3 us + bytes at 4 TB/s
    line = call_overhead.fit_line(nbytes, times)
    assert line["fixed_us"] == pytest.approx(3.0, abs=1e-6)
    assert line["rate_tbps"] == pytest.approx(4.0, rel=1e-9)
    assert line["max_residual_us"] < 1e-6
    assert math.isnan(call_overhead.fit_line([1e8, 1e8], [10.0, 11.0])["fixed_us"])


def test_call_overhead_smoke_times_one_config_at_every_length(tmp_path):
    """Every context length runs the named shape's config, checked against impl="xla"."""
    from benchmarks import call_overhead

    path = tmp_path / "overhead.json"
    code = call_overhead.main(["--smoke", "--contexts", "32,64", "--config", "bk16/s2",
                               "--json", str(path)])
    assert code == 0
    [shape] = json.loads(path.read_text())["shapes"]
    assert shape["config"]["block_k"] == 16 and shape["config"]["num_splits"] == 2
    assert [p["context"] for p in shape["points"]] == [32, 64]
    assert all(p["status"] == "ok" and p["rel_err"] < 1e-2 for p in shape["points"])
    assert shape["points"][1]["bytes"] > shape["points"][0]["bytes"]


def test_measure_removes_what_a_batch_pays_once():
    """`timing.measure`'s steady figure is the time of a call among others: a fixed cost paid once
    per batch (here a 40 ms wait at the batch's end, as a host's first dispatch or a final
    synchronization costs) cancels, where the batches' own time per call keeps its share."""
    import time

    from benchmarks.timing import TimerSettings, measure

    s = TimerSettings(windows=3, window_s=0.04, warmup_s=0.0, min_calls=4, max_calls=64)
    t = measure(lambda: time.sleep(0.002), 1, s, sync=lambda _: time.sleep(0.04))
    assert t.median_us == pytest.approx(2000, rel=0.4)  # 2 ms per call; sleeps overshoot a little
    # the longer batch of N + 40 ms over 2N calls: 40 ms / (2 * N) more per call
    assert t.batch_median_us > t.median_us + 0.6 * 40000 / (2 * t.calls_per_window)
    assert len(t.windows_us) == 3 and t.min_us <= t.median_us <= t.max_us


def test_program_timeline_phases_of_synthetic_stamps():
    """`program_timeline.call_phases` / `loop_phases`: each phase from known stamps, calls taken in
    the order they started (not as listed), the timer's 32-bit wrap-around undone."""
    from benchmarks import program_timeline as ptl

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
    assert (p["duration_min"], p["duration_max"], p["sms"]) == (pytest.approx(90.0),
                                                              pytest.approx(99.0), 2)
    assert phases[1]["span"] == pytest.approx(59.0) and phases[1]["gap"] is None
    assert ptl.median_phases(phases)["gap"] == pytest.approx(1.0)


@pytest.mark.parametrize("config", [None, "s2/mk1"])
def test_program_timeline_smoke_wraps_the_kernel_unchanged(tmp_path, config):
    """The timed wrapper of the grid kernel gives `decode`'s output (checked against impl="xla"),
    with one split (also timed one call per dispatch) or several merged in the kernel; a split
    merged by a second launch and persistent programs are refused with the config in the
    message."""
    from benchmarks import program_timeline as ptl

    path = tmp_path / "timeline.json"
    argv = ["--smoke", "--json", str(path)] + (["--config", config] if config else ["--dispatch"])
    assert ptl.main(argv) == 0
    [shape] = json.loads(path.read_text())["shapes"]
    assert shape["status"] == "ok" and shape["rel_err"] < 1e-2
    assert len(shape["calls"]) >= 1 and shape["median"]["host_us"] > 0
    if config is None:  # --dispatch: the same calls one per dispatch, beside the loop
        assert len(shape["dispatch"]["calls"]) == len(shape["calls"])
        assert shape["dispatch"]["median"]["host_us"] > 0
    else:
        assert "dispatch" not in shape
    inputs = make_decode_inputs(shape_by_name("small_b2_ctx64"), seed=0)
    args = (inputs.q[0], inputs.k_cache, inputs.v_cache, inputs.block_tables[0],
            inputs.context_lens)
    for refused in (DecodeConfig(num_splits=2), DecodeConfig(persistent_programs=4)):
        with pytest.raises(ValueError, match="config="):
            ptl.timed_decode(*args, config=refused, interpret=True)


def test_every_shape_runs_its_calls_inside_one_program():
    """Loop mode for every shape: one needing no rotation (one copy) runs ``loop_ops`` calls per
    dispatch too, not one (each dispatch would add the gap between two executables to a call)."""
    text = bench.plan([shape_by_name("b32_ctx4096"), shape_by_name("b1_ctx32768")], ("pallas",),
                      bench.Settings(), False, 132)
    rows = {line.split()[0]: line.split()[1:4] for line in text.splitlines()[1:3]}
    assert rows["b32_ctx4096"] == ["1", "loop", "16"]
    copies, mode, reps = rows["b1_ctx32768"]
    assert int(copies) > 1 and mode == "loop" and int(reps) >= 16 and int(reps) % int(copies) == 0
    assert bench.loop_reps(1, 16) == 16 and bench.loop_reps(3, 16) == 18
