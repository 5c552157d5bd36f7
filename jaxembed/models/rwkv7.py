"""RWKV7 ("Goose", x070) as pure functions over a params pytree whose layers are stacked on a leading axis.

Semantics follow BlinkDL's reference (`RWKV_x070_TMix_seq` / `RWKV_x070_CMix_seq` in the rwkv pip
package); fla-org's `RWKV7Model` computes the same function under other names.

Dimension letters: b batch, t time, d = d_model = h * n, h heads, n head size (key = value head
dim), f channel-mix width, r_w / r_a / r_v / r_g the low-rank (LoRA) widths, v vocabulary.

params = {
  "embedding": [v, d],
  "ln0_weight", "ln0_bias": [d],           # LayerNorm on the embeddings (BlinkDL's blocks.0.ln0)
  "layers": {                              # every leaf has a leading [n_layers] axis
    "ln1_weight", "ln1_bias", "ln2_weight", "ln2_bias": [d],
    "x_r", "x_w", "x_k", "x_v", "x_a", "x_g": [d],      # token-shift mixes of the time mix
    "w0": [d], "w1": [d, r_w], "w2": [r_w, d],          # decay:  w0 + tanh(x w1) w2
    "a0": [d], "a1": [d, r_a], "a2": [r_a, d],          # in-context learning rate
    "v0": [d], "v1": [d, r_v], "v2": [r_v, d],          # value residual gate (unused by layer 0)
    "g1": [d, r_g], "g2": [r_g, d],                     # output gate: sigmoid(x g1) g2
    "k_k": [d], "k_a": [d], "r_k": [h, n],
    "receptance", "key", "value", "output": [d, d],     # x @ W, W [in, out]
    "ln_x_weight", "ln_x_bias": [d],                    # per-head GroupNorm of the WKV output
    "ffn_x_k": [d], "ffn_key": [d, f], "ffn_value": [f, d],
  },
  "ln_out_weight", "ln_out_bias": [d],
  "lm_head": [v, d] (optional: embedders never use it),
}

Between layers the scheduler carries a `Stream`: the residual x and the first layer's values
(RWKV7's value residual: every later layer mixes them into its own values). The per-layer state
is the two token-shift inputs and the WKV matrix state; `layer` continues from it for any number
of tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from jaxembed import kernels, weights
from jaxembed.errors import ConfigError, check_positive_int, check_token_ids
from jaxembed.ops import wkv7
from jaxembed.runtime import Runtime

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RWKV7Config:
    """RWKV7 language model (BlinkDL's x070 / fla's RWKV7Model). d_ffn None means 4 * d_model."""

    architecture: ClassVar[str] = "rwkv7"

    vocab_size: int
    d_model: int
    n_layers: int
    head_size: int = 64
    d_ffn: int | None = None
    decay_low_rank: int = 64
    a_low_rank: int = 64
    v_low_rank: int = 32
    gate_low_rank: int = 128
    chunk_size: int = 32  # the paper's RWKV7 intra-layer chunk size Q
    norm_eps: float = 1e-5  # LayerNorms ln0/ln1/ln2/ln_out (torch's default, as in BlinkDL's package)
    # GroupNorm over each head's WKV output: BlinkDL's package hardcodes 64e-5 for every head size,
    # fla uses head_dim * norm_eps (the same for head size 64).
    head_norm_eps: float = 64e-5
    eos_token_id: int | None = 0  # RWKV World tokenizer: 0 is end of text

    def __post_init__(self):
        if self.d_ffn is None:
            object.__setattr__(self, "d_ffn", 4 * self.d_model if isinstance(self.d_model, int) else None)
        for name in ("vocab_size", "d_model", "n_layers", "head_size", "d_ffn", "decay_low_rank", "a_low_rank",
                     "v_low_rank", "gate_low_rank", "chunk_size"):
            check_positive_int(name, getattr(self, name), error=ConfigError)
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints -> int: hashable, JSON
        if self.d_model % self.head_size:
            raise ConfigError(f"d_model = {self.d_model} is not a multiple of head_size = {self.head_size}")
        if self.chunk_size > wkv7.MAX_CHUNK:
            raise ConfigError(f"chunk_size = {self.chunk_size} exceeds {wkv7.MAX_CHUNK}, the largest chunk whose "
                              f"factored decays stay inside float32's range (see jaxembed.ops.wkv7)")
        for name in ("norm_eps", "head_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise ConfigError(f"{name} must be a float in (0, 1), got {value!r}")
            object.__setattr__(self, name, float(value))
        check_token_ids(self)

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_size

    @property
    def hidden_size(self) -> int:
        """Embedding dimension."""
        return self.d_model

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, **dataclasses.asdict(self)}


Config = RWKV7Config


class Stream(NamedTuple):
    """What flows between layers."""

    x: jax.Array  # [b, t, d] residual stream, float32
    v_first: jax.Array  # [b, t, d] layer 0's values (zeros until layer 0 has run), in the value GEMM's dtype


class State(NamedTuple):
    shift_att: jax.Array  # [b, d] the time mix's normalised input at the previous token, float32
    wkv: jax.Array  # [b, h, n, n] WKV state S [value dim, key dim] per head, float32
    shift_ffn: jax.Array  # [b, d] the channel mix's normalised input at the previous token, float32


def param_shapes(cfg: RWKV7Config) -> dict:
    """Shape of every parameter (without the layer axis for layer params); the converter checks against it."""
    d, f = cfg.d_model, cfg.d_ffn
    vec = (d,)
    layer = {
        **{name: vec for name in ("ln1_weight", "ln1_bias", "ln2_weight", "ln2_bias",
                                  "x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a",
                                  "ln_x_weight", "ln_x_bias", "ffn_x_k")},
        "w1": (d, cfg.decay_low_rank), "w2": (cfg.decay_low_rank, d),
        "a1": (d, cfg.a_low_rank), "a2": (cfg.a_low_rank, d),
        "v1": (d, cfg.v_low_rank), "v2": (cfg.v_low_rank, d),
        "g1": (d, cfg.gate_low_rank), "g2": (cfg.gate_low_rank, d),
        "r_k": (cfg.n_heads, cfg.head_size),
        **{name: (d, d) for name in ("receptance", "key", "value", "output")},
        "ffn_key": (d, f), "ffn_value": (f, d),
    }
    return {
        "embedding": (cfg.vocab_size, d),
        "ln0_weight": vec, "ln0_bias": vec,
        "layers": {k: (cfg.n_layers, *v) for k, v in layer.items()},
        "ln_out_weight": vec, "ln_out_bias": vec,
        "lm_head": (cfg.vocab_size, d),
    }


# The decay bias stays float32 when the rest of the model is cast to bfloat16: the decays are
# computed in float32 from it, and their error compounds over every token the state carries.
FLOAT32_PARAMS = ("w0",)

VERTICAL = True  # a constant-size state per layer: vertically chunked inference applies
STATES_IN_PLACE = ("wkv",)  # the WKV state: the WKV7 kernel reads and writes it in its stack


# Layer matrices used as x @ W [d_in, d_out]: the "all linear layers" that LoRA adapts and NF4 quantises.
LINEAR_PARAMS = ("receptance", "key", "value", "output", "w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2",
                 "ffn_key", "ffn_value")


def init_params(cfg: RWKV7Config, key: jax.Array, dtype=F32) -> dict:
    """Random parameters in the ranges of a trained RWKV7 (for tests, benchmarks and demos).

    Unlike BlinkDL's training init (zero output projections, zero LoRA down-projections), every
    matrix is random, so each part of the layer affects the output and checks on it have teeth.
    """
    return _init_params(cfg, key, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(cfg: RWKV7Config, key, dtype):
    # One normal and one uniform draw for all leaves up to 2^24 elements, cut into leaves: each
    # jax.random call inlines its own sampler, and fifty of them take seconds to compile on CPU.
    # Larger leaves (a 7B model's matrices) get draws of their own, so no flat copy of them exists.
    shapes = param_shapes(cfg)
    L, d, f = cfg.n_layers, cfg.d_model, cfg.d_ffn
    # leaf path -> (distribution, scale, offset): normal(offset, scale) or uniform(offset, offset + scale)
    spec = {"embedding": ("normal", 1.0, 0.0), "lm_head": ("normal", d**-0.5, 0.0)}
    for prefix in ("ln0", "ln_out", "layers/ln1", "layers/ln2", "layers/ln_x"):
        spec[prefix + "_weight"], spec[prefix + "_bias"] = ("normal", 0.2, 1.0), ("normal", 0.1, 0.0)
    for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "ffn_x_k"):
        spec["layers/" + name] = ("uniform", 1.0, 0.0)
    spec |= {
        "layers/w0": ("uniform", 7.0, -6.0),  # decays from ~0.999 per token to ~0.6
        "layers/a0": ("normal", 0.5, 0.0), "layers/v0": ("normal", 0.5, 0.0),
        "layers/k_k": ("normal", 0.2, 0.8), "layers/k_a": ("normal", 0.2, 1.0), "layers/r_k": ("normal", 0.3, 0.0),
        "layers/receptance": ("normal", d**-0.5, 0.0), "layers/key": ("normal", d**-0.5, 0.0),
        "layers/value": ("normal", d**-0.5, 0.0), "layers/output": ("normal", (d * L) ** -0.5, 0.0),
        "layers/ffn_key": ("normal", d**-0.5, 0.0), "layers/ffn_value": ("normal", (f * L) ** -0.5, 0.0),
    }
    for m, rank in (("w", cfg.decay_low_rank), ("a", cfg.a_low_rank), ("v", cfg.v_low_rank), ("g", cfg.gate_low_rank)):
        spec[f"layers/{m}1"], spec[f"layers/{m}2"] = ("normal", d**-0.5, 0.0), ("normal", 0.5 * rank**-0.5, 0.0)

    def shape_of(path):
        *parents, leaf = path.split("/")
        return (shapes["layers"] if parents else shapes)[leaf]

    def sample(kind, k, shape):
        return (jax.random.normal if kind == "normal" else jax.random.uniform)(k, shape, F32)

    big = [path for path in spec if math.prod(shape_of(path)) > 1 << 24]
    keys = iter(jax.random.split(key, 2 + len(big)))
    flat = {}
    for kind in ("normal", "uniform"):
        size = sum(math.prod(shape_of(p)) for p, (k, _, _) in spec.items() if k == kind and p not in big)
        flat[kind] = [sample(kind, next(keys), (size,)), 0]  # [draw, offset]
    params: dict = {"layers": {}}
    for path, (kind, scale, shift) in spec.items():
        shape = shape_of(path)
        if path in big:
            z = sample(kind, next(keys), shape)
        else:
            draw, offset = flat[kind]
            z = draw[offset : offset + math.prod(shape)].reshape(shape)
            flat[kind][1] += math.prod(shape)
        *parents, leaf = path.split("/")
        (params["layers"] if parents else params)[leaf] = (shift + scale * z).astype(
            F32 if leaf in FLOAT32_PARAMS else dtype)
    return params


def init_state(cfg: RWKV7Config, batch: int) -> State:
    """Zero state of one layer; the scheduler stacks it over layers."""
    d, h, n = cfg.d_model, cfg.n_heads, cfg.head_size
    return State(jnp.zeros((batch, d), F32), jnp.zeros((batch, h, n, n), F32), jnp.zeros((batch, d), F32))


def layer_norm(x, weight, bias, eps):
    """LayerNorm over the last axis in float32 (biased variance, as torch)."""
    x = x.astype(F32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    x = x - mean
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * weight.astype(F32) + bias.astype(F32)


def _linear(x, w, out_dtype=None):
    """x @ w with the operands in w's dtype, accumulated in float32, out in out_dtype (default: w's
    dtype, so a bfloat16 model's GEMMs write bfloat16, as BlinkDL's and fla's bf16 modules do); w
    may be a LoRA/NF4 weight."""
    return weights.linear(x, w, w.dtype, out_dtype=w.dtype if out_dtype is None else out_dtype)


def _token_shift(u, prev):
    """(previous token's u minus u [b, t, d] float32, u at the last token [b, d]); prev [b, d] is u
    before this block (a state this layer wrote: u's values, exact in u's dtype). A select rather
    than a concatenation: XLA fuses it into the mixes that read it instead of writing the shifted
    copy out for every vertical chunk."""
    first = jnp.arange(u.shape[1])[None, :, None] == 0
    shifted = jnp.where(first, prev[:, None].astype(u.dtype), jnp.pad(u[:, :-1], ((0, 0), (1, 0), (0, 0))))
    return shifted.astype(F32) - u.astype(F32), u[:, -1]


# The low-rank (LoRA) paths' first matrices, each applied to its own token-shift mix of u:
# x_m = u (1 - mu_m) + u_prev mu_m, so x_m W = u [(1 - mu_m) W] + shift(u [mu_m W]) (a row shift
# commutes with a product on the right). All four are one GEMM of u itself against [(1 - mu) W |
# mu W] for every m, whose second half is shifted by a token after it: the w, a and g mixes are never
# written (8 KB a token each at d = 4096; v's still is, for the value GEMM), and the four GEMMs' reads
# of their mixes become one read of u.
LORA_INPUTS = (("x_w", "w1"), ("x_a", "a1"), ("x_v", "v1"), ("x_g", "g1"))


def _lora_inputs(p: dict, u, prev):
    """{"w1": x_w @ w1, "a1": ..., "v1": ..., "g1": ...} [b, t, r_m] float32 by the one GEMM above (written in
    the weights' dtype, as each LoRA's GEMM wrote it, its two halves added in float32); u [b, t, d] is
    the normalised input, prev [b, d] its previous token (the shift state). None when a matrix is a
    DerivedWeight (LoRA / NF4), which makes its own product."""
    if any(weights.is_derived(p[m]) for _, m in LORA_INPUTS):
        return None
    dtype = p["w1"].dtype
    mats = [p[m].astype(F32) for _, m in LORA_INPUTS]
    mixes = [p[x].astype(F32)[:, None] for x, _ in LORA_INPUTS]
    now = jnp.concatenate([w * (1 - mu) for w, mu in zip(mats, mixes, strict=True)], axis=1).astype(dtype)
    before = jnp.concatenate([w * mu for w, mu in zip(mats, mixes, strict=True)], axis=1).astype(dtype)
    rank = now.shape[1]
    both = weights.dot(u, jnp.concatenate([now, before], axis=1), dtype, out_dtype=dtype)  # [b, t, 2 rank]
    first = weights.dot(prev[:, None], before, dtype)  # the product of the token before u's first
    is_first = jnp.arange(u.shape[1])[None, :, None] == 0
    out, start = {}, 0
    for (_, name), w in zip(LORA_INPUTS, mats, strict=True):  # each LoRA's own columns, so each reads only them
        end = start + w.shape[1]
        past = jnp.pad(both[:, :-1, rank + start: rank + end], ((0, 0), (1, 0), (0, 0)))
        out[name] = both[..., start:end].astype(F32) + jnp.where(is_first, first[..., start:end], past.astype(F32))
        start = end
    return out


def _heads(x, cfg):
    return x.reshape(*x.shape[:-1], cfg.n_heads, cfg.head_size)


def time_mix(cfg: RWKV7Config, p: dict, u, state: State, v_first, is_first, *, runtime: Runtime):
    """RWKV7's time mix on the normalised input u [b, t, d].

    Returns (out [b, t, d] float32, shift state [b, d], WKV state [b, h, n, n], v_first [b, t, d]).
    """
    delta, shift = _token_shift(u, state.shift_att)

    def mixed(name):  # u + (u_prev - u) * x_name
        return u + delta * p[name].astype(F32)

    r = _linear(mixed("x_r"), p["receptance"])
    k = _linear(mixed("x_k"), p["key"])
    v = _linear(mixed("x_v"), p["value"])
    lora_in = _lora_inputs(p, u, state.shift_att)

    def lora_down(mix, name):  # the LoRA's first product, x_mix @ p[name]
        return lora_in[name] if lora_in is not None else _linear(mixed(mix), p[name])

    w_lora = _linear(jnp.tanh(lora_down("x_w", "w1")), p["w2"], F32)  # the decay's: float32
    a_lora = _linear(lora_down("x_a", "a1"), p["a2"])  # the in-context learning rate's, before a0
    g = _linear(jax.nn.sigmoid(lora_down("x_g", "g1")), p["g2"])
    # Value residual: layer 0's values are the stream's v_first; later layers mix them in.
    v_gate = jax.nn.sigmoid(p["v0"].astype(F32) + _linear(lora_down("x_v", "v1"), p["v2"]))
    v_first = jnp.where(is_first, v, v_first)
    v = jnp.where(is_first, v, v + (v_first - v) * v_gate).astype(v_first.dtype)  # the GEMMs' dtype
    # the decay's logits: the operator maps them to log w = -exp(-1/2) sigmoid(.) as it loads them
    w_logit = p["w0"].astype(F32) + w_lora

    # The operator derives the delta rule's inputs from k and a's LoRA output itself (a =
    # sigmoid(a0 + a_lora), kk = k ∘ k_k normalised per head: key k ∘ (1 + (a - 1) ∘ k_a), a = -kk,
    # b = kk ∘ a, and the bonus weight r · (key ∘ r_k)), in float32 from inputs in the GEMMs' dtype
    # (half the bytes in bf16, as BlinkDL's and fla's kernels take them); its kernel does so per
    # tile, so none of them is written to memory. y comes back in v's dtype.
    def per_head(name):
        return p[name].reshape(cfg.n_heads, cfg.head_size)

    vh = _heads(v, cfg)
    y, bonus_weight, wkv_state = kernels.wkv7_rwkv7_chunked(
        _heads(r, cfg), _heads(w_logit, cfg), _heads(k, cfg), vh, _heads(a_lora, cfg), per_head("a0"), per_head("k_k"),
        per_head("k_a"), p["r_k"], chunk_size=runtime.chunk_size, backend=runtime.kernels,
        initial_state=state.wkv)  # [b, t, h, n]
    # GroupNorm, one group per head (biased variance, in float32), then the per-channel affine
    y = y.astype(F32)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    y = y - mean
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + cfg.head_norm_eps)
    y = y.reshape(u.shape) * p["ln_x_weight"].astype(F32) + p["ln_x_bias"].astype(F32)
    # the "bonus": the current token's own value, weighted by r · (key ∘ r_k) per head
    y = y + (bonus_weight[..., None] * vh.astype(F32)).reshape(u.shape)
    # the GEMMs that feed the residual write float32, its dtype: the add becomes their epilogue
    # (cuBLAS beta=1) instead of a pass of its own over the residual
    return _linear(y * g, p["output"], F32), shift, wkv_state, v_first


def channel_mix(p: dict, u, prev):
    """RWKV7's channel mix (squared-ReLU MLP on a token-shifted input). Returns (out [b, t, d] float32, shift state)."""
    delta, shift = _token_shift(u, prev)
    k = _linear(u + delta * p["ffn_x_k"].astype(F32), p["ffn_key"])
    # relu(k)² as a select: XLA folds a relu into the GEMM as a cuBLASLt epilogue, and such a GEMM
    # cannot read its layer's weight in place out of the stack (dynamic-slice fusion), so in the
    # vertical schedule it copied the 134 MB ffn_key per chunk and layer; the square is a pass anyway
    k = jnp.where(k > 0, k * k, 0.0).astype(k.dtype)
    return _linear(k, p["ffn_value"], F32), shift


def layer(cfg: RWKV7Config, p: dict, stream: Stream, state: State, *, runtime: Runtime, index):
    """One block: x + time_mix(ln1(x)), then + channel_mix(ln2(x)). `index` (the layer number, traced
    inside the scheduler's scan) selects layer 0's value-residual role without a Python branch."""
    x, v_first = stream
    # the normalised inputs in the activation dtype, as BlinkDL's bf16 modules keep them: each is
    # read by 6 (time mix) or 1 (channel mix) token-shift mixes, each feeding its own GEMM
    def normalised(x, name):  # written once (the barrier): XLA would recompute the norm in each mix
        return jax.lax.optimization_barrier(
            layer_norm(x, p[name + "_weight"], p[name + "_bias"], cfg.norm_eps).astype(p["receptance"].dtype))

    att, shift_att, wkv_state, v_first = time_mix(cfg, p, normalised(x, "ln1"), state, v_first, index == 0,
                                                  runtime=runtime)
    x = x + att
    ffn, shift_ffn = channel_mix(p, normalised(x, "ln2"), state.shift_ffn)
    return Stream(x + ffn, v_first), State(shift_att, wkv_state, shift_ffn)


def embed_tokens(cfg: RWKV7Config, params: dict, ids) -> Stream:
    """ids [b, t] -> Stream(ln0(embedding[ids]) [b, t, d] float32, zeros for v_first in the value
    GEMM's dtype, which writes it at layer 0)."""
    x = layer_norm(jnp.take(params["embedding"], ids, axis=0), params["ln0_weight"], params["ln0_bias"], cfg.norm_eps)
    return Stream(x, jnp.zeros(x.shape, params["layers"]["value"].dtype))


def hidden(stream: Stream):
    """The residual stream [b, t, d]."""
    return stream.x


def final_norm(cfg: RWKV7Config, params: dict, x):
    """ln_out of the residual stream (float32 out)."""
    return layer_norm(x, params["ln_out_weight"], params["ln_out_bias"], cfg.norm_eps)


def logits(cfg: RWKV7Config, params: dict, hidden):
    """Language-model head. hidden [..., d] -> [..., v]."""
    return weights.lm_head(hidden, params["lm_head"])
