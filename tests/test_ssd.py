"""The three SSD forms against a float64 NumPy transcription of the paper's recurrence (eq. 1)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from jaxembed.ops import ssd


def reference(x, dt, A, B, C, D, dt_bias, dt_limit, h0):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_tᵀ ; y_t = h_t C_t + D x_t, one head at a time, float64."""
    x, dt, B, C, h0 = (np.asarray(v, np.float64) for v in (x, dt, B, C, h0))
    b, t, h, p = x.shape
    g = B.shape[2]
    dt = np.log1p(np.exp(dt + dt_bias))
    dt = np.clip(dt, *dt_limit)
    state, ys = h0.copy(), np.zeros_like(x)
    for i in range(t):
        for head in range(h):
            grp = head // (h // g)
            decay = np.exp(dt[:, i, head] * A[head])[:, None, None]
            state[:, head] = decay * state[:, head] + np.einsum("bp,bn->bpn", x[:, i, head] * dt[:, i, head, None],
                                                                B[:, i, grp])
            ys[:, i, head] = np.einsum("bpn,bn->bp", state[:, head], C[:, i, grp])
    Dp = D[:, None] if D.ndim == 1 else D
    return ys + Dp * x, state


def inputs(seed, b=2, t=37, h=4, p=8, g=2, n=16, d_per_channel=False, dt_shift=0.0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(
        x=f(b, t, h, p), dt=f(b, t, h) + dt_shift, A=-np.exp(f(h)), B=f(b, t, g, n), C=f(b, t, g, n),
        D=f(h, p) if d_per_channel else f(h), dt_bias=f(h), h0=f(b, h, p, n),
    )


FORMS = {
    "recurrent": ssd.recurrent,
    "quadratic": ssd.quadratic,
    "chunked_q8": lambda *a, **k: ssd.chunked(*a, chunk_size=8, **k),
    "chunked_q16": lambda *a, **k: ssd.chunked(*a, chunk_size=16, **k),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", [
    dict(seed=0),
    dict(seed=1, t=1),
    dict(seed=2, t=29, g=1, d_per_channel=True),
    dict(seed=3, t=16, g=4, h=4),
])
def test_forms_match_recurrence(form, case):
    v = inputs(**case)
    limit = (0.0, math.inf)
    y, final = FORMS[form](v["x"], v["dt"], v["A"], v["B"], v["C"], D=v["D"], dt_bias=v["dt_bias"], dt_limit=limit,
                           initial_state=v["h0"])
    y_ref, final_ref = reference(v["x"], v["dt"], v["A"], v["B"], v["C"], v["D"], v["dt_bias"], limit, v["h0"])
    assert rel_err(y, y_ref) < TOLERANCE["float32"]
    assert rel_err(final, final_ref) < TOLERANCE["float32"]


def test_dt_limit_and_large_dt_stay_finite():
    """dt up to ~60 with |A| up to ~10 gives log decays of several hundred per step: exp must
    underflow to 0 cleanly (no inf/NaN), and dt_limit must clip."""
    v = inputs(seed=4, t=40, dt_shift=60.0)
    for limit in [(0.0, math.inf), (0.001, 0.5)]:
        y, final = ssd.chunked(v["x"], v["dt"], v["A"], v["B"], v["C"], chunk_size=16, D=v["D"], dt_bias=v["dt_bias"],
                               dt_limit=limit, initial_state=v["h0"])
        y_ref, final_ref = reference(v["x"], v["dt"], v["A"], v["B"], v["C"], v["D"], v["dt_bias"], limit, v["h0"])
        assert np.isfinite(np.asarray(y)).all() and np.isfinite(np.asarray(final)).all()
        assert rel_err(y, y_ref) < TOLERANCE["float32"]
        assert rel_err(final, final_ref) < TOLERANCE["float32"]


def test_bfloat16_inputs_keep_float32_state():
    v = inputs(seed=5, t=33)
    bf = {k: jnp.asarray(v[k], jnp.bfloat16) for k in ("x", "B", "C")}
    y, final = ssd.chunked(bf["x"], v["dt"], v["A"], bf["B"], bf["C"], chunk_size=8, D=v["D"], dt_bias=v["dt_bias"],
                           initial_state=v["h0"])
    assert y.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    y_ref, final_ref = reference(*(np.asarray(bf[k], np.float32) if k in bf else v[k]
                                   for k in ("x", "dt", "A", "B", "C")),
                                 v["D"], v["dt_bias"], (0.0, math.inf), v["h0"])
    assert rel_err(y, y_ref) < TOLERANCE["bfloat16"]
    assert rel_err(final, final_ref) < TOLERANCE["bfloat16"]


def test_chunked_continues_from_its_own_state():
    """Splitting a sequence and carrying the state is the same as one pass (the basis of vertical chunking)."""
    v = inputs(seed=6, t=40)
    kw = dict(chunk_size=8, D=v["D"], dt_bias=v["dt_bias"])
    full, final = ssd.chunked(v["x"], v["dt"], v["A"], v["B"], v["C"], initial_state=v["h0"], **kw)
    part = lambda s, h0: ssd.chunked(v["x"][:, s], v["dt"][:, s], v["A"], v["B"][:, s], v["C"][:, s],
                                     initial_state=h0, **kw)
    y1, h1 = part(slice(0, 24), v["h0"])
    y2, h2 = part(slice(24, 40), h1)
    y_ref, final_ref = reference(v["x"], v["dt"], v["A"], v["B"], v["C"], v["D"], v["dt_bias"], (0.0, math.inf),
                                 v["h0"])
    assert rel_err(np.concatenate([y1, y2], 1), y_ref) < TOLERANCE["float32"]
    assert rel_err(h2, final_ref) < TOLERANCE["float32"]


def test_rejects_misshaped_state():
    v = inputs(seed=7, t=8)
    with pytest.raises(ValueError, match="initial_state has shape"):
        ssd.chunked(v["x"], v["dt"], v["A"], v["B"], v["C"], chunk_size=8, initial_state=np.zeros((1, 2, 3, 4)))
    # A > 0 (a growth, not a decay) gave outputs 9e-2 (XLA) and 4e-1 (kernel) off the recurrence, with no error
    from jaxembed import kernels

    A = np.array(v["A"]).copy()
    A[0] = 0.05
    for op, kw in ((ssd.chunked, {}), (kernels.ssd_chunked, {"backend": "interpret"})):
        with pytest.raises(ValueError, match=r"A must be <= 0 \(a decay rate, -exp\(A_log\)\), got 1 other value"):
            op(v["x"], v["dt"], A, v["B"], v["C"], chunk_size=8, **kw)


@pytest.mark.parametrize("t, has_bias, dtype", [(37, True, "float32"), (2, False, "float32"), (19, True, "bfloat16")])
def test_causal_conv_backward_against_float64(t, has_bias, dtype):
    """`causal_conv` (depthwise causal conv over [conv_state ‖ x], then SiLU) with its written-out
    backward: the output and the cotangents of x, the conv state, the weight and the bias against
    float64 autodiff of the formula written out here, out_t = silu(Σ_i w_i u_{t+i} + bias) with
    u = [conv_state ‖ x]; t = 2 is shorter than the conv state."""
    import jax

    rng = np.random.default_rng(7 + t)
    b, c, k = 2, 6, 4
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.normal(size=(b, t, c)), dt)
    state = jnp.asarray(rng.normal(size=(b, k - 1, c)), jnp.float32)
    weight = jnp.asarray(0.5 * rng.normal(size=(k, c)), jnp.float32)
    bias = jnp.asarray(0.3 * rng.normal(size=(c,)), jnp.float32) if has_bias else None
    d_out = jnp.asarray(rng.normal(size=(b, t, c)), dt)
    d_state = jnp.asarray(rng.normal(size=(b, k - 1, c)), jnp.float32)

    def formula(x, state, weight, bias):
        u = jnp.concatenate([state, x], axis=1)
        pre = sum(u[:, i:i + t] * weight[i] for i in range(k)) + (0.0 if bias is None else bias)
        return pre / (1.0 + jnp.exp(-pre)), u[:, t:]

    out, vjp = jax.vjp(lambda *a: ssd.causal_conv(*a, out_dtype=dt), x, state, weight, bias)
    with jax.enable_x64(True):
        want, want_vjp = jax.vjp(formula, *(None if a is None else np.asarray(a, np.float64)
                                            for a in (x, state, weight, bias)))
        wants = want_vjp(tuple(np.asarray(g, np.float64) for g in (d_out, d_state)))
    tol = TOLERANCE[dtype] if dtype == "bfloat16" else 1e-6
    for got, w in zip(out, want, strict=True):
        assert got.dtype in (dt, jnp.float32) and rel_err(got, np.asarray(w)) < tol
    for name, got, w in zip(("x", "state", "weight", "bias"), vjp((d_out, d_state)), wants, strict=True):
        if w is None:
            assert got is None
            continue
        assert got.dtype == {"x": dt}.get(name, jnp.float32)
        assert rel_err(got, np.asarray(w)) < tol, (name, rel_err(got, np.asarray(w)))
