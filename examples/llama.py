"""A Llama-architecture decoder in plain JAX whose attention runs through pallas_paged.

The layers are Hugging Face ``LlamaForCausalLM``'s, computed the way it computes them, so that the
same weights give the same greedy tokens (float32) or the same logits within bfloat16 rounding:

- RMSNorm: ``w * (x32 * rsqrt(mean(x32**2) + eps)).astype(x.dtype)`` (statistics in float32);
- RoPE (the ``default`` rope type): ``inv_freq = 1 / theta ** (arange(0, D, 2) / D)`` in float32,
  angles ``position * inv_freq`` in float32, ``cos``/``sin`` of ``concat(angles, angles)`` cast to
  the model dtype, ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = concat(-x2, x1)``;
- GQA attention: query head ``h`` reads kv head ``h // (H // KVH)``, scale ``D ** -0.5``; the new
  tokens' K/V go into the paged cache (`pallas_paged.write_kv`) before attention reads it;
- SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; pre-norm residual blocks; final RMSNorm; lm_head.

One step (`forward_step`) takes a ragged batch of tokens: the prompts being prefilled, packed one
after another (``query_start_loc``), then one token per running sequence being decoded. Prefill
attention goes through `attend_prefill`, decode attention through `pallas_paged.decode`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_paged

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LlamaSpec:
    """The architecture numbers of the model (static, hashable)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_hf_config(cls, config) -> "LlamaSpec":
        """The spec of a ``transformers.LlamaConfig``.

        Raises:
          ValueError: for features this model does not implement (biases, rope scaling, another
            activation than SiLU).
        """
        rope = getattr(config, "rope_parameters", None) or {
            "rope_type": "default", "rope_theta": config.rope_theta}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.rope_parameters={rope!r}: only rope_type='default' is"
                             " implemented")
        if config.attention_bias or config.mlp_bias:
            raise ValueError(f"{config.attention_bias=} and {config.mlp_bias=} must be False")
        if config.hidden_act != "silu":
            raise ValueError(f"{config.hidden_act=} must be 'silu'")
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size,
                   num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                   num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   rms_norm_eps=float(config.rms_norm_eps), rope_theta=float(rope["rope_theta"]))


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """``f32[head_dim // 2]``: HF's default inverse frequencies, computed by the same torch ops so
    that the bits are the same."""
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    return (1.0 / (theta ** exponents)).numpy()


def params_from_hf(state_dict, spec: LlamaSpec, dtype=jnp.float32) -> dict:
    """The weights of a ``LlamaForCausalLM`` state dict as a pytree of JAX arrays.

    Linear weights are stored transposed (``[in, out]``, so that ``x @ w``); a missing
    ``lm_head.weight`` (tied embeddings) is the embedding matrix.

    Args:
      state_dict: ``model.state_dict()``, torch tensors (any float dtype; converted to ``dtype``).
      spec: the architecture.
      dtype: the model dtype (float32 or bfloat16).

    Returns:
      ``{"embed": [V, N], "layers": [{...}] * L, "norm": [N], "lm_head": [N, V],
      "inv_freq": f32[D // 2]}``.
    """
    import torch

    def get(name, transpose=False):
        tensor = state_dict[name].detach().to(torch.float32).cpu()
        array = tensor.T.contiguous().numpy() if transpose else tensor.numpy()
        return jnp.asarray(array, dtype=dtype)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        layers.append({
            "input_norm": get(p + "input_layernorm.weight"),
            "q": get(p + "self_attn.q_proj.weight", True),       # [N, H * D]
            "k": get(p + "self_attn.k_proj.weight", True),       # [N, KVH * D]
            "v": get(p + "self_attn.v_proj.weight", True),       # [N, KVH * D]
            "o": get(p + "self_attn.o_proj.weight", True),       # [H * D, N]
            "post_norm": get(p + "post_attention_layernorm.weight"),
            "gate": get(p + "mlp.gate_proj.weight", True),       # [N, I]
            "up": get(p + "mlp.up_proj.weight", True),           # [N, I]
            "down": get(p + "mlp.down_proj.weight", True),       # [I, N]
        })
    head = "lm_head.weight" if "lm_head.weight" in state_dict else "model.embed_tokens.weight"
    return {"embed": get("model.embed_tokens.weight"), "layers": layers,
            "norm": get("model.norm.weight"), "lm_head": get(head, True),
            "inv_freq": jnp.asarray(rope_inv_freq(spec.head_dim, spec.rope_theta))}


class StepBatch(NamedTuple):
    """One step's tokens: ``Tp`` prefill tokens (the new prompts, packed) then ``Dn`` decode tokens.

    Padding tokens have slot ``-1``; padding sequences have length 0 and no new tokens.
    """

    tokens: jax.Array                 # i32[Tp + Dn]
    positions: jax.Array              # i32[Tp + Dn], each token's position in its sequence
    slot_mapping: jax.Array           # i32[Tp + Dn], its cache slot, -1 for padding
    prefill_block_tables: jax.Array   # i32[P, max_blocks]
    prefill_context_lens: jax.Array   # i32[P], cached tokens after this step's write
    query_start_loc: jax.Array        # i32[P + 1], prompt b owns tokens[qsl[b]:qsl[b + 1]]
    prefill_last: jax.Array           # i32[P], index in tokens of each prompt's last token
    decode_block_tables: jax.Array    # i32[Dn, max_blocks]
    decode_context_lens: jax.Array    # i32[Dn], cached tokens after this step's write


def attend_prefill(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale=None,
                   *, impl="pallas", interpret=None):
    """Prefill attention of the new prompts: the ragged paged-attention contract.

    One `pallas_paged.paged_attention` call: sequence ``b`` owns
    ``q[query_start_loc[b]:query_start_loc[b + 1]]``, causal within its new tokens, which were
    written to the cache first; ``context_lens`` include them. Tokens past
    ``query_start_loc[-1]`` (padding) give zeros.

    Returns:
      ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    return pallas_paged.paged_attention(q, k_cache, v_cache, block_tables, context_lens,
                                        query_start_loc, scale, impl=impl, interpret=interpret)


def rms_norm(x, weight, eps):
    """HF's LlamaRMSNorm: float32 statistics, normalized value cast back, then the weight."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def linear(x, w):
    """``x @ w`` with float32 accumulation, rounded once to ``x.dtype`` (as torch's Linear)."""
    out = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=HIGHEST,
                              preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def rope_cos_sin(positions, inv_freq, dtype):
    """``cos, sin [T, D]`` for positions ``i32[T]``, HF's default RoPE."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D // 2]
    emb = jnp.concatenate([angles, angles], axis=-1)                       # [T, D]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x, cos, sin):
    """``x [T, heads, D]`` rotated: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def forward_step(params, caches, batch: StepBatch, *, spec: LlamaSpec, impl="pallas",
                 write_impl=None, interpret=None):
    """Run one step of the model over ``batch``; write its K/V; return the sampled rows' logits.

    Every layer writes the K/V of all the step's tokens with one `pallas_paged.write_kv`, then
    attends: prefill tokens through `attend_prefill`, decode tokens through `pallas_paged.decode`.

    Args:
      params: from `params_from_hf`.
      caches: ``[(k_cache, v_cache)] * num_layers``, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype.
      batch: the step's tokens (`StepBatch`).
      spec: the architecture (static).
      impl: the attention implementation (`pallas_paged.decode`'s ``impl``; the prefill's
        `pallas_paged.paged_attention` runs ``"xla"`` for ``"xla"`` and its Triton kernel for
        every other value).
      write_impl: `pallas_paged.write_kv`'s ``impl`` (None: its default).
      interpret: Pallas interpret mode (None: exactly when there is no GPU).

    Returns:
      ``(logits f32[P + Dn, vocab], caches)``: the logits after each prompt's last token, then after
      each decode token.
    """
    num_decode = batch.decode_context_lens.shape[0]
    num_prefill_tokens = batch.tokens.shape[0] - num_decode
    scale = spec.head_dim ** -0.5
    x = params["embed"][batch.tokens]                                       # [T, N]
    dtype = x.dtype
    cos, sin = rope_cos_sin(batch.positions, params["inv_freq"], dtype)    # [T, D]
    new_caches = []
    for layer, (k_cache, v_cache) in zip(params["layers"], caches):
        h = rms_norm(x, layer["input_norm"], spec.rms_norm_eps)
        q = linear(h, layer["q"]).reshape(-1, spec.num_heads, spec.head_dim)       # [T, H, D]
        k = linear(h, layer["k"]).reshape(-1, spec.num_kv_heads, spec.head_dim)    # [T, KVH, D]
        v = linear(h, layer["v"]).reshape(-1, spec.num_kv_heads, spec.head_dim)    # [T, KVH, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = pallas_paged.write_kv(k_cache, v_cache, k, v, batch.slot_mapping,
                                                 impl=write_impl, interpret=interpret)
        new_caches.append((k_cache, v_cache))
        prefill_out = attend_prefill(
            q[:num_prefill_tokens], k_cache, v_cache, batch.prefill_block_tables,
            batch.prefill_context_lens, batch.query_start_loc, scale,
            impl="xla" if impl == "xla" else "pallas", interpret=interpret)
        decode_out = pallas_paged.decode(
            q[num_prefill_tokens:], k_cache, v_cache, batch.decode_block_tables,
            batch.decode_context_lens, scale, impl=impl, interpret=interpret)
        attn = jnp.concatenate([prefill_out, decode_out], axis=0).reshape(x.shape[0], -1)
        x = x + linear(attn, layer["o"])
        h = rms_norm(x, layer["post_norm"], spec.rms_norm_eps)
        gate = jax.nn.silu(linear(h, layer["gate"]).astype(jnp.float32)).astype(dtype)
        x = x + linear(gate * linear(h, layer["up"]), layer["down"])
    rows = jnp.concatenate([batch.prefill_last,
                            num_prefill_tokens + jnp.arange(num_decode, dtype=jnp.int32)])
    h = rms_norm(x[rows], params["norm"], spec.rms_norm_eps)
    return linear(h, params["lm_head"]).astype(jnp.float32), new_caches
