"""Planted bugs: `python -m parity` must exit non-zero for each one, and zero without them.

Each mutant wraps the public `pallas_paged.write_kv`, `pallas_paged.decode` or
`pallas_paged.paged_attention` (the module
attribute `parity.compare` calls) with one classic mistake, planted in the arguments it passes on
or in the result it hands back, and runs the CLI in-process (`parity.__main__.main`) with the XLA
implementation only, on the few default-suite cases that exercise the bug (``-k``). The test then
asserts the exit code, that the failures name exactly the outputs the bug touches, and that they
come from the judge, not from an implementation raising. A mutant that no case catches means the
judge can be fooled.

Each run is a couple of seconds on a CPU (torch_ref plus XLA, small shapes); the file stays well
under a minute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_paged
from parity import __main__ as cli

REAL = {"write_kv": pallas_paged.write_kv, "decode": pallas_paged.decode,
        "paged_attention": pallas_paged.paged_attention}


def _argv(cases: tuple[str, ...]) -> list[str]:
    argv = ["--device", "cpu", "--impl", "xla", "-q"]
    for name in cases:
        argv += ["-k", name]
    return argv


# ------------------------------------------------------------------------------------------------
# The planted bugs. Each factory takes the real public function and returns the broken one.

def dropped_newest_token(decode):
    def broken(q, k_cache, v_cache, block_tables, context_lens, **kw):
        return decode(q, k_cache, v_cache, block_tables, jnp.maximum(context_lens - 1, 0), **kw)
    return broken


def scale_off_by_2_percent(decode):
    def broken(q, k_cache, v_cache, block_tables, context_lens, *, scale=None, **kw):
        scale = (1.0 / np.sqrt(q.shape[-1]) if scale is None else scale) * 1.02
        return decode(q, k_cache, v_cache, block_tables, context_lens, scale=float(scale), **kw)
    return broken


def gqa_by_repeat(decode):
    def broken(q, k_cache, v_cache, block_tables, context_lens, **kw):
        # kv heads tiled (`repeat`), so query head h reads kv head h % KVH, not h // group.
        group = q.shape[1] // k_cache.shape[2]
        k_cache, v_cache = (jnp.tile(c, (1, 1, group, 1)) for c in (k_cache, v_cache))
        return decode(q, k_cache, v_cache, block_tables, context_lens, **kw)
    return broken


def window_off_by_one(decode):
    def broken(*args, sliding_window=None, **kw):
        window = None if sliding_window is None else sliding_window + 1
        return decode(*args, sliding_window=window, **kw)
    return broken


def soft_cap_ignored(decode):
    def broken(*args, logits_soft_cap=None, **kw):
        return decode(*args, logits_soft_cap=None, **kw)
    return broken


def sinks_ignored(decode):
    def broken(*args, sinks=None, **kw):
        return decode(*args, sinks=None, **kw)
    return broken


def alibi_sign_flipped(decode):
    def broken(*args, alibi_slopes=None, **kw):
        return decode(*args, alibi_slopes=None if alibi_slopes is None else -alibi_slopes, **kw)
    return broken


def k_and_v_swapped(decode):
    def broken(q, k_cache, v_cache, *args, **kw):
        return decode(q, v_cache, k_cache, *args, **kw)
    return broken


def shifted_lse(decode):
    def broken(*args, return_lse=False, **kw):
        res = decode(*args, return_lse=return_lse, **kw)
        if not return_lse:
            return res
        out, lse = res
        return out, lse + 2.0**-10  # e.g. a final max subtracted in a rounded copy
    return broken


def one_nan_in_the_output(decode):
    def broken(q, k_cache, v_cache, block_tables, context_lens, **kw):
        res = decode(q, k_cache, v_cache, block_tables, context_lens, **kw)
        out, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, None)
        row = int(jnp.argmax(context_lens))  # a row with tokens: NaN is never right there
        out = out.at[row, 0, 0].set(jnp.nan)
        return (out, *rest) if rest is not None else out
    return broken


def empty_rows_nan(decode):
    def broken(q, k_cache, v_cache, block_tables, context_lens, **kw):
        # 0 / 0 in the softmax of a zero-length row, left unmasked.
        out = decode(q, k_cache, v_cache, block_tables, context_lens, **kw)
        return jnp.where((context_lens == 0)[:, None, None], jnp.nan, out)
    return broken


def one_ulp_bias_of_bf16_outputs(decode):
    def broken(q, k_cache, v_cache, block_tables, context_lens, **kw):
        out = decode(q, k_cache, v_cache, block_tables, context_lens, **kw)
        if out.dtype != jnp.bfloat16:
            return out
        # Every element of a non-empty row one bf16 ulp toward +inf (a wrong final rounding).
        bits = jnp.asarray(out).view(jnp.uint16).astype(jnp.int32)
        sign = jnp.sign(out.astype(jnp.float32)).astype(jnp.int32)
        up = jnp.where(sign == 0, 1, bits + sign)  # +0 -> the smallest positive subnormal
        up = up.astype(jnp.uint16).view(jnp.bfloat16)
        return jnp.where((context_lens > 0)[:, None, None], up, out)
    return broken


def output_in_float32(decode):
    def broken(*args, **kw):
        return decode(*args, **kw).astype(jnp.float32)  # the cast to q.dtype forgotten
    return broken


def minus_one_slot_wraps(write_kv):
    def broken(k_cache, v_cache, k, v, slot_mapping, **kw):
        # A raw -1 index is the last slot: the last padding token lands there.
        new_k, new_v = write_kv(k_cache, v_cache, k, v, slot_mapping, **kw)
        pad = np.flatnonzero(np.asarray(slot_mapping) == -1)
        if not pad.size:
            return new_k, new_v
        last = int(pad[-1])
        shape = new_k.shape
        flat = (-1, *shape[2:])
        return (new_k.reshape(flat).at[-1].set(k[last].astype(new_k.dtype)).reshape(shape),
                new_v.reshape(flat).at[-1].set(v[last].astype(new_v.dtype)).reshape(shape))
    return broken


def dropped_write(write_kv):
    def broken(k_cache, v_cache, k, v, slot_mapping, **kw):
        real = np.flatnonzero(np.asarray(slot_mapping) >= 0)
        return write_kv(k_cache, v_cache, k, v, slot_mapping.at[int(real[0])].set(-1), **kw)
    return broken


def v_written_from_k(write_kv):
    def broken(k_cache, v_cache, k, v, slot_mapping, **kw):
        return write_kv(k_cache, v_cache, k, k, slot_mapping, **kw)
    return broken


def fp8_scale_multiplied(write_kv):
    def broken(k_cache, v_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None, **kw):
        if k_scale is None:
            return write_kv(k_cache, v_cache, k, v, slot_mapping, **kw)
        # Stores x * scale instead of x / scale (dividing by 1 / scale).
        return write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale=1.0 / k_scale,
                        v_scale=1.0 / v_scale, **kw)
    return broken


def _rows(q_rows: int, query_start_loc):
    """Per query row: its sequence and its index among the sequence's new tokens (numpy)."""
    starts = np.asarray(query_start_loc)
    seq = np.clip(np.searchsorted(starts, np.arange(q_rows), side="right") - 1, 0,
                  len(starts) - 2)
    return seq, np.arange(q_rows) - starts[seq]


def no_causal_mask(paged_attention):
    def broken(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *args, **kw):
        # Every new token attends to its sequence's whole context: one decode row per token with
        # the full length (the classic prefill bug: the causal mask forgotten).
        seq, _ = _rows(q.shape[0], query_start_loc)
        lens = jnp.where(jnp.arange(q.shape[0]) < query_start_loc[-1],
                         jnp.asarray(context_lens)[seq], 0)
        return pallas_paged.decode(q, k_cache, v_cache, jnp.asarray(block_tables)[seq], lens,
                                   *args, **kw)
    return broken


def query_sees_the_next_position(paged_attention):
    def broken(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *args, **kw):
        # The causal mask off by one (j <= p + 1): each new token but a sequence's last sees one
        # position past its own.
        seq, i = _rows(q.shape[0], query_start_loc)
        starts, lens = np.asarray(query_start_loc), np.asarray(context_lens)
        q_len = starts[seq + 1] - starts[seq]
        p = lens[seq] - q_len + i
        n = np.where(np.arange(q.shape[0]) < starts[-1], np.minimum(p + 2, lens[seq]), 0)
        return pallas_paged.decode(q, k_cache, v_cache, jnp.asarray(block_tables)[seq],
                                   jnp.asarray(n, jnp.int32), *args, **kw)
    return broken


def padding_rows_not_zeroed(paged_attention):
    def broken(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *args, **kw):
        res = paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                              *args, **kw)
        out, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, None)
        pad = (jnp.arange(q.shape[0]) >= query_start_loc[-1])[:, None, None]
        out = jnp.where(pad, q.astype(out.dtype), out)  # the padding rows' garbage left in place
        return (out, *rest) if rest is not None else out
    return broken


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One planted bug: which public function it breaks, the cases run, what must fail."""

    plant: Callable
    target: str  # "write_kv", "decode" or "paged_attention"
    cases: tuple[str, ...]
    fails: tuple[str, ...]  # labels that must fail, e.g. "out[xla]"
    because: str = ""  # a phrase the failure lines must contain (which rule caught it)
    alone: bool = False  # `because` is the only rule that catches it

    @property
    def name(self) -> str:
        return self.plant.__name__


OUT, LSE = "out[xla]", "lse[xla]"
WRITE = ("k_cache[xla]", "v_cache[xla]", OUT)
MUTANTS = (
    Mutant(dropped_newest_token, "decode", ("mha_h4_d64_bs16_fp32",), (OUT,)),
    Mutant(scale_off_by_2_percent, "decode", ("mha_h4_d64_bs16_fp32",), (OUT,)),
    Mutant(gqa_by_repeat, "decode", ("gqa4_h8_d128_bs16_bf16",), (OUT,)),
    Mutant(window_off_by_one, "decode", ("gqa3_h6_d80_bs12_fp32_window5",), (OUT,)),
    Mutant(soft_cap_ignored, "decode", ("gqa4_h8_d64_bs16_bf16_softcap",), (OUT,)),
    Mutant(sinks_ignored, "decode", ("gqa4_h8_d64_bs16_bf16_sinks",), (OUT,)),
    Mutant(alibi_sign_flipped, "decode", ("gqa4_h8_d64_bs12_fp16_alibi",), (OUT,)),
    Mutant(k_and_v_swapped, "decode", ("gqa2_h4_d64_bs16_bf16",), (OUT,)),
    Mutant(shifted_lse, "decode", ("gqa4_h8_d64_bs16_bf16_lse",), (LSE,)),
    Mutant(one_nan_in_the_output, "decode", ("gqa4_h8_d128_bs16_bf16",), (OUT,),
           "non-finite elements in non-empty rows"),
    Mutant(empty_rows_nan, "decode", ("gqa2_h4_d64_bs16_bf16_empty",), (OUT,),
           "zero-length rows"),
    # Inside FlashAttention's bound and the ulp bound against torch_ref: only the bias rule sees it.
    Mutant(one_ulp_bias_of_bf16_outputs, "decode", ("gqa4_h8_d128_bs16_bf16",), (OUT,),
           "systematic bias", alone=True),
    Mutant(output_in_float32, "decode", ("gqa2_h4_d64_bs16_bf16",), (OUT,), "got float32"),
    Mutant(minus_one_slot_wraps, "write_kv", ("mha_h4_d64_bs16_fp32",), WRITE,
           "the last slot of the cache"),
    Mutant(dropped_write, "write_kv", ("mha_h4_d64_bs16_fp32",), WRITE, "a slot written this step"),
    Mutant(v_written_from_k, "write_kv", ("gqa2_h4_d64_bs16_bf16",), ("v_cache[xla]", OUT)),
    Mutant(fp8_scale_multiplied, "write_kv", ("gqa4_h8_d128_bs16_fp8",), WRITE),
    Mutant(no_causal_mask, "paged_attention", ("gqa4_h8_d64_bs16_bf16_ragged",), (OUT,)),
    Mutant(query_sees_the_next_position, "paged_attention", ("mha_h4_d64_bs5_fp32_ragged_all",),
           (OUT, LSE)),
    Mutant(padding_rows_not_zeroed, "paged_attention", ("gqa4_h8_d64_bs16_bf16_ragged",), (OUT,),
           "zero-length rows"),
)


def test_the_mutants_are_distinct_and_enough():
    assert len({m.name for m in MUTANTS}) == len(MUTANTS) >= 12
    assert {m.target for m in MUTANTS} == {"write_kv", "decode", "paged_attention"}


def test_the_unmutated_implementations_pass_every_selected_case(capsys):
    """The other half of each mutant's claim: without the bug, its cases pass."""
    cases = tuple(sorted({c for m in MUTANTS for c in m.cases}))
    code = cli.main(_argv(cases))
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert f"PASSED: {len(cases)}/{len(cases)} cases passed" in stdout


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_parity_catches_the_planted_bug(mutant, monkeypatch, capsys):
    monkeypatch.setattr(pallas_paged, mutant.target, mutant.plant(REAL[mutant.target]))
    code = cli.main(_argv(mutant.cases))
    stdout = capsys.readouterr().out
    assert code == cli.EXIT_MISMATCH, stdout
    failures = [line for line in stdout.splitlines() if line.startswith("FAIL ")]
    failed = {line.split()[2].rstrip(":") for line in failures}
    assert failed == set(mutant.fails), stdout  # torch_ref and the untouched outputs still pass
    assert not any("raised" in line for line in failures), stdout  # the judge caught it
    if mutant.because:
        assert any(mutant.because in line for line in failures), stdout
    if mutant.alone:
        rules = ("over the tolerance", "non-finite", "zero-length", "ulps", "systematic bias")
        for line in failures:
            assert [r for r in rules if r in line] == [mutant.because], line


def test_the_bias_mutant_moves_every_element_one_ulp_up():
    """The planted bias is what it says: the next bf16 value toward +inf, element by element."""
    values = np.array([1.0, -1.0, 0.0, 3.0e-3, -250.0], dtype=ml_dtypes.bfloat16)
    x = jnp.asarray(values.reshape(1, 1, -1))
    broken = one_ulp_bias_of_bf16_outputs(lambda *args, **kw: x)
    got = np.asarray(broken(None, None, None, None, jnp.array([5]))).reshape(-1)
    np.testing.assert_array_equal(got.astype(np.float64)[:3], [1 + 2**-7, -1 + 2**-8, 2.0**-133])
    step = got.view(np.uint16).astype(np.int64) - values.view(np.uint16).astype(np.int64)
    np.testing.assert_array_equal(step, [1, -1, 1, 1, -1])  # one code up in magnitude order
    assert (got.astype(np.float64) > values.astype(np.float64)).all()
