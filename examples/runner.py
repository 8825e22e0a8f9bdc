"""A continuous-batching runner: requests join and leave the batch; every step is one jitted call.

Each step (`Runner.generate` loops over them):

1. admit waiting requests, in order, while fewer than ``max_num_seqs`` run, the step's prompts
   stay within ``max_prefill_tokens`` (one prompt is always admitted into a step with none), and
   the free blocks cover every admitted sequence's whole length (prompt + new tokens - 1 cached
   tokens), so that a running sequence never waits for a block;
2. build the ragged batch on the host: the admitted prompts (prefill), then the last token of
   every running sequence (decode); grow the block tables and compute the slot mapping; pad every
   dimension to a power of two so that few shapes are compiled;
3. run the step, one `jax.jit` with the caches donated (updated in place): the model over all the
   tokens, every layer's K/V write and attention, greedy sampling (argmax, first index on ties);
4. append the sampled tokens; a sequence with all its new tokens leaves the batch and its blocks go
   back to the free list.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from examples import llama
from examples.paged_cache import BlockAllocator, BlockTable, blocks_for, make_caches
from pallas_paged._platform import next_power_of_2


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt (token ids) and how many tokens to generate after it (>= 1)."""

    prompt: tuple[int, ...]
    max_new_tokens: int


@dataclasses.dataclass
class Output:
    """What a request produced: its tokens, the logits each was sampled from (when recorded), and
    the steps at which it joined and left the batch."""

    tokens: list[int]
    logits: list[np.ndarray] | None
    admitted_step: int
    finished_step: int


@dataclasses.dataclass
class RunStats:
    """One `Runner.generate` call: per step ``(prefill sequences, decode sequences)``, the padded
    shapes seen (one compilation each, the first time), tokens generated, wall time."""

    batches: list[tuple[int, int]]
    shapes: set[tuple[int, int, int]]
    generated_tokens: int
    wall_s: float
    most_blocks_in_use: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s


def _bucket(n: int) -> int:
    return 0 if n == 0 else next_power_of_2(n)


def _step(params, caches, batch, *, spec, impl, write_impl, interpret, return_logits):
    logits, caches = llama.forward_step(params, caches, batch, spec=spec, impl=impl,
                                        write_impl=write_impl, interpret=interpret)
    next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return next_tokens, (logits if return_logits else None), caches


@dataclasses.dataclass
class _Sequence:
    index: int
    request: Request
    table: BlockTable
    admitted_step: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def blocks_needed(self) -> int:
        return blocks_for(len(self.request.prompt) + self.request.max_new_tokens - 1,
                          self.table.block_size)


class Runner:
    """Serves requests through a paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens.

    Args:
      params, spec: the model (`examples.llama.params_from_hf`, `examples.llama.LlamaSpec`).
      num_blocks: physical blocks per layer cache.
      block_size: tokens per block.
      max_blocks_per_seq: width of the block tables (static): the longest sequence is
        ``max_blocks_per_seq * block_size`` tokens.
      impl: attention implementation, `pallas_paged.decode`'s ``impl``.
      write_impl: `pallas_paged.write_kv`'s ``impl`` (None: its default).
      interpret: Pallas interpret mode (None: exactly when there is no GPU).
      max_num_seqs: most sequences in the batch at once (None: no limit).
      max_prefill_tokens: most prompt tokens prefilled in one step, past the first prompt
        (None: no limit); bounds a step's size when many prompts arrive together.
      record_logits: keep the float32 logits of every sampled token (for comparisons).
    """

    def __init__(self, params, spec: llama.LlamaSpec, *, num_blocks: int, block_size: int,
                 max_blocks_per_seq: int, impl: str = "pallas", write_impl: str | None = None,
                 interpret: bool | None = None, max_num_seqs: int | None = None,
                 max_prefill_tokens: int | None = None, record_logits: bool = False):
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"{max_num_seqs=} must be >= 1 or None")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"{max_prefill_tokens=} must be >= 1 or None")
        self.params, self.spec = params, spec
        self.block_size, self.max_blocks_per_seq = block_size, max_blocks_per_seq
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.record_logits = record_logits
        self.allocator = BlockAllocator(num_blocks)
        dtype = params["embed"].dtype
        self.caches = make_caches(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                                  spec.head_dim, dtype)
        self._step = jax.jit(
            functools.partial(_step, spec=spec, impl=impl, write_impl=write_impl,
                              interpret=interpret, return_logits=record_logits),
            donate_argnums=(1,))

    def _check(self, request: Request) -> None:
        total = len(request.prompt) + request.max_new_tokens - 1
        if len(request.prompt) < 1 or request.max_new_tokens < 1:
            raise ValueError(f"{len(request.prompt)=} and {request.max_new_tokens=} must be >= 1")
        if total > self.max_blocks_per_seq * self.block_size:
            raise ValueError(f"a request of {total} cached tokens exceeds max_blocks_per_seq *"
                             f" block_size = {self.max_blocks_per_seq * self.block_size}")
        if blocks_for(total, self.block_size) > self.allocator.num_blocks:
            raise ValueError(f"a request of {total} cached tokens needs more than the cache's"
                             f" {self.allocator.num_blocks} blocks")
        if not all(0 <= t < self.spec.vocab_size for t in request.prompt):
            raise ValueError(f"prompt token ids must lie in [0, {self.spec.vocab_size})")

    def _build(self, prefill: list[_Sequence], decode: list[_Sequence]) -> llama.StepBatch:
        """The padded host arrays of one step; grows the block tables it needs."""
        mb = self.max_blocks_per_seq
        tokens, positions, slots = [], [], []
        prefill_tables, prefill_lens, starts = [], [], [0]
        for seq in prefill:
            n = len(seq.request.prompt)
            seq.table.ensure(n)
            tokens.extend(seq.request.prompt)
            positions.extend(range(n))
            slots.extend(seq.table.slots(0, n))
            prefill_tables.append(seq.table.row(mb))
            prefill_lens.append(n)
            starts.append(starts[-1] + n)
        num_prefill_tokens, num_prefill = len(tokens), len(prefill)
        pad_tokens, pad_prefill = _bucket(num_prefill_tokens), _bucket(num_prefill)
        pad = pad_tokens - num_prefill_tokens
        tokens += [0] * pad
        positions += [0] * pad
        slots += [-1] * pad
        decode_tables, decode_lens = [], []
        for seq in decode:
            position = len(seq.request.prompt) + len(seq.tokens) - 1
            seq.table.ensure(position + 1)
            tokens.append(seq.tokens[-1])
            positions.append(position)
            slots.extend(seq.table.slots(position, position + 1))
            decode_tables.append(seq.table.row(mb))
            decode_lens.append(position + 1)
        pad_decode = _bucket(len(decode))
        pad = pad_decode - len(decode)
        tokens += [0] * pad
        positions += [0] * pad
        slots += [-1] * pad

        def table(rows, count):
            out = np.zeros((count, mb), np.int32)
            if rows:
                out[:len(rows)] = np.stack(rows)
            return out

        def lens(values, count):
            out = np.zeros(count, np.int32)
            out[:len(values)] = values
            return out

        query_start_loc = np.full(pad_prefill + 1, num_prefill_tokens, np.int32)
        query_start_loc[:num_prefill + 1] = starts
        prefill_last = np.zeros(pad_prefill, np.int32)
        prefill_last[:num_prefill] = np.asarray(starts[1:], np.int32) - 1
        i32 = functools.partial(np.asarray, dtype=np.int32)
        return llama.StepBatch(
            tokens=i32(tokens), positions=i32(positions), slot_mapping=i32(slots),
            prefill_block_tables=table(prefill_tables, pad_prefill),
            prefill_context_lens=lens(prefill_lens, pad_prefill),
            query_start_loc=query_start_loc, prefill_last=prefill_last,
            decode_block_tables=table(decode_tables, pad_decode),
            decode_context_lens=lens(decode_lens, pad_decode))

    def generate(self, requests: list[Request]) -> tuple[list[Output], RunStats]:
        """Generate greedily for every request; return the outputs in request order and the stats.

        Raises:
          ValueError: a request that can never be served (empty prompt, no new tokens, token ids
            outside the vocabulary, longer than a block table or than the whole cache).
        """
        for request in requests:
            self._check(request)
        start = time.perf_counter()
        waiting = collections.deque(enumerate(requests))
        running: list[_Sequence] = []
        outputs: list[Output | None] = [None] * len(requests)
        stats = RunStats(batches=[], shapes=set(), generated_tokens=0, wall_s=0.0,
                         most_blocks_in_use=0)
        step = 0
        while waiting or running:
            reserved = sum(seq.blocks_needed - len(seq.table.blocks) for seq in running)
            admitted: list[_Sequence] = []
            prefill_tokens = 0
            while waiting and (self.max_num_seqs is None
                               or len(running) + len(admitted) < self.max_num_seqs):
                index, request = waiting[0]
                seq = _Sequence(index, request, BlockTable(self.allocator, self.block_size), step)
                if self.allocator.num_free - reserved < seq.blocks_needed:
                    break
                if (admitted and self.max_prefill_tokens is not None
                        and prefill_tokens + len(request.prompt) > self.max_prefill_tokens):
                    break
                waiting.popleft()
                reserved += seq.blocks_needed
                prefill_tokens += len(request.prompt)
                admitted.append(seq)
            # _check guarantees that an empty cache admits the head of the queue.
            assert admitted or running, "the scheduler admitted nothing into an empty batch"
            batch = self._build(admitted, running)
            stats.batches.append((len(admitted), len(running)))
            stats.shapes.add((batch.tokens.shape[0], batch.query_start_loc.shape[0] - 1,
                              batch.decode_context_lens.shape[0]))
            stats.most_blocks_in_use = max(stats.most_blocks_in_use,
                                           self.allocator.num_blocks - self.allocator.num_free)
            next_tokens, logits, self.caches = self._step(self.params, self.caches, batch)
            next_tokens = np.asarray(next_tokens)
            logits = None if logits is None else np.asarray(logits)
            pad_prefill = batch.prefill_last.shape[0]
            rows = list(range(len(admitted))) + [pad_prefill + j for j in range(len(running))]
            still_running = []
            for seq, row in zip(admitted + running, rows):
                seq.tokens.append(int(next_tokens[row]))
                if logits is not None:
                    seq.logits.append(logits[row])
                stats.generated_tokens += 1
                if len(seq.tokens) == seq.request.max_new_tokens:
                    seq.table.release()
                    outputs[seq.index] = Output(seq.tokens, seq.logits if self.record_logits
                                                else None, seq.admitted_step, step)
                else:
                    still_running.append(seq)
            running = still_running
            step += 1
        stats.wall_s = time.perf_counter() - start
        assert self.allocator.num_free == self.allocator.num_blocks, "blocks leaked"
        return outputs, stats
