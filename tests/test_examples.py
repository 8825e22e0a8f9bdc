"""The end-to-end example: a Hugging Face Llama and the JAX runner generate the same tokens.

The CLI's comparison (`examples.generate --compare-hf`) on tiny random models, for both attention
implementations, GQA and MHA, block sizes 1, 4 and 16, sequences that finish early while others
continue and later ones join; bfloat16 through its logits rule. Then the parts on their own: the
prefill attention against the float64 oracle, the block allocator, the runner's scheduling.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from paged_inputs import assert_close, assert_within_ulps, make_paged, reference

import pallas_paged
from examples import generate, llama
from examples.paged_cache import BlockAllocator, BlockTable
from examples.runner import Request

TINY = ["--layers", "2", "--hidden", "64", "--vocab", "128"]

# name -> CLI flags after --compare-hf and TINY
COMPARE_CASES = {
    "xla-gqa-bs4": ["--impl", "xla", "--heads", "4", "--kv-heads", "2", "--block-size", "4"],
    "pallas-mha-bs16": ["--impl", "pallas", "--write-impl", "pallas", "--heads", "4",
                        "--kv-heads", "4", "--block-size", "16", "--prompt-lens", "5,17,33",
                        "--new-tokens", "6"],
    # 3 new tokens for the first sequence: it leaves at step 2, the third prompt joins at step 3.
    "pallas-gqa4-bs1-early-finish": ["--impl", "pallas", "--heads", "4", "--kv-heads", "1",
                                     "--block-size", "1", "--prompt-lens", "5,17,9",
                                     "--new-tokens", "3,9,6", "--max-num-seqs", "2"],
    # At most 12 prompt tokens a step: the prompts join at steps 0, 1 and 2 (7 + 1).
    "xla-mha-bs1-early-finish-prefill-budget": ["--impl", "xla", "--heads", "2", "--kv-heads",
                                                "2", "--block-size", "1", "--prompt-lens",
                                                "3,11,7,1", "--new-tokens", "2,7,1,5",
                                                "--max-prefill-tokens", "12", "--seed", "3"],
    "xla-gqa-bs16-bf16": ["--impl", "xla", "--heads", "4", "--kv-heads", "2", "--block-size",
                          "16", "--dtype", "bfloat16"],
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name == "xla-gqa-bs16-bf16"
                                                else [pytest.mark.slow])
                                  for name in COMPARE_CASES])
def test_generate_compare_hf(name, capsys):
    """The runner and Hugging Face generate the same tokens (bf16: within its logits rule)."""
    rc = generate.main(["--compare-hf", *TINY, *COMPARE_CASES[name]])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.rstrip().endswith("PASS"), out
    if "bfloat16" not in COMPARE_CASES[name]:
        hf = [line.split(":", 1)[1] for line in out.splitlines() if line.startswith("  hf :")]
        jax_ = [line.split(":", 1)[1] for line in out.splitlines() if line.startswith("  jax:")]
        assert hf == jax_ and len(hf) == len(out.split("seq ")) - 1
    if "--max-prefill-tokens" in COMPARE_CASES[name]:
        assert "(prefill, decode): [(1, 0), (1, 1), (2, 1), " in out, out


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_compare_hf_fails_on_a_wrong_attention(dtype, monkeypatch, capsys):
    """The comparison can fail: prefill attention that misses each token's own key."""
    real = llama.attend_prefill

    def off_by_one(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale=None,
                   **kw):
        return real(q, k_cache, v_cache, block_tables, context_lens - 1, query_start_loc, scale,
                    **kw)

    monkeypatch.setattr(llama, "attend_prefill", off_by_one)
    rc = generate.main(["--compare-hf", *TINY, "--impl", "xla", "--dtype", dtype])
    out = capsys.readouterr().out
    assert rc == 1 and out.rstrip().endswith("FAIL"), out
    assert ("DIFFERENT" if dtype == "float32" else "OUTSIDE") in out, out


@pytest.mark.slow
def test_runner_batch_changes_and_blocks_are_reused():
    """Sequences leave early, waiting ones take their blocks, tokens still equal HF's."""
    args = generate.parse_args(["--compare-hf", *TINY, "--heads", "4", "--kv-heads", "2",
                                "--block-size", "4", "--prompt-lens", "9,14,6,20",
                                "--new-tokens", "2,8,3,4", "--num-blocks", "10", "--seed", "5"])
    model = generate.build_hf_model(args)
    hf_tokens, _ = generate.hf_generate(model, args.prompts, args.new_tokens)
    runner = generate.make_runner(args, model, "float32", "xla", record_logits=False)
    first_caches = runner.caches
    outputs, stats = runner.generate(generate.make_requests(args))
    assert [o.tokens for o in outputs] == hf_tokens
    # The step donates the caches: the buffers it was given are gone (updated in place).
    assert all(k.is_deleted() and v.is_deleted() for k, v in first_caches)
    # 10 blocks of 4 tokens: the first two sequences (3 + 6 blocks, reserved whole) fit; the
    # third (2 blocks) waits for the first to finish and reuses its blocks; the fourth (6 blocks)
    # waits for the second.
    assert stats.batches[:3] == [(2, 0), (0, 2), (1, 1)]
    assert [o.admitted_step for o in outputs] == [0, 0, 2, 8]
    assert [o.finished_step for o in outputs] == [1, 7, 4, 11]
    assert stats.most_blocks_in_use <= 10
    assert runner.allocator.num_free == 10


def test_runner_rejects_requests_it_cannot_serve():
    """The runner refuses a prompt past its table, zero new tokens and token ids outside the
    vocabulary."""
    args = generate.parse_args(["--compare-hf", *TINY, "--prompt-lens", "5", "--new-tokens", "4"])
    model = generate.build_hf_model(args)
    runner = generate.make_runner(args, model, "float32", "xla", record_logits=False)
    with pytest.raises(ValueError, match="exceeds max_blocks_per_seq"):
        runner.generate([Request(tuple(range(9)), 1)])
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        runner.generate([Request((1, 2), 0)])
    with pytest.raises(ValueError, match=r"prompt token ids must lie in \[0, 128\)"):
        runner.generate([Request((1, 128), 1)])


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_attend_prefill_matches_oracle(impl, rng):
    """Ragged causal attention: each new token sees its sequence's cache up to itself."""
    # A 3-token chunk after 4 cached tokens, a 1-token prompt, an empty (padding) sequence, a
    # whole 13-token prompt, one token after 3 cached ones.
    lens = np.array([7, 1, 0, 13, 4], np.int32)      # cached tokens after the write
    num_new = np.array([3, 1, 0, 13, 1], np.int32)
    paged = make_paged(rng, lens=lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=4)
    starts = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    num_tokens = int(starts[-1]) + 2                 # two padding tokens past the last sequence
    q = rng.standard_normal((num_tokens, 4, 32)).astype(np.float32)
    out = llama.attend_prefill(jnp.asarray(q), jnp.asarray(paged.k_cache),
                               jnp.asarray(paged.v_cache), jnp.asarray(paged.block_tables),
                               jnp.asarray(lens), jnp.asarray(starts), impl=impl)
    assert_close(reference(q, paged.k_cache, paged.v_cache, paged.block_tables, lens,
                           query_start_loc=starts), out)
    # Tokens past query_start_loc[-1] belong to no sequence: zeros.
    np.testing.assert_array_equal(np.asarray(out)[starts[-1]:], 0.0)


def ragged_attention_via_decode(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                scale=None, *, impl="pallas", interpret=None):
    """Causal attention of a ragged batch of new tokens, as one `pallas_paged.decode` call.

    Sequence ``b`` owns ``q[query_start_loc[b]:query_start_loc[b + 1]]``, its newest tokens, whose
    K/V are already in the cache; ``context_lens[b]`` counts them. New token ``j`` of ``b`` sits at
    position ``p = context_lens[b] - num_new_b + j`` and attends to positions ``0..p``: it becomes
    one decode row with ``b``'s block table and length ``p + 1``. Tokens past
    ``query_start_loc[-1]`` get length 0 (zeros).

    Args:
      q: ``[num_tokens, num_heads, head_dim]``.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
      block_tables: ``i32[num_seqs, max_blocks]``. context_lens: ``i32[num_seqs]``.
      query_start_loc: ``i32[num_seqs + 1]``, non-decreasing, from 0.
      scale, impl, interpret: as in `pallas_paged.decode`.

    Returns:
      ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    num_tokens, num_seqs = q.shape[0], block_tables.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start_loc, token, side="right") - 1, 0, num_seqs - 1)
    start = query_start_loc[seq]
    num_new = query_start_loc[seq + 1] - start
    position = context_lens[seq] - num_new + (token - start)
    token_lens = jnp.where(token < query_start_loc[num_seqs], position + 1, 0).astype(jnp.int32)
    return pallas_paged.decode(q, k_cache, v_cache, block_tables[seq], token_lens, scale,
                               impl=impl, interpret=interpret)



@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_ragged_via_decode_matches_paged_attention(impl, rng):
    """Prefill attention equals one decode row per new token (the decode kernel, length p + 1)."""
    lens = np.array([9, 4, 17], np.int32)
    num_new = np.array([9, 1, 5], np.int32)
    paged = make_paged(rng, lens=lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    starts = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(starts[-1]), 8, 64)).astype(np.float32))
    args = (q, jnp.asarray(paged.k_cache), jnp.asarray(paged.v_cache),
            jnp.asarray(paged.block_tables), jnp.asarray(lens), jnp.asarray(starts))
    want = ragged_attention_via_decode(*args, impl=impl)
    got = pallas_paged.paged_attention(*args, impl=impl)
    # fp32 sums of two kernels, in other orders: within parity's fp32 ulp bound at the output's
    # largest magnitude.
    assert_within_ulps(got, want, "float32", ulps=64, magnitude=float(np.abs(want).max()))


def test_block_allocator_free_list():
    """The allocator hands out never-used blocks first, then freed ones, and refuses over-allocation
    and double frees."""
    allocator = BlockAllocator(4)
    first = allocator.allocate(3)
    assert first == [0, 1, 2] and allocator.num_free == 1
    with pytest.raises(ValueError, match="count=2 blocks requested but only 1 of 4 are free"):
        allocator.allocate(2)
    allocator.free([1])
    assert allocator.allocate(2) == [3, 1]           # never-used first, then the freed one
    with pytest.raises(ValueError, match="block 1 is not allocated"):
        allocator.free([1, 1])
    with pytest.raises(ValueError, match="num_blocks=0 must be >= 1"):
        BlockAllocator(0)


def test_block_table_slots():
    """A sequence's block table gives the slots of its positions and a padded table row."""
    allocator = BlockAllocator(8)
    allocator.allocate(2)                            # blocks 0 and 1 belong to someone else
    table = BlockTable(allocator, block_size=4)
    table.ensure(5)
    assert table.blocks == [2, 3]
    np.testing.assert_array_equal(table.slots(2, 6), [10, 11, 12, 13])
    np.testing.assert_array_equal(table.row(4), [2, 3, 0, 0])
    with pytest.raises(ValueError, match="exceed max_blocks=1"):
        table.row(1)
    table.release()
    assert table.blocks == [] and allocator.num_free == 6


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_generate_compare_hf_gpu(impl, capsys):
    """A larger model (8 layers, hidden 1024, GQA 4) on the GPU, float32: tokens equal HF's
    (torch on the CPU)."""
    rc = generate.main(["--compare-hf", "--layers", "8", "--hidden", "1024", "--heads", "16",
                        "--kv-heads", "4", "--vocab", "1024", "--block-size", "16",
                        "--prompt-lens", "5,17,33,64,100,129,1,250", "--new-tokens",
                        "16,3,24,9,1,12,20,6", "--max-num-seqs", "6", "--impl", impl])
    out = capsys.readouterr().out
    assert rc == 0, out


@pytest.mark.slow
def test_generate_bench_runs(capsys):
    """``--bench`` on a tiny model: the runner's rows and transformers' row in the table."""
    rc = generate.main(["--bench", "--layers", "1", "--hidden", "64", "--heads", "4",
                        "--kv-heads", "2", "--vocab", "128", "--block-size", "4", "--prompt-lens",
                        "5,9,3", "--new-tokens", "4,2,3", "--dtype", "float32", "--impls", "xla"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    assert [row.split(" | ")[0] for row in rows] == [
        "| jax runner, impl=xla", "| transformers.generate (static batch, sdpa)"], out


@pytest.mark.gpu
def test_generate_bench_gpu(capsys):
    """``--bench`` runs both impls and transformers.generate and prints the table."""
    rc = generate.main(["--bench", "--num-seqs", "16", "--new-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("impl=pallas", "impl=xla", "transformers.generate"):
        assert name in out, out


def test_tokens_may_part_only_at_a_near_tie():
    """The comparison forgives a parted token only where HF's top two logits are within the
    margin."""
    logits = [np.array([0.0, 5.0, 1.0]), np.array([3.0, 3.0 - 1e-6, 0.0])]
    hf, jax_tokens = [1, 0], [1, 1]  # parted at step 1, where HF's margin is 1e-6
    assert generate.parts_at_near_tie(logits, hf, jax_tokens, 1, diff=1e-6)
    assert not generate.parts_at_near_tie(logits, hf, jax_tokens, 1, diff=1e-7)
    wrong = [np.array([0.0, 5.0, 1.0]), np.array([3.0, 0.5, 0.0])]  # a clear argmax
    assert not generate.parts_at_near_tie(wrong, hf, jax_tokens, 1, diff=1e-3)
    assert not generate.parts_at_near_tie(logits, [1], [1, 0], 1, diff=1.0)  # a prefix
