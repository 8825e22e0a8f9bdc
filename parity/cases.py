"""Parity cases: named, frozen shapes and options, and the numpy inputs each draws from its seed.

A `Case` is one model-runner step: a write of new tokens into a paged cache, then attention over
that cache: decode (one query per sequence) or, for a case with ``new_tokens``, ragged paged
attention (each sequence's new tokens, causally: prefill chunks, speculative decoding and decode in
one call). `make_inputs(case)` builds every array of the step from
``np.random.default_rng(case.seed)`` alone, so a case name plus a seed reproduces a failure
anywhere. The inputs are adversarial in the ways SPEC.md names:

- physical blocks are a random permutation of ``[0, num_blocks)``, with ``spare_blocks`` unused
  blocks mixed in among them; a block table lists a sequence's blocks in logical order (unsorted);
- table entries past ``ceil(n / block_size)`` hold garbage: huge ids (``2**30``, ``2**31 - 1``,
  ``99999``), ids just past the end (``num_blocks``), negative ids (``-1``, ``-7``) and stale ids of
  real blocks (the most dangerous kind: reading one gives plausible numbers);
- every cache slot that is not a valid token of the batch holds NaN (the fp8 NaN code for fp8
  caches), including the slot each sequence's newest token is about to be written to;
- the write step stores each non-empty sequence's newest token (position ``n - 1``; a ragged case:
  its newest ``q_len_b`` tokens, 0 allowed) and a few padding tokens (``slot_mapping == -1``, values ``PAD_SENTINEL``) at random positions among them;
- lengths include 0 (a padded batch row), 1, ``bs - 1``, ``bs``, ``bs + 1`` and the table's capacity
  (the ``"edges"`` policy), shuffled over the batch.

Arrays are numpy: bf16 and fp8 as ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn``, indices
int32. ``q`` is bf16 when the cache is fp8. Scalars (scale, soft-cap, window, fp8 scales,
``return_lse``) stay on the `Case`; `decode_options` turns them into keyword arguments.

`DEFAULT_SUITE` runs in a minute or two on a CPU with the Pallas kernel in interpret mode;
`FULL_SUITE` is its GPU-sized counterpart (contexts in the thousands, batch up to 64).
"""

from __future__ import annotations

import dataclasses
import zlib

import ml_dtypes
import numpy as np

from parity.layout import GARBAGE_BLOCK_IDS, paged_layout

__all__ = [
    "Case",
    "DEFAULT_SUITE",
    "FULL_SUITE",
    "DTYPES",
    "GARBAGE_BLOCK_IDS",
    "PAD_SENTINEL",
    "NP_DTYPES",
    "apply_write",
    "decode_options",
    "decode_view",
    "draw_new_tokens",
    "valid_slot_mask",
    "draw_lengths",
    "make_inputs",
    "suite",
]

DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}
# Short dtype names, in case names and option labels.
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}
LENGTH_POLICIES = ("edges", "uniform")
FP8_MAX = 448.0
# Values of the padding tokens (slot -1): a write that lets one through leaves an obvious mark.
PAD_SENTINEL = 1000.0
# Table-tail garbage besides stale ids of real blocks; `num_blocks` itself is added per case.
# Fraction of a new fp8 token's elements blown up past 448 * scale, to exercise the clamp.
FP8_OUTLIER_FRACTION = 0.02


@dataclasses.dataclass(frozen=True)
class Case:
    """One write-then-decode step: shapes, cache dtype, how lengths are drawn, and the options.

    Attributes:
      name: unique, readable; `python -m parity -k` filters on it.
      batch, num_heads, num_kv_heads, head_dim, block_size: the shapes of SPEC.md.
      spare_blocks: physical blocks that belong to no sequence (NaN-filled), mixed among the rest.
      dtype: the cache dtype, one of `DTYPES`; q and the new tokens share it, except that an fp8
        cache takes q and new tokens in ``query_dtype``.
      query_dtype: the dtype of q and of the new tokens for an fp8 cache: None (bf16), or
        ``"float16"`` / ``"float32"``; refused for other caches.
      lengths: ``"edges"`` (0, the capacity, 1, bs+1, bs, bs-1, as many as the batch holds in that
        order, then uniform draws in ``[1, capacity]``; shuffled over the batch), ``"uniform"``
        (each in ``[1, capacity]``), or an explicit tuple of ``batch`` ints.
      max_blocks: the block tables' width; None means ``ceil(160 / block_size)``.
      seed: the only source of randomness.
      scale: softmax scale; None means ``1 / sqrt(head_dim)``.
      logits_soft_cap, sliding_window: as in SPEC.md.
      alibi, sinks: draw ``alibi_slopes`` / ``sinks`` (``f32[num_heads]``) for the case.
      k_scale, v_scale: fp8 dequantization scales; required for fp8 caches, refused otherwise.
      array_scales: pass ``k_scale`` / ``v_scale`` as one-element fp32 arrays (torch tensors,
        JAX arrays) rather than python floats.
      return_lse: also compare the log-sum-exp.
      padding_tokens: slot ``-1`` tokens mixed into the write.
      block_k, num_splits: a `pallas_paged.DecodeConfig` (ragged: `AttentionConfig`) for the
        Pallas kernel (None: its default).
      new_tokens: None for decode; else a ragged case: ``"mixed"`` (per sequence, in turn: 1, 0,
        2-8, 13, the whole prompt, a chunk of 64-512, 31, 5; never more than its length) or an
        explicit tuple of ``batch`` counts, each at most the sequence's length.
      query_padding: rows of ``q`` past ``query_start_loc[batch]`` (ragged cases), whose output
        must be zeros.
    """

    name: str
    batch: int = 6
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    spare_blocks: int = 5
    dtype: str = "bfloat16"
    query_dtype: str | None = None
    lengths: str | tuple[int, ...] = "edges"
    max_blocks: int | None = None
    seed: int = 0
    scale: float | None = None
    logits_soft_cap: float | None = None
    alibi: bool = False
    sliding_window: int | None = None
    sinks: bool = False
    k_scale: float | None = None
    v_scale: float | None = None
    array_scales: bool = False
    return_lse: bool = False
    padding_tokens: int = 3
    block_k: int | None = None
    num_splits: int | None = None
    new_tokens: str | tuple[int, ...] | None = None
    query_padding: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"Case {self.name!r}: dtype={self.dtype!r} must be one of {DTYPES}")
        for field in ("batch", "num_heads", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"Case {self.name!r}: {field}={getattr(self, field)} must be >= 1")
        if self.spare_blocks < 0 or self.padding_tokens < 0:
            raise ValueError(f"Case {self.name!r}: spare_blocks and padding_tokens must be >= 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Case {self.name!r}: num_heads={self.num_heads} is not a multiple of"
                f" num_kv_heads={self.num_kv_heads}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError(f"Case {self.name!r}: max_blocks={self.max_blocks} must be >= 1")
        if isinstance(self.lengths, str):
            if self.lengths not in LENGTH_POLICIES:
                raise ValueError(
                    f"Case {self.name!r}: lengths={self.lengths!r} must be one of {LENGTH_POLICIES}"
                    " or a tuple of ints")
        else:
            if len(self.lengths) != self.batch:
                raise ValueError(
                    f"Case {self.name!r}: {len(self.lengths)} explicit lengths for"
                    f" batch={self.batch}")
            if any(not 0 <= n <= self.capacity for n in self.lengths):
                raise ValueError(
                    f"Case {self.name!r}: lengths={self.lengths} must lie in [0, capacity ="
                    f" {self.capacity}]")
        if isinstance(self.new_tokens, str) and self.new_tokens != "mixed":
            raise ValueError(f"Case {self.name!r}: new_tokens={self.new_tokens!r} must be None,"
                             " 'mixed' or a tuple of ints")
        if isinstance(self.new_tokens, tuple) and len(self.new_tokens) != self.batch:
            raise ValueError(f"Case {self.name!r}: {len(self.new_tokens)} new_tokens for"
                             f" batch={self.batch}")
        if self.query_padding and self.new_tokens is None:
            raise ValueError(f"Case {self.name!r}: query_padding needs a ragged case (new_tokens)")
        fp8 = self.dtype == "float8_e4m3fn"
        if self.query_dtype is not None and (
                not fp8 or self.query_dtype not in ("bfloat16", "float16", "float32")):
            raise ValueError(
                f"Case {self.name!r}: query_dtype={self.query_dtype!r} is for float8_e4m3fn"
                f" caches only, one of bfloat16, float16, float32 (got dtype={self.dtype})")
        has_scales = self.k_scale is not None and self.v_scale is not None
        if fp8 != has_scales or (not fp8 and (self.k_scale, self.v_scale) != (None, None)):
            raise ValueError(
                f"Case {self.name!r}: k_scale and v_scale go together with (and only with) a"
                f" float8_e4m3fn cache, got dtype={self.dtype}, k_scale={self.k_scale},"
                f" v_scale={self.v_scale}")

    @property
    def ragged(self) -> bool:
        """Ragged paged attention (``paged_attention``) rather than decode."""
        return self.new_tokens is not None

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def table_width(self) -> int:
        """``max_blocks``, resolved."""
        return self.max_blocks if self.max_blocks is not None else -(-160 // self.block_size)

    @property
    def capacity(self) -> int:
        """The longest context a table row can hold: ``max_blocks * block_size``."""
        return self.table_width * self.block_size

    @property
    def q_dtype(self) -> str:
        """The dtype of q, of the new tokens and of the output (``query_dtype``, by default bf16,
        for an fp8 cache)."""
        if self.dtype == "float8_e4m3fn":
            return self.query_dtype or "bfloat16"
        return self.dtype

    @property
    def options(self) -> tuple[str, ...]:
        """The extension options this case turns on, for tables and filters."""
        names = []
        if self.logits_soft_cap is not None:
            names.append("softcap")
        if self.alibi:
            names.append("alibi")
        if self.sliding_window is not None:
            names.append("window")
        if self.sinks:
            names.append("sinks")
        if self.dtype == "float8_e4m3fn":
            names.append("fp8")
        if self.query_dtype is not None:
            names.append(f"{SHORT_DTYPES[self.query_dtype]}q")
        if self.return_lse:
            names.append("lse")
        if self.ragged:
            names.append("ragged")
        return tuple(names)


def decode_options(case: Case) -> dict:
    """The python-scalar keyword arguments of the decode call (arrays come from `make_inputs`)."""
    return dict(scale=case.scale, logits_soft_cap=case.logits_soft_cap,
                sliding_window=case.sliding_window, k_scale=case.k_scale, v_scale=case.v_scale,
                return_lse=case.return_lse)


def draw_lengths(case: Case, rng: np.random.Generator) -> np.ndarray:
    """``i32[batch]`` context lengths (after the write: the newest token included)."""
    capacity, bs = case.capacity, case.block_size
    if not isinstance(case.lengths, str):
        return np.asarray(case.lengths, dtype=np.int32)
    if case.lengths == "uniform":
        return rng.integers(1, capacity + 1, size=case.batch).astype(np.int32)
    edges = []  # in priority order, for batches too small to hold them all
    for n in (0, capacity, 1, bs + 1, bs, bs - 1):
        if 0 <= n <= capacity and n not in edges:
            edges.append(n)
    if case.batch <= len(edges):
        lens = np.asarray(edges[:case.batch])
    else:
        extra = rng.integers(1, capacity + 1, size=case.batch - len(edges))
        lens = np.concatenate([np.asarray(edges), extra])
    return rng.permutation(lens).astype(np.int32)


# The "mixed" policy's query lengths, in turn (None: the whole prompt; a range: one draw in it).
MIXED_NEW_TOKENS = (1, 0, (2, 8), 13, None, (64, 512), 31, 5)


def draw_new_tokens(case: Case, lens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``i32[batch]`` query lengths of a ragged case: each sequence's newest ``q_len_b`` tokens
    (at most its length ``n``) are written, then attend."""
    if isinstance(case.new_tokens, tuple):
        q_lens = np.asarray(case.new_tokens, dtype=np.int64)
        if (q_lens < 0).any() or (q_lens > lens).any():
            raise ValueError(f"Case {case.name!r}: new_tokens={case.new_tokens} must lie in"
                             f" [0, context length] = [0, {lens.tolist()}]")
        return q_lens.astype(np.int32)
    q_lens = []
    for b, n in enumerate(lens.tolist()):
        pick = MIXED_NEW_TOKENS[b % len(MIXED_NEW_TOKENS)]
        if pick is None:
            pick = n
        elif isinstance(pick, tuple):
            pick = int(rng.integers(pick[0], pick[1] + 1))
        q_lens.append(min(pick, n))
    return np.asarray(q_lens, dtype=np.int32)


def _to_dtype(x: np.ndarray, dtype: str, scale: float | None = None) -> np.ndarray:
    """fp32 -> the storage dtype, rounding to nearest even; fp8 stores ``clamp(x / scale)``."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float8_e4m3fn":
        x = np.clip(x / np.float32(scale), -FP8_MAX, FP8_MAX)  # NaN stays NaN
    return x.astype(NP_DTYPES[dtype])


def _alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's geometric slopes ``2**(-8 i / H)``, ``i = 1..H``."""
    return np.exp2(-8.0 * np.arange(1, num_heads + 1) / num_heads).astype(np.float32)


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Every array of the case's write-then-decode step, from ``np.random.default_rng(case.seed)``.

    Returns:
      A dict of numpy arrays:

      - ``q``: ``[batch, num_heads, head_dim]`` in ``case.q_dtype``; a ragged case:
        ``[sum(q_lens) + query_padding, num_heads, head_dim]``, each sequence's new tokens packed
        in batch order, and ``query_start_loc`` ``i32[batch + 1]``.
      - ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in
        ``case.dtype``, *before* the write: positions ``0..n-2`` of every sequence hold data, every
        other slot NaN.
      - ``k``, ``v``: ``[num_tokens, num_kv_heads, head_dim]``, the new tokens (``case.q_dtype``).
      - ``slot_mapping``: ``i32[num_tokens]``; the newest position of each non-empty sequence, in
        batch order, with ``case.padding_tokens`` ``-1`` entries at random places.
      - ``block_tables``: ``i32[batch, max_blocks]``; ``context_lens``: ``i32[batch]``.
      - ``alibi_slopes``, ``sinks``: ``f32[num_heads]``, only when the case asks for them.
    """
    rng = np.random.default_rng(case.seed)
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_dim
    lens = draw_lengths(case, rng)
    q_lens = draw_new_tokens(case, lens, rng) if case.ragged else np.minimum(lens, 1)
    layout = paged_layout(rng, lens, block_size=bs, table_width=case.table_width,
                          spare_blocks=case.spare_blocks, tail="random")
    num_blocks, tables = layout.num_blocks, layout.block_tables
    seq, pos, slot = layout.seq, layout.pos, layout.slots
    newest = pos >= (lens[seq] - q_lens[seq])
    new_slots = slot[newest]  # batch order, each sequence's newest q_len_b positions

    caches = {}
    for name, cache_scale in (("k_cache", case.k_scale), ("v_cache", case.v_scale)):
        flat = np.full((num_blocks * bs, kvh, d), np.nan, dtype=np.float32)
        old = slot[~newest]
        # fp8 caches hold values written with the scale: ~N(0, 1) data stored as x / scale.
        flat[old] = rng.standard_normal((len(old), kvh, d), dtype=np.float32)
        caches[name] = _to_dtype(flat, case.dtype, cache_scale).reshape(num_blocks, bs, kvh, d)

    num_real = len(new_slots)
    num_tokens = num_real + case.padding_tokens
    is_pad = np.zeros(num_tokens, dtype=bool)
    is_pad[rng.choice(num_tokens, size=case.padding_tokens, replace=False)] = True
    slot_mapping = np.full(num_tokens, -1, dtype=np.int32)
    slot_mapping[~is_pad] = new_slots
    new = {}
    for name in ("k", "v"):
        x = rng.standard_normal((num_tokens, kvh, d), dtype=np.float32)
        if case.dtype == "float8_e4m3fn":
            blow_up = rng.random(x.shape) < FP8_OUTLIER_FRACTION
            x = np.where(blow_up, x * 1000.0, x)  # past 448 * scale: clamped by the write
        x[is_pad] = PAD_SENTINEL
        new[name] = x.astype(NP_DTYPES[case.q_dtype])

    num_queries = int(q_lens.sum()) + case.query_padding if case.ragged else case.batch
    inputs = {
        "q": rng.standard_normal((num_queries, case.num_heads, d), dtype=np.float32)
        .astype(NP_DTYPES[case.q_dtype]),
        "k_cache": caches["k_cache"],
        "v_cache": caches["v_cache"],
        "k": new["k"],
        "v": new["v"],
        "slot_mapping": slot_mapping,
        "block_tables": tables,
        "context_lens": lens,
    }
    if case.ragged:
        inputs["query_start_loc"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    if case.alibi:
        inputs["alibi_slopes"] = _alibi_slopes(case.num_heads)
    if case.sinks:
        inputs["sinks"] = (2.0 * rng.standard_normal(case.num_heads)).astype(np.float32)
    return inputs


def apply_write(case: Case, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The caches after the write, computed in numpy: the bit-exact expectation of every impl.

    Slot ``-1`` writes nothing; fp8 caches store ``clamp(x / scale, -448, 448)`` with the division
    in fp32, rounded to nearest even (ml_dtypes' cast).
    """
    num_blocks, bs, kvh, d = inputs["k_cache"].shape
    slots = inputs["slot_mapping"].astype(np.int64)
    keep = slots >= 0
    out = []
    for cache, new, scale in ((inputs["k_cache"], inputs["k"], case.k_scale),
                              (inputs["v_cache"], inputs["v"], case.v_scale)):
        flat = cache.reshape(num_blocks * bs, kvh, d).copy()
        rows = new[keep]
        if case.dtype == "float8_e4m3fn":
            rows = _to_dtype(rows.astype(np.float32), case.dtype, scale)
        flat[slots[keep]] = rows
        out.append(flat.reshape(cache.shape))
    return out[0], out[1]


def decode_view(case: Case, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The case's attention as one decode row per query: what the judge and the references read.

    A decode case is returned as it is. For a ragged case, query row ``t`` of sequence ``b`` (at
    position ``p``) becomes a decode row with ``b``'s block table and length ``p + 1``: SPEC.md's
    ragged query sees exactly the positions ``j <= p`` (and ``j > p - W``) that such a decode row
    sees, with ALiBi's ``j - (n - 1) = j - p``. Padding rows get length 0.
    """
    if not case.ragged:
        return inputs
    starts = inputs["query_start_loc"].astype(np.int64)
    lens = inputs["context_lens"].astype(np.int64)
    rows = np.arange(inputs["q"].shape[0])
    seq = np.clip(np.searchsorted(starts, rows, side="right") - 1, 0, case.batch - 1)
    q_len = starts[seq + 1] - starts[seq]
    row_lens = np.where(rows < starts[-1], lens[seq] - q_len + (rows - starts[seq]) + 1, 0)
    return {**inputs, "block_tables": inputs["block_tables"][seq],
            "context_lens": row_lens.astype(np.int32)}


def valid_slot_mask(case: Case, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """``bool[num_blocks, block_size]``: True where a slot holds a valid token after the write."""
    num_blocks, bs = inputs["k_cache"].shape[:2]
    mask = np.zeros(num_blocks * bs, dtype=bool)
    for b, n in enumerate(inputs["context_lens"].tolist()):
        pos = np.arange(n)
        mask[inputs["block_tables"][b, pos // bs].astype(np.int64) * bs + pos % bs] = True
    return mask.reshape(num_blocks, bs)


# --------------------------------------------------------------------------------------------
# Suites.

def _gqa(h: int, kvh: int) -> str:
    if kvh == 1:
        return "mqa"
    return "mha" if h == kvh else f"gqa{h // kvh}"


def _named(h: int, kvh: int, d: int, bs: int, dtype: str, suffix: str = "", **kw) -> Case:
    """A case named after its shape; its seed, unless given, is derived from the name."""
    name = f"{_gqa(h, kvh)}_h{h}_d{d}_bs{bs}_{SHORT_DTYPES[dtype]}{suffix}"
    kw.setdefault("seed", zlib.crc32(name.encode()) % 2**16)
    return Case(name=name, num_heads=h, num_kv_heads=kvh, head_dim=d, block_size=bs, dtype=dtype,
                **kw)


FP8_SCALES = dict(k_scale=0.02, v_scale=0.03)
ALL_OPTIONS = dict(logits_soft_cap=2.5, alibi=True, sliding_window=37, sinks=True, return_lse=True)

DEFAULT_SUITE: tuple[Case, ...] = (
    # Shapes: GQA ratios 1, 2, 3, 8 and MQA; head_dim 64 / 80 / 96 / 128; block sizes 1, 3, 5, 12,
    # 16; all three float dtypes.
    _named(4, 4, 64, 16, "float32"),
    _named(4, 2, 64, 16, "bfloat16"),
    _named(8, 2, 128, 16, "bfloat16"),
    _named(6, 2, 80, 5, "float16"),
    _named(16, 2, 96, 12, "bfloat16"),
    _named(8, 1, 64, 3, "float16", max_blocks=40),
    _named(4, 1, 128, 1, "float32", max_blocks=90),
    _named(4, 2, 96, 1, "bfloat16", max_blocks=70, batch=5),
    _named(6, 2, 80, 12, "float32", batch=4),
    _named(16, 2, 64, 16, "float16", batch=5),
    _named(4, 4, 128, 5, "bfloat16", "_uniform", lengths="uniform", max_blocks=40, seed=1),
    _named(8, 2, 64, 16, "float32", "_explicit", batch=5, lengths=(1, 2, 31, 33, 160)),
    _named(4, 2, 64, 16, "bfloat16", "_empty", batch=3, lengths=(0, 0, 0)),
    # Each extension alone.
    _named(8, 2, 64, 16, "bfloat16", "_softcap", logits_soft_cap=2.0, scale=0.3),
    _named(8, 2, 64, 12, "float16", "_alibi", alibi=True),
    _named(8, 2, 64, 16, "bfloat16", "_window20", sliding_window=20),
    _named(6, 2, 80, 12, "float32", "_window5", sliding_window=5),
    _named(8, 2, 64, 16, "bfloat16", "_sinks", sinks=True),
    _named(8, 2, 128, 16, "float8_e4m3fn", **FP8_SCALES),
    _named(8, 2, 64, 5, "float8_e4m3fn", "_arrayscales", array_scales=True, **FP8_SCALES),
    _named(8, 2, 64, 16, "float8_e4m3fn", "_fp32q", query_dtype="float32", return_lse=True,
           **FP8_SCALES),
    _named(8, 2, 128, 12, "float8_e4m3fn", "_fp16q_all", query_dtype="float16", **FP8_SCALES,
           **ALL_OPTIONS),
    _named(8, 2, 64, 16, "bfloat16", "_lse", return_lse=True),
    _named(4, 4, 64, 5, "float32", "_lse", return_lse=True),
    # All together, and through the split-K merge.
    _named(8, 2, 64, 5, "bfloat16", "_all", **ALL_OPTIONS),
    _named(6, 2, 80, 16, "float16", "_all", **ALL_OPTIONS),
    _named(8, 1, 96, 3, "float32", "_all", max_blocks=50, **ALL_OPTIONS),
    _named(8, 2, 128, 12, "float8_e4m3fn", "_all", **FP8_SCALES, **ALL_OPTIONS),
    _named(8, 2, 64, 16, "bfloat16", "_split3", block_k=16, num_splits=3, return_lse=True),
    _named(8, 2, 64, 5, "float32", "_all_split4", block_k=16, num_splits=4, **ALL_OPTIONS),
    # Ragged paged attention: decode, empty, spec-decode, prime, whole-prompt and chunk queries in
    # one batch, padding rows past query_start_loc[batch], every option, fp8, the split merge.
    _named(8, 2, 64, 16, "bfloat16", "_ragged", batch=8, lengths="uniform", max_blocks=12,
           new_tokens="mixed", query_padding=3),
    _named(4, 4, 64, 5, "float32", "_ragged_all", batch=8, lengths="uniform", max_blocks=30,
           new_tokens="mixed", query_padding=2, **ALL_OPTIONS),
    _named(6, 2, 80, 12, "float16", "_ragged_spec", batch=5, new_tokens=(0, 1, 4, 6, 7),
           lengths=(0, 11, 12, 25, 40), max_blocks=4),
    _named(8, 2, 64, 16, "float8_e4m3fn", "_ragged_all", batch=6, lengths="uniform",
           max_blocks=8, new_tokens="mixed", query_padding=1, **FP8_SCALES, **ALL_OPTIONS),
    _named(8, 1, 64, 3, "bfloat16", "_ragged_split3", batch=4, lengths=(70, 33, 1, 90),
           new_tokens=(70, 5, 1, 17), max_blocks=30, block_k=16, num_splits=3, return_lse=True),
)

# GPU-sized: contexts in the thousands, batch up to 64, head_dim up to 256, block sizes up to 64,
# several seeds. Far too slow for the CPU interpret mode.
_FULL_SHAPES = (
    # (num_heads, num_kv_heads, head_dim, block_size, batch, max context)
    (32, 32, 128, 16, 16, 2048),
    (32, 8, 128, 16, 64, 4096),
    (32, 4, 128, 32, 32, 2048),
    (28, 4, 128, 64, 16, 8192),
    (24, 8, 80, 16, 32, 3000),
    (12, 4, 96, 12, 32, 2048),
    (16, 2, 256, 32, 16, 4096),
    (64, 8, 128, 64, 8, 16384),
    (8, 1, 128, 16, 64, 1024),
    (8, 8, 64, 1, 8, 1023),
    (40, 8, 128, 5, 16, 1500),
)
_FULL_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


def _full_suite() -> tuple[Case, ...]:
    cases = []
    fp8 = dict(dtype="float8_e4m3fn", **FP8_SCALES)
    for i, (h, kvh, d, bs, batch, ctx) in enumerate(_FULL_SHAPES):
        big = dict(batch=batch, max_blocks=-(-ctx // bs), spare_blocks=37)
        for dtype in _FULL_DTYPES:
            extra = FP8_SCALES if dtype == "float8_e4m3fn" else {}
            cases.append(_named(h, kvh, d, bs, dtype, f"_b{batch}_ctx{ctx}", **big, **extra))
        for seed in (1, 2):
            cases.append(_named(h, kvh, d, bs, "bfloat16", f"_b{batch}_ctx{ctx}_seed{seed}",
                                seed=seed, lengths="uniform", **big))
        if i % 3:
            continue  # the options on every third shape
        for suffix, opts in (("_softcap", dict(logits_soft_cap=30.0, scale=1.0)),
                             ("_alibi", dict(alibi=True)),
                             ("_window", dict(sliding_window=1000)),
                             ("_window_small", dict(sliding_window=bs + 3)),
                             ("_sinks", dict(sinks=True)),
                             ("_lse", dict(return_lse=True)),
                             ("_all", dict(logits_soft_cap=30.0, alibi=True, sliding_window=700,
                                           sinks=True, return_lse=True)),
                             ("_fp8_all", dict(logits_soft_cap=30.0, alibi=True,
                                               sliding_window=700, sinks=True, return_lse=True,
                                               **fp8)),
                             ("_fp8_fp16q", dict(query_dtype="float16", **fp8)),
                             ("_fp8_fp32q", dict(query_dtype="float32", return_lse=True, **fp8))):
            dtype = opts.pop("dtype", "bfloat16")
            cases.append(_named(h, kvh, d, bs, dtype, f"_b{batch}_ctx{ctx}{suffix}", **big, **opts))
    # Ragged: prefill chunks of 64-512 over longer cached contexts, whole prompts, speculative
    # decoding (2-8 tokens), decode and empty rows in one batch, with padding rows; every option.
    for h, kvh, d, bs, batch, ctx in ((32, 8, 128, 16, 16, 4096), (16, 2, 256, 32, 8, 2048),
                                      (12, 4, 96, 12, 16, 3000), (8, 8, 64, 1, 8, 1023)):
        big = dict(batch=batch, max_blocks=-(-ctx // bs), spare_blocks=37, lengths="uniform",
                   new_tokens="mixed", query_padding=5)
        for dtype in ("bfloat16", "float16", "float32"):
            cases.append(_named(h, kvh, d, bs, dtype, f"_b{batch}_ctx{ctx}_ragged", **big))
        cases.append(_named(h, kvh, d, bs, "bfloat16", f"_b{batch}_ctx{ctx}_ragged_all", **big,
                            logits_soft_cap=30.0, alibi=True, sliding_window=700, sinks=True,
                            return_lse=True))
        cases.append(_named(h, kvh, d, bs, "float8_e4m3fn", f"_b{batch}_ctx{ctx}_ragged_fp8",
                            **big, **FP8_SCALES, return_lse=True))
    cases.append(_named(32, 8, 128, 16, "bfloat16", "_b1_ctx16384_ragged_chunk", batch=1,
                        lengths=(16384,), new_tokens=(512,), max_blocks=1024, spare_blocks=37,
                        return_lse=True))
    cases.append(_named(32, 8, 128, 16, "bfloat16", "_b32_ctx4096_ragged_spec4", batch=32,
                        lengths="uniform", new_tokens=(4,) * 32, max_blocks=256,
                        spare_blocks=37))
    return tuple(cases)


FULL_SUITE: tuple[Case, ...] = _full_suite()

SUITES = {"default": DEFAULT_SUITE, "full": FULL_SUITE}


def suite(name: str = "default") -> tuple[Case, ...]:
    """A suite by name: ``"default"`` or ``"full"``."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}: one of {sorted(SUITES)}")
    return SUITES[name]


def _check_unique(cases) -> None:
    seen = set()
    for case in cases:
        if case.name in seen:
            raise AssertionError(f"duplicate case name {case.name!r}")
        seen.add(case.name)


_check_unique(DEFAULT_SUITE)
_check_unique(FULL_SUITE)
