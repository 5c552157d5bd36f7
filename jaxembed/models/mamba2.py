"""Mamba2 as pure functions over a params pytree whose layers are stacked on a leading axis.

params = {
  "embedding": [vocab, d],
  "layers": {                              # every leaf has a leading [n_layers] axis
    "norm": [d],                           # pre-mixer RMSNorm
    "z_proj": [d, e], "z_proj_bias": [e] (use_bias),                  # in_proj's z (gate) rows
    "xbcdt_proj": [d, conv_dim + h], "xbcdt_proj_bias": [conv_dim + h],  # in_proj's x, B, C, dt rows
    "conv_weight": [k, conv_dim], "conv_bias": [conv_dim] (use_conv_bias),
    "dt_bias": [h], "A_log": [h], "D": [h] or [h, p],
    "mixer_norm": [e],                     # grouped gated RMSNorm
    "out_proj": [e, d], "out_proj_bias": [d] (use_bias),
  },
  "norm_f": [d],
  "lm_head": [vocab, d] (only when embeddings are untied),
}

The per-layer state is the conv state (the last k-1 conv inputs) plus the SSM state, and
`layer` continues from it for any number of tokens, which is all the scheduler needs.
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
from jaxembed.ops.norm import gated_norm_terms, rms_norm
from jaxembed.runtime import Runtime

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 (SSD) language model, as in mamba_ssm's `Mamba2` block and transformers' `Mamba2Model`.

    Dimension letters used throughout: d = d_model, e = d_inner = expand * d_model,
    h = n_heads, p = head_dim, g = n_groups, n = d_state, k = d_conv.
    """

    architecture: ClassVar[str] = "mamba2"

    vocab_size: int
    d_model: int
    n_layers: int
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    head_dim: int = 64
    n_groups: int = 1
    chunk_size: int = 256
    norm_eps: float = 1e-5
    dt_limit: tuple[float, float] = (0.0, math.inf)
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    tie_embeddings: bool = False
    d_has_hdim: bool = False  # mamba_ssm's D_has_hdim: D is [h, p] instead of [h]
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "d_state", "d_conv", "expand", "head_dim", "n_groups",
                     "chunk_size"):
            check_positive_int(name, getattr(self, name), error=ConfigError)
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy ints -> int: hashable, JSON
        check_token_ids(self)
        if len(self.dt_limit) != 2:
            raise ConfigError(f"dt_limit must be (low, high), got {self.dt_limit!r}")
        object.__setattr__(self, "dt_limit", tuple(float(v) for v in self.dt_limit))
        if self.d_inner % self.head_dim:
            raise ConfigError(
                f"d_inner = expand * d_model = {self.d_inner} is not a multiple of head_dim = {self.head_dim}"
            )
        if self.n_heads % self.n_groups:
            raise ConfigError(f"n_heads = {self.n_heads} is not a multiple of n_groups = {self.n_groups}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def d_in_proj(self) -> int:
        """mamba_ssm's in_proj output: z, xBC, dt (here two matrices, z_proj and xbcdt_proj)."""
        return self.d_inner + self.d_xbcdt

    @property
    def d_xbcdt(self) -> int:
        """xbcdt_proj's output: x, B, C (the conv's channels), then dt."""
        return self.conv_dim + self.n_heads

    @property
    def hidden_size(self) -> int:
        """Embedding dimension."""
        return self.d_model

    def to_dict(self) -> dict[str, Any]:
        out = {"architecture": self.architecture, **dataclasses.asdict(self)}
        out["dt_limit"] = list(self.dt_limit)
        return out


Config = Mamba2Config


class State(NamedTuple):
    conv: jax.Array  # [b, k-1, conv_dim] float32
    ssm: jax.Array | None  # [b, h, p, n] float32; None: zero and dropped (`fresh_state`)


def param_shapes(cfg: Mamba2Config) -> dict:
    """Shape of every parameter (without the layer axis for layer params); the converter checks against it."""
    layer = {
        "norm": (cfg.d_model,),
        "z_proj": (cfg.d_model, cfg.d_inner),
        "xbcdt_proj": (cfg.d_model, cfg.d_xbcdt),
        "conv_weight": (cfg.d_conv, cfg.conv_dim),
        "dt_bias": (cfg.n_heads,),
        "A_log": (cfg.n_heads,),
        "D": (cfg.n_heads, cfg.head_dim) if cfg.d_has_hdim else (cfg.n_heads,),
        "mixer_norm": (cfg.d_inner,),
        "out_proj": (cfg.d_inner, cfg.d_model),
    }
    if cfg.use_bias:
        layer["z_proj_bias"] = (cfg.d_inner,)
        layer["xbcdt_proj_bias"] = (cfg.d_xbcdt,)
        layer["out_proj_bias"] = (cfg.d_model,)
    if cfg.use_conv_bias:
        layer["conv_bias"] = (cfg.conv_dim,)
    shapes = {
        "embedding": (cfg.vocab_size, cfg.d_model),
        "layers": {k: (cfg.n_layers, *v) for k, v in layer.items()},
        "norm_f": (cfg.d_model,),
    }
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.d_model)
    return shapes


# Decay and skip parameters stay float32 when the rest of the model is cast to bfloat16.
FLOAT32_PARAMS = ("dt_bias", "A_log", "D")

VERTICAL = True  # a constant-size state per layer: vertically chunked inference applies
STATES_IN_PLACE = ("ssm",)  # the SSM state: the SSD kernel reads and writes it in its stack


# Layer matrices used as x @ W [d_in, d_out]: the "all linear layers" that LoRA adapts and NF4 quantises.
# mamba_ssm's in_proj is two of them here: z is computed after the SSD kernel, so it is never live
# beside the kernel's input and output (`mixer`).
LINEAR_PARAMS = ("z_proj", "xbcdt_proj", "out_proj")
FUSED_PARAMS = {"in_proj": ("z_proj", "xbcdt_proj")}  # `lora.targets: [in_proj]` means both


def init_params(cfg: Mamba2Config, key: jax.Array, dtype=F32, *, A_init_range=(1.0, 16.0), dt_min=0.001,
                dt_max=0.1, dt_init_floor=1e-4, D_init=1.0) -> dict:
    """Random parameters with mamba_ssm's initialisation ranges (for tests, benchmarks and training from scratch).

    The keyword ranges are mamba_ssm's Mamba2 arguments (A ~ U(A_init_range), dt log-uniform in
    [dt_min, dt_max]). Its defaults suit language modelling; for contrastive training from scratch,
    A_init_range (0.01, 1) gives heads that remember the whole text at init, so the EOS embedding
    is not a function of the last few tokens alone (docs/training.md, "Mamba2 from scratch").
    """
    check_init_range("A_init_range", A_init_range)
    check_init_range("dt_min, dt_max", (dt_min, dt_max))
    shapes = param_shapes(cfg)
    keys = iter(jax.random.split(key, 16))
    L, h = cfg.n_layers, cfg.n_heads

    def normal(shape, scale):
        return (scale * jax.random.normal(next(keys), shape, F32)).astype(dtype)

    dt = jnp.exp(
        jax.random.uniform(next(keys), (L, h), F32) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
    ).clip(dt_init_floor)
    # drawn as mamba_ssm's one in_proj and split, so a seed gives the model it gave before the split
    in_proj = normal((L, cfg.d_model, cfg.d_in_proj), cfg.d_model**-0.5)
    layers = {
        "norm": jnp.ones(shapes["layers"]["norm"], dtype),
        "z_proj": in_proj[..., :cfg.d_inner],
        "xbcdt_proj": in_proj[..., cfg.d_inner:],
        "conv_weight": normal(shapes["layers"]["conv_weight"], cfg.d_conv**-0.5),
        "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),  # inverse softplus
        "A_log": jnp.log(jax.random.uniform(next(keys), (L, h), F32, *map(float, A_init_range))),
        "D": jnp.full(shapes["layers"]["D"], float(D_init), F32),
        "mixer_norm": jnp.ones(shapes["layers"]["mixer_norm"], dtype),
        "out_proj": normal(shapes["layers"]["out_proj"], (cfg.d_inner * cfg.n_layers) ** -0.5),
    }
    for name in ("z_proj_bias", "xbcdt_proj_bias", "out_proj_bias", "conv_bias"):
        if name in shapes["layers"]:
            layers[name] = jnp.zeros(shapes["layers"][name], dtype)
    params = {
        "embedding": normal(shapes["embedding"], 0.02),
        "layers": layers,
        "norm_f": jnp.ones(shapes["norm_f"], dtype),
    }
    if "lm_head" in shapes:
        params["lm_head"] = normal(shapes["lm_head"], cfg.d_model**-0.5)
    return params


def check_init_range(name: str, bounds) -> None:
    low, high = (float(v) for v in bounds)
    if not 0 < low <= high:
        raise ConfigError(f"{name} must be 0 < low <= high, got {tuple(bounds)}")


def init_state(cfg: Mamba2Config, batch: int) -> State:
    """Zero state of one layer; the scheduler stacks it over layers."""
    return State(
        conv=jnp.zeros((batch, cfg.d_conv - 1, cfg.conv_dim), F32),
        ssm=jnp.zeros((batch, cfg.n_heads, cfg.head_dim, cfg.d_state), F32),
    )


def fresh_state(cfg: Mamba2Config, batch: int) -> State:
    """The state of a layer that starts from zero and whose new state is dropped (the scheduler's
    horizontal pass, training): ssm None, so the SSD kernel neither reads a zero state nor writes
    a final one (f32 [b, h, p, n] each way, a layer's largest state)."""
    return State(conv=jnp.zeros((batch, cfg.d_conv - 1, cfg.conv_dim), F32), ssm=None)


def gated_norm_project(y, z, weight, w_out, b_out, *, eps, group_size, norm_dtype, out_dtype, backend="xla"):
    """linear(gated_rms_norm(y, z, weight) in norm_dtype, w_out, b_out) in out_dtype: the mixer's
    tail, with one backward written out for both (w_out may be a LoRA/NF4 weight; a LoRA adapter's
    GEMM input [n | s n A] is written by the norm, `weights.normed_input`, with `backend`'s kernel;
    without an adapter and outside autodiff the norm's kernel writes n over y).

    Autodiff of the norm gave XLA one float32 y ∘ silu(z) shared by the norm's reduction and its
    elementwise pass, which it wrote to memory and read back twice. And with the norm and out_proj
    apart, out_proj's backward needed the norm's output, which a rematerialised step recomputed in
    the forward from other copies of y and z than the norm's backward read (XLA read both). Here
    the backward computes the norm's output in the pass that writes dy and dz
    (`kernels.gated_norm_backward`: on the GPU one Pallas pass that reads y, z and the norm
    output's cotangent once; XLA's form reads them once for the two per-group sums and once more
    for the elementwise pass)."""
    return _gated_norm_project(y, z, weight, w_out, b_out, float(eps), int(group_size), jnp.dtype(norm_dtype),
                               jnp.dtype(out_dtype), backend)


def _norm_then_project(y, z, weight, w_out, b_out, eps, group_size, norm_dtype, out_dtype, backend, *, in_place):
    if in_place and norm_dtype == y.dtype and getattr(w_out, "adapter", None) is None:
        # n over y (nothing else reads y outside autodiff): n is not a third [t, e] buffer beside y
        # and z, 10 of a Codestral layer's 76 KB of temporaries a token
        n = kernels.normed_in_place(y, weight, z, backend=backend, eps=eps, group_size=group_size)
    else:
        n = weights.normed_input(y, weight, (w_out,), gate=z, group_size=group_size, eps=eps, out_dtype=norm_dtype,
                                 backend=backend)
    return weights.linear(n, w_out, bias=b_out, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _gated_norm_project(y, z, weight, w_out, b_out, eps, group_size, norm_dtype, out_dtype, backend):
    return _norm_then_project(y, z, weight, w_out, b_out, eps, group_size, norm_dtype, out_dtype, backend,
                              in_place=True)


def _gated_norm_project_fwd(y, z, weight, w_out, b_out, eps, group_size, norm_dtype, out_dtype, backend):
    # y is kept for the backward, so the norm does not write over it
    out = _norm_then_project(y, z, weight, w_out, b_out, eps, group_size, norm_dtype, out_dtype, backend,
                             in_place=False)
    return out, (y, z, weight, w_out, b_out)  # inputs only: a rematerialised step recomputes nothing here


def _gated_norm_project_bwd(eps, group_size, norm_dtype, out_dtype, backend, residuals, d_out):
    y, z, weight, w_out, b_out = residuals

    def project(n, w, b):
        return weights.linear(n, w, bias=b, out_dtype=out_dtype)

    # linear in n: n's cotangent does not need n's value (zeros here; the GEMM on them is dropped)
    dn = jax.vjp(lambda n: project(n, w_out, b_out), jnp.zeros(y.shape, norm_dtype))[1](d_out)[0]
    # dy, dz, n and 1/rms in one pass over y, z and dn (`backend`'s kernel)
    dy, dz, n, inv_rms = kernels.gated_norm_backward(y, z, dn, weight, eps=eps, group_size=group_size,
                                                     norm_dtype=norm_dtype, backend=backend)
    # the norm's weight: sum over tokens of dn ∘ g / rms, a pass that XLA drops when the weight is
    # frozen (LoRA)
    g = gated_norm_terms(y, z, None, weight, group_size)[3]
    normed = g * inv_rms[..., None]
    dweight = jnp.sum(dn.astype(F32).reshape(g.shape) * normed, axis=tuple(range(y.ndim - 1))).reshape(weight.shape)
    dweight = dweight.astype(weight.dtype)
    dw, db = jax.vjp(lambda w, b: project(n, w, b), w_out, b_out)[1](d_out)
    return dy, dz, dweight, dw, db


_gated_norm_project.defvjp(_gated_norm_project_fwd, _gated_norm_project_bwd)


def _linear(x, w, b=None, out_dtype=F32):
    """x @ w (+ b) with the operands in x's dtype, accumulated in float32, out in out_dtype; w may be
    a LoRA/NF4 weight, x a `weights.StackedInput`."""
    return weights.linear(x, w, bias=b, out_dtype=out_dtype)


def mixer(cfg: Mamba2Config, p: dict, u, state: State, *, runtime: Runtime, out_dtype=None):
    """The Mamba2 mixer on normalised input u [b, t, d] (a `weights.StackedInput` when in_proj has a
    LoRA adapter: [u | s u A], read by both of its GEMMs). Returns (out [b, t, d] in out_dtype, default
    u's dtype, new state). `layer` asks for the residual's dtype: out_proj then writes what the
    residual add needs, and the add becomes the GEMM's epilogue (cuBLAS beta=1), not a pass of its own.

    Activations between the ops are in u's dtype, as in mamba_ssm's bfloat16 modules (the
    projections, the conv and the SSD output are bfloat16 there too); every op computes in
    float32 inside, and decays, segment sums and states are float32 throughout.
    """
    b, t, _ = u.shape
    e, h = cfg.d_inner, cfg.n_heads
    xbcdt = _linear(u, p["xbcdt_proj"], p.get("xbcdt_proj_bias"), out_dtype=u.dtype)
    # conv + SiLU + SSD straight from the projection: the Pallas kernel reads x, convolves it per
    # chunk and reads B and C (convolved by XLA) as column blocks, so no conv output of x is written
    y, conv_state, ssm_state = kernels.ssd_conv_chunked(
        xbcdt, -jnp.exp(p["A_log"].astype(F32)), state.conv, p["conv_weight"], p.get("conv_bias"),
        offset=0, heads=h, head_dim=cfg.head_dim, groups=cfg.n_groups, state_size=cfg.d_state,
        chunk_size=runtime.chunk_size, backend=runtime.kernels, D=p["D"], dt_bias=p["dt_bias"], dt_limit=cfg.dt_limit,
        initial_state=state.ssm, final_state=state.ssm is not None,
    )
    # z once y is there (the barrier orders it): z [t, e] is then never live beside the kernel's
    # input and output (16 KB a token at Codestral's shapes). The new conv state passes the barrier
    # too: sliced out of the projection here, it does not keep the whole projection alive to the end
    # of a vertical chunk's layer, where XLA writes it into the state stack (14 KB a token)
    y, u, conv_state = jax.lax.optimization_barrier((y.reshape(b, t, e), u, conv_state))
    z = _linear(u, p["z_proj"], p.get("z_proj_bias"), out_dtype=u.dtype)
    out = gated_norm_project(y, z, p["mixer_norm"], p["out_proj"], p.get("out_proj_bias"), eps=cfg.norm_eps,
                             group_size=e // cfg.n_groups, norm_dtype=u.dtype, out_dtype=out_dtype or u.dtype,
                             backend=runtime.kernels)
    return out, State(conv_state, ssm_state)


def layer(cfg: Mamba2Config, p: dict, x, state: State, *, runtime: Runtime, index=None):
    """One residual block: x + mixer(norm(x)). x [b, t, d] is the residual stream."""
    dtype = p["xbcdt_proj"].dtype
    # in_proj's input; with a LoRA adapter [u | s u A], written by the norm (`weights.normed_input`)
    u = weights.normed_input(x, p["norm"], (p["z_proj"], p["xbcdt_proj"]), eps=cfg.norm_eps, out_dtype=dtype,
                             backend=runtime.kernels)
    residual_dtype = F32 if cfg.residual_in_fp32 else dtype
    out, state = mixer(cfg, p, u, state, runtime=runtime, out_dtype=residual_dtype)
    return (x.astype(residual_dtype) + out.astype(residual_dtype)).astype(residual_dtype), state


def embed_tokens(cfg: Mamba2Config, params: dict, ids):
    """ids [b, t] -> residual stream [b, t, d]."""
    x = jnp.take(params["embedding"], ids, axis=0)
    return x.astype(F32) if cfg.residual_in_fp32 else x


def hidden(stream):
    """The stream is the residual [b, t, d] itself."""
    return stream


def final_norm(cfg: Mamba2Config, params: dict, x):
    """Final RMSNorm of the residual stream (float32 out)."""
    return rms_norm(x, params["norm_f"], cfg.norm_eps)


def logits(cfg: Mamba2Config, params: dict, hidden):
    """Language-model head, tied to the embedding or not. hidden [..., d] -> [..., vocab]."""
    return weights.lm_head(hidden, params["embedding"] if cfg.tie_embeddings else params["lm_head"])
