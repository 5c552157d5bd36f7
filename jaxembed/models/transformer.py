"""Mistral / Qwen2-style decoder transformers as pure functions, the paper's baselines (Section 4).

params = {
  "embedding": [vocab, d],
  "layers": {                                  # every leaf has a leading [n_layers] axis
    "attn_norm": [d], "wq": [d, h hd], "wk": [d, kv hd], "wv": [d, kv hd], "wo": [h hd, d],
    "bq": [h hd], "bk": [kv hd], "bv": [kv hd] (qkv_bias: Qwen2),
    "mlp_norm": [d], "w_gate": [d, f], "w_up": [d, f], "w_down": [f, d],
  },
  "norm_f": [d],
  "lm_head": [vocab, d] (only when embeddings are untied),
}

RoPE (rotate-half form), grouped-query attention (`jaxembed.ops.attention`: cuDNN flash
attention through `jax.nn.dot_product_attention` on GPU, FlashAttention's blockwise schedule in
XLA elsewhere), an optional sliding window (token i sees the
`sliding_window` tokens up to and including itself, as transformers' Mistral), SwiGLU MLP,
RMSNorm. Attention has no fixed-size state: these models run horizontally only (their memory
grows with the length, which is the comparison the paper draws), so `VERTICAL = False`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxembed import kernels as kernel_backends
from jaxembed import weights
from jaxembed.errors import ConfigError, check_positive_int, check_token_ids
from jaxembed.ops import attention as ops_attention
from jaxembed.runtime import Runtime

F32 = jnp.float32
VERTICAL = False  # no constant-size state: the scheduler runs the whole sequence at once
STATES_IN_PLACE = ()


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Decoder transformer. Letters: d = d_model, h = n_heads, kv = n_kv_heads, hd = head_dim, f = d_ff."""

    architecture: ClassVar[str] = "transformer"

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int | None = None  # default d_model // n_heads
    rope_theta: float = 10000.0
    sliding_window: int | None = None
    qkv_bias: bool = False  # Qwen2: biases on q, k, v
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    chunk_size: int = 64  # length-bucket unit for the embedder (attention has no chunked form)
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "chunk_size"):
            check_positive_int(name, getattr(self, name), error=ConfigError)
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints -> int: hashable, JSON
        check_token_ids(self)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads = {self.n_heads} is not a multiple of n_kv_heads = {self.n_kv_heads}")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(f"d_model = {self.d_model} is not a multiple of n_heads = {self.n_heads}")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be a positive int or null, got {self.sliding_window!r}")

    @property
    def hidden_size(self) -> int:
        return self.d_model

    def to_dict(self) -> dict:
        return {"architecture": self.architecture, **dataclasses.asdict(self)}


Config = TransformerConfig


class State(NamedTuple):
    """Attention carries nothing between calls here (horizontal only)."""


def param_shapes(cfg: TransformerConfig) -> dict:
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layer = {
        "attn_norm": (cfg.d_model,), "wq": (cfg.d_model, q), "wk": (cfg.d_model, kv), "wv": (cfg.d_model, kv),
        "wo": (q, cfg.d_model), "mlp_norm": (cfg.d_model,), "w_gate": (cfg.d_model, cfg.d_ff),
        "w_up": (cfg.d_model, cfg.d_ff), "w_down": (cfg.d_ff, cfg.d_model),
    }
    if cfg.qkv_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    shapes = {"embedding": (cfg.vocab_size, cfg.d_model), "layers": {k: (cfg.n_layers, *v) for k, v in layer.items()},
              "norm_f": (cfg.d_model,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.d_model)
    return shapes


FLOAT32_PARAMS = ()
LINEAR_PARAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def init_params(cfg: TransformerConfig, key: jax.Array, dtype=F32) -> dict:
    """Random parameters (normal, std 0.02 as transformers' initializer_range; norms near one)."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys, strict=True):
        noise = jax.random.normal(k, shape, F32)
        out.append((1.0 + 0.1 * noise if "norm" in path else 0.02 * noise).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def init_state(cfg: TransformerConfig, batch: int) -> State:
    return State()


def rms_norm(x, weight, eps):
    """transformers' RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.astype(F32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weight * y


def rope(x, theta: float):
    """Rotary embedding (rotate-half form) at positions 0..t-1. x [b, t, heads, hd]."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=F32) / hd))
    angles = jnp.arange(t, dtype=F32)[:, None] * inv_freq[None]  # [t, hd/2]
    cos, sin = jnp.cos(jnp.concatenate([angles, angles], -1)), jnp.sin(jnp.concatenate([angles, angles], -1))
    x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(F32) * cos[None, :, None] + rotated * sin[None, :, None]).astype(x.dtype)


def attention_op(q, k, v, window, backend: str):
    """cuDNN flash attention where the kernels `backend` is the GPU's and the dtype suits it;
    elsewhere the blockwise XLA form (memory linear in the length, like FlashAttention)."""
    if kernel_backends.resolve(backend) == "pallas" and q.dtype in (jnp.bfloat16, jnp.float16):
        return ops_attention.flash(q, k, v, window)
    return ops_attention.blockwise(q, k, v, window)


def attention(cfg: TransformerConfig, p: dict, u, backend: str):
    b, t, _ = u.shape
    dtype = u.dtype
    q = weights.linear(u, p["wq"], bias=p.get("bq")).astype(dtype).reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = weights.linear(u, p["wk"], bias=p.get("bk")).astype(dtype).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = weights.linear(u, p["wv"], bias=p.get("bv")).astype(dtype).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    out = attention_op(q, k, v, cfg.sliding_window, backend)
    return weights.linear(out.reshape(b, t, cfg.n_heads * cfg.head_dim), p["wo"])


def layer(cfg: TransformerConfig, p: dict, x, state: State, *, runtime: Runtime, index=None):
    """x + attn(norm(x)), then + mlp(norm(x)). x [b, t, d]."""
    x = x + attention(cfg, p, rms_norm(x, p["attn_norm"], cfg.norm_eps), runtime.kernels).astype(x.dtype)
    h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
    hidden = jax.nn.silu(weights.linear(h, p["w_gate"])) * weights.linear(h, p["w_up"])
    return x + weights.linear(hidden.astype(h.dtype), p["w_down"]).astype(x.dtype), state


def embed_tokens(cfg: TransformerConfig, params: dict, ids):
    return jnp.take(params["embedding"], ids, axis=0)


def hidden(stream):
    """The stream is the residual [b, t, d] itself."""
    return stream


def final_norm(cfg: TransformerConfig, params: dict, x):
    return rms_norm(x, params["norm_f"], cfg.norm_eps).astype(F32)


def logits(cfg: TransformerConfig, params: dict, hidden):
    return weights.lm_head(hidden, params["embedding"] if cfg.tie_embeddings else params["lm_head"])
