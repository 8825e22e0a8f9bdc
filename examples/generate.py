"""Generate with a Llama through the paged cache and check it against Hugging Face, token for token.

    python -m examples.generate --compare-hf [--layers L --hidden N --heads H --kv-heads K
        --vocab V --block-size BS --prompt-lens 5,17,33 --new-tokens 8,3,12 --dtype float32
        --seed S --impl pallas|xla]
    python -m examples.generate --bench [--impls pallas,xla] [...]

``--compare-hf`` builds a ``transformers.LlamaForCausalLM`` with random weights from those
numbers (seeded, nothing downloaded), generates greedily with ``model.generate(do_sample=False)``
one sequence at a time, generates with the JAX runner (all sequences batched, joining and leaving
as they start and finish), prints both token lists per sequence and the runner's tokens/s.

- float32: exit 0 only if every sequence's tokens are equal, and the logits they were sampled
  from agree within ``1e-4 * max|hf|`` (so that a wrong attention cannot hide behind lucky
  argmaxes). Tokens may part only at a near-tie (`parts_at_near_tie`): where HF's logits for its
  token and for the runner's are closer than twice the largest logits difference measured up to
  there, float32 rounding (a GPU's approximate division and exponentials, another summation
  order) decides the argmax, not the attention.
- bfloat16: rounding differs between the frameworks, so greedy paths may part. The logits of the
  first ``--logit-steps`` steps (while both token lists still agree, so both saw the same prefix)
  are compared with float32 truth (the float32 model on that prefix), FlashAttention's rule:
  ``max|jax - truth| <= 2 * max|hf_bf16 - truth| + 0.01 * max|truth|``. Exit 0 if that holds for
  every sequence; the number of agreeing tokens is printed.

``--bench`` (meant for a GPU) times the runner for each ``--impls`` entry (after a warm-up run of
the same requests, so compilation is excluded) and ``transformers.generate`` on the same GPU
(batched, left-padded), and prints a table of tokens/s.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

# torch and JAX share the GPU in --bench: keep JAX from taking 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from pallas_paged.cache_write.api import WRITE_IMPLS  # noqa: E402
from pallas_paged.decode_attention.api import DECODE_IMPLS  # noqa: E402

BF16_REL_ATOL = 0.01   # of max|truth|, the additive term of the bfloat16 logits rule
FP32_LOGITS_RTOL = 1e-4  # of max|hf|, float32 logits over the steps both token lists agree on

COMPARE_DEFAULTS = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, block_size=4,
                        prompt_lens="5,17,33", new_tokens="8", dtype="float32")
BENCH_DEFAULTS = dict(layers=8, hidden=1024, heads=16, kv_heads=4, vocab=32000, block_size=16,
                      new_tokens="128", dtype="bfloat16", num_seqs=64, max_prefill_tokens=4096)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m examples.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compare-hf", action="store_true",
                      help="generate with HF and the JAX runner; compare")
    mode.add_argument("--bench", action="store_true",
                      help="tokens/s of the runner per impl and of transformers.generate")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int, help="MLP width (default 8/3 hidden, /16)")
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--num-blocks", type=int,
                        help="blocks per layer cache (default: room for every sequence at once)")
    parser.add_argument("--prompt-lens", help="comma-separated prompt lengths")
    parser.add_argument("--num-seqs", type=int,
                        help="without --prompt-lens: this many prompts of random lengths 32..512")
    parser.add_argument("--new-tokens",
                        help="tokens to generate: one number for all, or one per prompt")
    parser.add_argument("--max-num-seqs", type=int, help="most sequences in the batch at once")
    parser.add_argument("--max-prefill-tokens", type=int,
                        help="most prompt tokens prefilled in one step (past the first prompt)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float,
                        help="std of the random weights (default 0.8 / sqrt(hidden): large enough"
                             " that attention moves the greedy tokens)")
    parser.add_argument("--impl", choices=DECODE_IMPLS, default="pallas",
                        help="attention implementation (pallas_paged.decode's impl)")
    parser.add_argument("--impls", default="pallas,xla", help="--bench: the impls to time")
    parser.add_argument("--write-impl", choices=WRITE_IMPLS,
                        help="pallas_paged.write_kv's impl (default: its own choice)")
    parser.add_argument("--logit-steps", type=int, default=4,
                        help="bfloat16: how many first steps' logits to compare")
    args = parser.parse_args(argv)
    defaults = BENCH_DEFAULTS if args.bench else COMPARE_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.init_std is None:
        args.init_std = 0.8 / args.hidden ** 0.5
    if args.intermediate is None:
        args.intermediate = -(-8 * args.hidden // 3 // 16) * 16
    rng = np.random.default_rng(args.seed)
    if args.prompt_lens is not None:
        args.prompt_lens = int_list(args.prompt_lens)
    elif args.num_seqs:
        args.prompt_lens = rng.integers(32, 513, size=args.num_seqs).tolist()
    else:
        parser.error("--prompt-lens or --num-seqs is required")
    new = int_list(args.new_tokens)
    if len(new) == 1:
        new = new * len(args.prompt_lens)
    if len(new) != len(args.prompt_lens):
        parser.error(f"--new-tokens has {len(new)} values for {len(args.prompt_lens)} prompts")
    args.new_tokens = new
    args.prompts = [rng.integers(0, args.vocab, size=n).tolist() for n in args.prompt_lens]
    return args


def build_hf_model(args, attn_implementation="eager"):
    """A ``LlamaForCausalLM`` with seeded random weights of std ``--init-std`` (float32, eval mode,
    no eos token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    longest = max(n + t for n, t in zip(args.prompt_lens, args.new_tokens))
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(longest, 128),
        initializer_range=args.init_std, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False, attn_implementation=attn_implementation)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Norm weights init to ones; draw them around 1 so that a dropped weight shows.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model


def hf_generate(model, prompts, new_tokens):
    """Greedy tokens and per-step float32 logits from ``model.generate``, one sequence at a time."""
    import torch

    tokens, logits = [], []
    with torch.no_grad():
        for prompt, count in zip(prompts, new_tokens):
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                                 min_new_tokens=count, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, output_logits=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append([step[0].float().cpu().numpy() for step in out.logits])
    return tokens, logits


def hf_teacher_forced_logits(model, prompt, generated, steps):
    """``f32[steps, vocab]``: the logits after ``prompt + generated[:s]`` for ``s < steps``."""
    import torch

    ids = torch.tensor([list(prompt) + list(generated[:steps - 1])], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0].float().cpu().numpy()
    return logits[len(prompt) - 1:len(prompt) - 1 + steps]


def make_runner(args, model, dtype_name, impl, record_logits):
    """A `Runner` over ``model``'s weights in ``dtype_name``, its cache sized for ``args``' requests
    (``--num-blocks``, else room for all of them at once)."""
    import jax.numpy as jnp

    from examples import llama
    from examples.paged_cache import blocks_for
    from examples.runner import Runner

    spec = llama.LlamaSpec.from_hf_config(model.config)
    params = llama.params_from_hf(model.state_dict(), spec, jnp.dtype(dtype_name))
    lengths = [n + t - 1 for n, t in zip(args.prompt_lens, args.new_tokens)]
    max_blocks = blocks_for(max(lengths), args.block_size)
    num_blocks = args.num_blocks or sum(blocks_for(n, args.block_size) for n in lengths)
    return Runner(params, spec, num_blocks=num_blocks, block_size=args.block_size,
                  max_blocks_per_seq=max_blocks, impl=impl, write_impl=args.write_impl,
                  max_num_seqs=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens,
                  record_logits=record_logits)


def make_requests(args):
    from examples.runner import Request

    return [Request(tuple(p), t) for p, t in zip(args.prompts, args.new_tokens)]


def parts_at_near_tie(hf_step_logits, hf_tokens, jax_tokens, agree: int, diff: float) -> bool:
    """Whether two greedy token lists that agree on their first ``agree`` tokens part at a
    near-tie: HF's logits at that step, for its own token and for the runner's, differ by at
    most ``2 * diff`` (``diff``: the largest |jax - hf| logits difference up to that step), so
    either argmax is within rounding of the other."""
    if agree >= min(len(hf_tokens), len(jax_tokens)):
        return False  # one list is a prefix of the other: a length difference, not a tie
    step = np.asarray(hf_step_logits[agree])
    margin = float(step[hf_tokens[agree]] - step[jax_tokens[agree]])
    return 0 <= margin <= 2 * diff


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_hf(args) -> int:
    import torch

    model = build_hf_model(args)
    hf_model = model if args.dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)
    start = time.perf_counter()
    hf_tokens, hf_logits = hf_generate(hf_model, args.prompts, args.new_tokens)
    hf_s = time.perf_counter() - start
    runner = make_runner(args, hf_model, args.dtype, args.impl, record_logits=True)
    outputs, stats = runner.generate(make_requests(args))
    print(f"model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}"
          f" kv, vocab {args.vocab}, {args.dtype}; cache: block size {args.block_size},"
          f" {runner.allocator.num_blocks} blocks; impl={args.impl}")
    ok = True
    for i, (out, hf) in enumerate(zip(outputs, hf_tokens)):
        agree = common_prefix(out.tokens, hf)
        print(f"seq {i}: prompt {args.prompt_lens[i]}, {args.new_tokens[i]} new, in batch steps"
              f" {out.admitted_step}..{out.finished_step}")
        print(f"  hf : {hf}")
        print(f"  jax: {out.tokens}")
        if args.dtype == "float32":
            steps = min(agree + 1, len(hf))
            want = np.stack(hf_logits[i][:steps])
            diff = float(np.abs(np.stack(out.logits[:steps]) - want).max())
            bound = FP32_LOGITS_RTOL * float(np.abs(want).max())
            equal, close = out.tokens == hf, diff <= bound
            tie = (not equal and close
                   and parts_at_near_tie(hf_logits[i], hf, out.tokens, agree, diff))
            ok &= (equal or tie) and close
            parted = f"parting at token {agree}, a near-tie" if tie else (
                f"DIFFERENT from token {agree}")
            print(f"  {'equal' if equal else parted};"
                  f" max |logits jax - hf| = {diff:.3g} over the first {steps} steps, bound"
                  f" {bound:.3g} -> {'within' if close else 'OUTSIDE'}")
        else:
            steps = min(args.logit_steps, agree + 1, len(hf))
            truth = hf_teacher_forced_logits(model, args.prompts[i], hf, steps)
            err_jax = float(np.abs(np.stack(out.logits[:steps]) - truth).max())
            err_hf = float(np.abs(np.stack(hf_logits[i][:steps]) - truth).max())
            bound = 2 * err_hf + BF16_REL_ATOL * float(np.abs(truth).max())
            within = err_jax <= bound
            ok &= within
            print(f"  {agree}/{len(hf)} tokens agree; first {steps} steps' logits vs float32"
                  f" truth: jax {err_jax:.3g}, hf {err_hf:.3g}, bound {bound:.3g}"
                  f" -> {'within' if within else 'OUTSIDE'}")
    print(f"batch per step (prefill, decode): {stats.batches}")
    print(f"jax runner: {stats.generated_tokens} tokens in {stats.wall_s:.2f} s ="
          f" {stats.tokens_per_s:.1f} tokens/s (first run, includes compiling"
          f" {len(stats.shapes)} step shapes); hf generate: {sum(args.new_tokens) / hf_s:.1f}"
          " tokens/s")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def bench(args) -> int:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_hf_model(args, attn_implementation="sdpa")
    torch_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = model.to(torch_dtype)
    total = sum(args.new_tokens)
    rows, tokens_by_impl = [], {}
    for impl in args.impls.split(","):
        runner = make_runner(args, model, args.dtype, impl, record_logits=False)
        requests = make_requests(args)
        runner.generate(requests)                       # compiles every step shape
        outputs, stats = runner.generate(requests)
        tokens_by_impl[impl] = [o.tokens for o in outputs]
        rows.append((f"jax runner, impl={impl}", stats.tokens_per_s, stats.wall_s,
                     len(stats.batches)))
    model = model.to(device)
    width = max(args.prompt_lens)
    ids = torch.zeros((len(args.prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(args.prompts):           # left padding
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    steps = max(args.new_tokens)

    def hf_run(count):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=count, min_new_tokens=count,
                           do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()

    hf_run(2)
    start = time.perf_counter()
    hf_run(steps)
    hf_s = time.perf_counter() - start
    hf_tps = len(args.prompts) * steps / hf_s
    rows.append(("transformers.generate (static batch, sdpa)", hf_tps, hf_s, steps))
    print(f"model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}"
          f" kv, vocab {args.vocab}, {args.dtype}; {len(args.prompts)} sequences, prompts"
          f" {min(args.prompt_lens)}..{max(args.prompt_lens)}, {total} new tokens; block size"
          f" {args.block_size}; device {device}")
    print("| runner | tokens/s | wall s | steps | vs transformers |")
    print("|---|---:|---:|---:|---:|")
    for name, tps, wall, count in rows:
        print(f"| {name} | {tps:.0f} | {wall:.2f} | {count} | {tps / hf_tps:.2f}x |")
    impls = list(tokens_by_impl)
    for other in impls[1:]:
        same = sum(a == b for a, b in zip(tokens_by_impl[impls[0]], tokens_by_impl[other]))
        print(f"sequences with identical tokens, {impls[0]} vs {other}: {same}/{len(args.prompts)}")
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return compare_hf(args) if args.compare_hf else bench(args)


if __name__ == "__main__":
    sys.exit(main())
