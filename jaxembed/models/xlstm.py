"""xLSTM (xLSTM 7B's mLSTM-only architecture) as pure functions over a params pytree whose
layers are stacked on a leading axis; the block is transformers' `xLSTMBlock`:

    x = x + mLSTM(RMSNorm(x)),   x = x + FFN(RMSNorm(x)),   out = RMSNorm(x) after the last block

    mLSTM(u): q, k [.., qk], v, o [.., v_dim] = u W;  i, f = cap·tanh((u W_{i,f} + b_{i,f}) / cap), one per head;
              h = mlstm(q, k, v, i, f) per head;  y = (σ(o) ∘ MultiHeadLayerNorm(h)) W_out
    FFN(u) = (silu(u W_gate) ∘ u W_up) W_down

Dimension letters: d = d_model, h = n_heads, k = qk head dim, v = value head dim,
u = the feed-forward width. params = {
  "embedding": [vocab, d],
  "layers": {                              # every leaf has a leading [n_layers] axis
    "norm_mlstm": [d],  "norm_ffn": [d],                     RMSNorm weights
    "q", "k": [d, h*k],  "v", "ogate": [d, h*v],             projections (x @ W)
    "igate", "fgate": [d, h],  "igate_bias", "fgate_bias": [h]
    "multihead_norm": [h*v],                                  per-head LayerNorm weight
    "out_proj": [h*v, d],
    "ffn_gate", "ffn_up": [d, u],  "ffn_down": [u, d],
    + "<name>_bias" for the norms, projections and FFN when use_bias,
  },
  "norm_f": [d],                           the final out_norm (never a bias, as in transformers)
  "lm_head": [vocab, d] (only when embeddings are untied),
}

The per-layer state is the mLSTM's (C, n, m); `layer` continues from it for any number of
tokens, which is all the scheduler needs. Checkpoints with fused projections (weight_mode
"fused") are split into this layout by the converter.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxembed import kernels, weights
from jaxembed.errors import ConfigError, check_positive_int, check_token_ids
from jaxembed.ops import mlstm
from jaxembed.runtime import Runtime

F32 = jnp.float32
State = mlstm.State  # C [b, h, k, v], n [b, h, k], m [b, h], float32


def round_up_to_multiple(x: float, multiple: int) -> int:
    """transformers' round_up_to_next_multiple_of, float arithmetic included (2.667 * 4096 -> 10944)."""
    return int(((x + multiple - 1) // multiple) * multiple)


@dataclasses.dataclass(frozen=True)
class XLSTMConfig:
    """xLSTM 7B-style language model, as transformers' `xLSTMModel`.

    Field names follow jaxembed (d_model, n_layers, n_heads, tie_embeddings); the rest keep
    transformers' xLSTMConfig names. Kernel choices there (chunkwise/sequence/step kernel,
    mode, autocast dtypes) are runtime settings of PyTorch and have no field here; chunk_size
    is the default intra-layer chunk size Q (64, the paper's xLSTM setting). Norm reductions
    always run in float32 (transformers' norm_reduction_force_float32=True).
    """

    architecture: ClassVar[str] = "xlstm"

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int = 8
    qk_dim_factor: float = 0.5
    v_dim_factor: float = 1.0
    ffn_proj_factor: float = 2.667
    ffn_round_up_to_multiple_of: int = 64
    gate_soft_cap: float = 15.0
    output_logit_soft_cap: float = 30.0
    norm_eps: float = 1e-6
    eps: float = 1e-6  # the mLSTM normaliser's eps
    use_bias: bool = False
    # How the checkpoint stores the q/k/v/o, gate and FFN-up projections (separate or fused); the
    # params are always separate. The converter and the PyTorch reference read it.
    weight_mode: str = "single"
    tie_embeddings: bool = False
    chunk_size: int = 64
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_round_up_to_multiple_of", "chunk_size"):
            check_positive_int(name, getattr(self, name), error=ConfigError)
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints -> int: hashable, JSON
        for name in ("qk_dim_factor", "v_dim_factor", "ffn_proj_factor", "gate_soft_cap", "output_logit_soft_cap",
                     "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.eps, numbers.Real) or isinstance(self.eps, bool) or not self.eps >= 0:
            raise ConfigError(f"eps must be a number >= 0, got {self.eps!r}")
        object.__setattr__(self, "eps", float(self.eps))
        for name in ("use_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_token_ids(self)
        if self.weight_mode not in ("single", "fused"):
            raise ConfigError(f"weight_mode must be 'single' or 'fused', got {self.weight_mode!r}")
        for name, dim in (("qk_dim", self.qk_dim), ("v_dim", self.v_dim)):
            if dim <= 0 or dim % self.n_heads:
                raise ConfigError(
                    f"{name} = int(d_model * {name}_factor) = {dim} must be a positive multiple of "
                    f"n_heads = {self.n_heads}"
                )

    @property
    def qk_dim(self) -> int:
        """Query/key width, int(d_model * qk_dim_factor) as transformers' xLSTMLayer (not its config's
        rounded qk_dim)."""
        return int(self.d_model * self.qk_dim_factor)

    @property
    def v_dim(self) -> int:
        return int(self.d_model * self.v_dim_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_dim // self.n_heads

    @property
    def v_head_dim(self) -> int:
        return self.v_dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Feed-forward width u: d_model * ffn_proj_factor rounded up to ffn_round_up_to_multiple_of."""
        return round_up_to_multiple(self.d_model * self.ffn_proj_factor, self.ffn_round_up_to_multiple_of)

    @property
    def hidden_size(self) -> int:
        """Embedding dimension."""
        return self.d_model

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, **dataclasses.asdict(self)}


Config = XLSTMConfig

_BIASED = ("norm_mlstm", "q", "k", "v", "ogate", "multihead_norm", "out_proj", "norm_ffn", "ffn_gate", "ffn_up",
           "ffn_down")


def param_shapes(cfg: XLSTMConfig) -> dict:
    """Shape of every parameter (without the layer axis for layer params); the converter checks against it."""
    d, h, qk, vd, u = cfg.d_model, cfg.n_heads, cfg.qk_dim, cfg.v_dim, cfg.ffn_dim
    layer = {
        "norm_mlstm": (d,),
        "q": (d, qk), "k": (d, qk), "v": (d, vd), "ogate": (d, vd),
        "igate": (d, h), "igate_bias": (h,), "fgate": (d, h), "fgate_bias": (h,),
        "multihead_norm": (vd,),
        "out_proj": (vd, d),
        "norm_ffn": (d,),
        "ffn_gate": (d, u), "ffn_up": (d, u), "ffn_down": (u, d),
    }
    if cfg.use_bias:
        layer.update({f"{name}_bias": layer[name][-1:] for name in _BIASED})
    shapes = {
        "embedding": (cfg.vocab_size, d),
        "layers": {name: (cfg.n_layers, *shape) for name, shape in layer.items()},
        "norm_f": (d,),
    }
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, d)
    return shapes


# Nothing is kept float32 when the weights are cast: the gate preactivations are float32 matmul
# outputs whatever the weight dtype, and the states and gates inside the mLSTM are float32.
FLOAT32_PARAMS = ()

VERTICAL = True  # a constant-size state per layer: vertically chunked inference applies
STATES_IN_PLACE = ("C",)  # the mLSTM memory: the kernel reads and writes it in its stack


# Layer matrices used as x @ W [d_in, d_out]: the "all linear layers" that LoRA adapts and NF4 quantises.
LINEAR_PARAMS = ("q", "k", "v", "ogate", "igate", "fgate", "out_proj", "ffn_gate", "ffn_up", "ffn_down")


def init_params(cfg: XLSTMConfig, key: jax.Array, dtype=F32) -> dict:
    """Random parameters with transformers' xLSTM initialisation (for tests, benchmarks and training
    from scratch): small-init normals, Wang-init output projections, zero gate weights with input-gate
    bias -10 and forget-gate biases spread over [3, 6], unit norms, zero biases."""
    return _init_params(cfg, key, jnp.dtype(dtype))


@partial(jax.jit, static_argnums=(0, 2))
def _init_params(cfg: XLSTMConfig, key: jax.Array, dtype) -> dict:
    shapes = param_shapes(cfg)
    lay = shapes["layers"]
    L, d, h = cfg.n_layers, cfg.d_model, cfg.n_heads
    small = (2 / (5 * d)) ** 0.5
    stds = {"embedding": small, "lm_head": small, "q": small, "k": small, "v": small, "ogate": small,
            "ffn_gate": small, "ffn_up": small, "out_proj": 2 / L / d**0.5, "ffn_down": 2 / L / cfg.ffn_dim**0.5}
    drawn = [(name, shapes.get(name) or lay[name]) for name in stds if name in shapes or name in lay]
    # one draw sliced into every random leaf: one random-bits program to compile, not one per leaf
    flat = jax.random.normal(key, (sum(math.prod(shape) for _, shape in drawn),), F32)
    normal, offset = {}, 0
    for name, shape in drawn:
        size = math.prod(shape)
        normal[name] = (stds[name] * flat[offset : offset + size].reshape(shape)).astype(dtype)
        offset += size
    layers = {name: normal.get(name, jnp.zeros(shape, dtype)) for name, shape in lay.items()}  # biases: 0
    layers.update({
        "norm_mlstm": jnp.ones(lay["norm_mlstm"], dtype), "norm_ffn": jnp.ones(lay["norm_ffn"], dtype),
        "multihead_norm": jnp.ones(lay["multihead_norm"], dtype),
        "igate_bias": jnp.full(lay["igate_bias"], -10.0, dtype),
        "fgate_bias": jnp.broadcast_to(jnp.linspace(3.0, 6.0, h), (L, h)).astype(dtype),
    })  # gate weights stay 0
    params = {"embedding": normal["embedding"], "layers": layers, "norm_f": jnp.ones((d,), dtype)}
    if "lm_head" in shapes:
        params["lm_head"] = normal["lm_head"]
    return params


def init_state(cfg: XLSTMConfig, batch: int) -> State:
    """Zero state of one layer (m = 0, as transformers starts); the scheduler stacks it over layers."""
    return mlstm.zero_state(batch, cfg.n_heads, cfg.qk_head_dim, cfg.v_head_dim)


def rms_norm(x, weight, bias, eps):
    """RMSNorm over the last axis in float32 (xLSTMRMSNorm)."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * weight.astype(F32)
    return y if bias is None else y + bias.astype(F32)


def multihead_layer_norm(x, weight, bias, eps):
    """LayerNorm of each head over its own channels, then one weight per channel.  [b, t, h, v] -> [b, t, h*v]"""
    xf = x.astype(F32)
    centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    y = y.reshape(*x.shape[:-2], -1) * weight.astype(F32)
    return y if bias is None else y + bias.astype(F32)


def soft_cap(x, cap):
    """cap * tanh(x / cap): keeps gate preactivations (and logits) in (-cap, cap)."""
    return cap * jnp.tanh(x / cap)


def _linear(x, w, b=None, out_dtype=F32):
    """x @ w (+ b) with the operands in x's dtype, accumulated in float32, out in out_dtype; w may be
    a LoRA/NF4 weight."""
    return weights.linear(x, w, bias=b, out_dtype=out_dtype)


def mlstm_mixer(cfg: XLSTMConfig, p: dict, u, state: State, *, runtime: Runtime):
    """The mLSTM layer on normalised input u [b, t, d]. Returns (out [b, t, d] float32, new state)."""
    b, t, _ = u.shape
    h = cfg.n_heads
    # q, k, v and the FFN's activations in the activation dtype straight out of their GEMMs, as in
    # transformers' bfloat16 model (half the bytes of float32 outputs); gates and states stay float32
    act = u.dtype
    # three inputs to XLA, one buffer: without the barrier XLA merges the q, k and v GEMMs into one,
    # concatenating their weights for every call (a weight-sized copy per layer and vertical chunk)
    # and copying q, k and v out of the joint output for the kernel, more than the two extra reads of u
    u_q, u_k, u_v = jax.lax.optimization_barrier((u, u, u))
    q = _linear(u_q, p["q"], p.get("q_bias"), act).reshape(b, t, h, cfg.qk_head_dim)
    k = _linear(u_k, p["k"], p.get("k_bias"), act).reshape(b, t, h, cfg.qk_head_dim)
    v = _linear(u_v, p["v"], p.get("v_bias"), act).reshape(b, t, h, cfg.v_head_dim)
    o = _linear(u, p["ogate"], p.get("ogate_bias"))
    i = soft_cap(_linear(u, p["igate"], p["igate_bias"]), cfg.gate_soft_cap)  # [b, t, h]
    f = soft_cap(_linear(u, p["fgate"], p["fgate_bias"]), cfg.gate_soft_cap)
    y, state = kernels.mlstm_chunked(q, k, v, i, f, chunk_size=runtime.chunk_size, backend=runtime.kernels,
                                     initial_state=state, eps=cfg.eps)
    y = jax.nn.sigmoid(o) * multihead_layer_norm(y, p["multihead_norm"], p.get("multihead_norm_bias"), cfg.norm_eps)
    # float32 out, as the residual it is added to: the add becomes the GEMM's epilogue (cuBLAS beta=1)
    # instead of a pass of its own over the residual
    return _linear(y.astype(act), p["out_proj"], p.get("out_proj_bias")), state


def feed_forward(p: dict, u):
    """Gated FFN: (silu(u W_gate) * u W_up) W_down.  [b, t, d] -> [b, t, d] float32 (the residual's dtype)"""
    gate = _linear(u, p["ffn_gate"], p.get("ffn_gate_bias"), u.dtype).astype(F32)
    up = _linear(u, p["ffn_up"], p.get("ffn_up_bias"), u.dtype).astype(F32)
    return _linear((jax.nn.silu(gate) * up).astype(u.dtype), p["ffn_down"], p.get("ffn_down_bias"))


def layer(cfg: XLSTMConfig, p: dict, x, state: State, *, runtime: Runtime, index=None):
    """One xLSTM block on the residual stream x [b, t, d] (float32), continuing from `state`."""
    dtype = p["q"].dtype
    u = rms_norm(x, p["norm_mlstm"], p.get("norm_mlstm_bias"), cfg.norm_eps).astype(dtype)
    out, state = mlstm_mixer(cfg, p, u, state, runtime=runtime)
    x = x + out
    u = rms_norm(x, p["norm_ffn"], p.get("norm_ffn_bias"), cfg.norm_eps).astype(dtype)
    return x + feed_forward(p, u), state


def embed_tokens(cfg: XLSTMConfig, params: dict, ids):
    """ids [b, t] -> residual stream [b, t, d] (float32, whatever the weight dtype)."""
    return jnp.take(params["embedding"], ids, axis=0).astype(F32)


def hidden(stream):
    """The stream is the residual [b, t, d] itself."""
    return stream


def final_norm(cfg: XLSTMConfig, params: dict, x):
    """transformers' out_norm (RMSNorm without bias), float32 out."""
    return rms_norm(x, params["norm_f"], None, cfg.norm_eps)


def logits(cfg: XLSTMConfig, params: dict, hidden):
    """Language-model head with the output soft cap. hidden [..., d] -> [..., vocab]."""
    out = weights.lm_head(hidden, params["embedding"] if cfg.tie_embeddings else params["lm_head"])
    return soft_cap(out, cfg.output_logit_soft_cap)
