"""xLSTM checkpoints: transformers' `xLSTMModel` / `xLSTMForCausalLM`, one name table.

transformers documents `xLSTMForCausalLM.from_pretrained("NX-AI/xLSTM-7b")`, so that checkpoint uses these
names too (not checked here: no hub access on the development machines).

config.json with model_type "xlstm"; keys `[backbone.]embeddings.weight`,
`[backbone.]blocks.{i}.{norm_mlstm,mlstm_layer,norm_ffn,ffn}.*`, `[backbone.]out_norm.weight`,
`lm_head.weight`. The config is read as JSON with transformers' xLSTMConfig defaults for absent
fields, not through transformers' class: a checkpoint may name kernels (e.g. the Triton ones of
NX-AI's `xlstm` package) that transformers' strict config rejects when that package is not
installed. Kernel choices, mode, autocast/state dtypes and norm_reduction_force_float32 do not
matter here (jaxembed always reduces norms and runs the mLSTM in float32); add_out_norm=false is
refused. weight_mode "fused" checkpoints store q/k/v/o, the two gates and the FFN's gate/up
projections as fused matrices; named hooks slice them into the separate params.
"""

from __future__ import annotations

from pathlib import Path

from jaxembed.config import ConfigError
from jaxembed.convert.core import TRANSPOSE, ExportLayout, Rule, fused_rows
from jaxembed.convert.sources import ConversionError, read_json
from jaxembed.models.xlstm import XLSTMConfig

EXPECTS = "xLSTM: a transformers config.json (model_type xlstm)"

LAYER = "blocks.{i}."
MLSTM = LAYER + "mlstm_layer."

# xLSTMForCausalLM's backbone. prefix; xlstm_large (NX-AI's own package) says "embedding"
RENAMES = [(r"^backbone\.", ""), (r"^embedding\.", "embeddings.")]

COMMON = [
    Rule("embedding", "embeddings.weight"),
    Rule("norm_f", "out_norm.weight"),
    Rule("lm_head", "lm_head.weight", optional=True),  # embedders never use it; kept when untied
    Rule("layers/norm_mlstm", LAYER + "norm_mlstm.weight"),
    Rule("layers/norm_mlstm_bias", LAYER + "norm_mlstm.bias"),
    Rule("layers/multihead_norm", MLSTM + "multihead_norm.weight"),
    Rule("layers/multihead_norm_bias", MLSTM + "multihead_norm.bias"),
    Rule("layers/out_proj", MLSTM + "out_proj.weight", TRANSPOSE),
    Rule("layers/out_proj_bias", MLSTM + "out_proj.bias"),
    Rule("layers/norm_ffn", LAYER + "norm_ffn.weight"),
    Rule("layers/norm_ffn_bias", LAYER + "norm_ffn.bias"),
    Rule("layers/ffn_down", LAYER + "ffn.proj_down.weight", TRANSPOSE),
    Rule("layers/ffn_down_bias", LAYER + "ffn.proj_down.bias"),
]

# weight_mode "single": one torch Linear per projection
SINGLE = [
    *(rule for name, key in (("q", "q"), ("k", "k"), ("v", "v"), ("ogate", "ogate_preact"),
                             ("igate", "igate_preact"), ("fgate", "fgate_preact"))
      for rule in (Rule(f"layers/{name}", f"{MLSTM}{key}.weight", TRANSPOSE),
                   Rule(f"layers/{name}_bias", f"{MLSTM}{key}.bias"))),
    Rule("layers/ffn_gate", LAYER + "ffn.proj_up_gate.weight", TRANSPOSE),
    Rule("layers/ffn_gate_bias", LAYER + "ffn.proj_up_gate.bias"),
    Rule("layers/ffn_up", LAYER + "ffn.proj_up.weight", TRANSPOSE),
    Rule("layers/ffn_up_bias", LAYER + "ffn.proj_up.bias"),
]


def _fused_rules(cfg: XLSTMConfig) -> list[Rule]:
    """weight_mode "fused": qkv_opreact = [q; k; v; o], ifgate_preact = [i; f], proj_up_gate_z = [gate; up]
    (the row splits of transformers' torch.tensor_split calls)."""
    qk, vd, h, u = cfg.qk_dim, cfg.v_dim, cfg.n_heads, cfg.ffn_dim
    groups = [
        (MLSTM + "qkv_opreact", [("q", 0, qk), ("k", qk, qk), ("v", 2 * qk, vd), ("ogate", 2 * qk + vd, vd)]),
        (MLSTM + "ifgate_preact", [("igate", 0, h), ("fgate", h, h)]),
        (LAYER + "ffn.proj_up_gate_z", [("ffn_gate", 0, u), ("ffn_up", u, u)]),
    ]
    rules = []
    for key, parts in groups:
        total = sum(size for _, _, size in parts)
        fused = key.rsplit(".", 1)[-1]
        for name, start, size in parts:
            for suffix, key_suffix in (("", ".weight"), ("_bias", ".bias")):
                hook = fused_rows(fused, name, start, size, total, weight=key_suffix == ".weight")
                rules.append(Rule(f"layers/{name}{suffix}", key + key_suffix, hook))
    return rules


def rules_for(cfg: XLSTMConfig) -> list[Rule]:
    return COMMON + (SINGLE if cfg.weight_mode == "single" else _fused_rules(cfg))


def ignored_keys(cfg: XLSTMConfig) -> list[str]:
    # checkpoints are read untied (config_from_transformers); a tied jaxembed config has no lm_head to keep
    return ["lm_head.weight"] if cfg.tie_embeddings else []


# ---- config reader ----------------------------------------------------------------------

# transformers' xLSTMConfig defaults (those of NX-AI/xLSTM-7b), for fields a config.json leaves out
TRANSFORMERS_DEFAULTS = {
    "vocab_size": 50304, "hidden_size": 4096, "num_hidden_layers": 32, "num_heads": 8, "use_bias": False,
    "add_out_norm": True, "norm_eps": 1e-6, "qk_dim_factor": 0.5,
    "v_dim_factor": 1.0, "chunk_size": 64, "eps": 1e-6, "ffn_proj_factor": 2.667, "ffn_round_up_to_multiple_of": 64,
    "gate_soft_cap": 15.0, "output_logit_soft_cap": 30.0, "weight_mode": "single", "pad_token_id": 1,
    "eos_token_id": 2,
}


def _either(raw: dict, a: str, b: str, origin: str):
    """transformers accepts two names for the width and the depth (hidden_size/embedding_dim,
    num_hidden_layers/num_blocks); they must agree when both are given."""
    va, vb = raw.get(a), raw.get(b)
    if va is not None and vb is not None and va != vb:
        raise ConversionError(f"{origin}: {a}={va} and {b}={vb} disagree")
    return va if va is not None else vb if vb is not None else TRANSFORMERS_DEFAULTS[a]


def config_from_transformers(raw: dict, origin: str) -> XLSTMConfig:
    """Our config from a transformers xLSTM config.json (as a dict)."""
    c = {**TRANSFORMERS_DEFAULTS, **raw}
    # tie_word_embeddings is not read: transformers' xLSTMForCausalLM declares no tied weights, so its
    # lm_head is its own tensor whatever the flag says (and is kept, or the export's head would be random)
    if not c["add_out_norm"]:
        raise ConversionError(
            f"{origin}: add_out_norm=false is not supported (transformers' xLSTMModel applies out_norm regardless, "
            "NX-AI's xlstm_large skips it; the embedding would depend on which one is meant)"
        )
    eos = c["eos_token_id"][0] if isinstance(c["eos_token_id"], list) else c["eos_token_id"]
    try:
        return XLSTMConfig(
            vocab_size=c["vocab_size"], d_model=_either(raw, "hidden_size", "embedding_dim", origin),
            n_layers=_either(raw, "num_hidden_layers", "num_blocks", origin), n_heads=c["num_heads"],
            qk_dim_factor=c["qk_dim_factor"], v_dim_factor=c["v_dim_factor"], ffn_proj_factor=c["ffn_proj_factor"],
            ffn_round_up_to_multiple_of=c["ffn_round_up_to_multiple_of"], gate_soft_cap=c["gate_soft_cap"],
            output_logit_soft_cap=c["output_logit_soft_cap"], norm_eps=c["norm_eps"], eps=c["eps"],
            use_bias=c["use_bias"], weight_mode=c["weight_mode"], tie_embeddings=False,
            chunk_size=c["chunk_size"], eos_token_id=eos, pad_token_id=c["pad_token_id"],
        )
    except ConfigError as err:
        raise ConversionError(f"{origin}: unsupported xLSTM config: {err}") from None


def detect(directory: Path) -> tuple[str, XLSTMConfig, tuple[str, ...]] | None:
    """(layout name, config, preferred weight files) if `directory` holds a transformers xLSTM checkpoint."""
    config_json = directory / "config.json"
    if not config_json.exists():
        return None
    raw = read_json(config_json)
    if not isinstance(raw, dict) or raw.get("model_type") != "xlstm":
        return None
    try:
        return "transformers", config_from_transformers(raw, str(config_json)), ()
    except ConversionError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ConversionError(f"{config_json}: not a valid xLSTM config ({type(err).__name__}: {err})") from None


def to_transformers_config(cfg: XLSTMConfig):
    """The equivalent transformers xLSTMConfig, set up as the float32 reference: native torch kernels,
    float32 kernel and state dtypes, and "inference" mode (any length in one call: chunkwise kernel on
    the whole chunks, the recurrent sequence kernel on the remainder, the step kernel for one token)."""
    from transformers import xLSTMConfig as HFxLSTMConfig

    return HFxLSTMConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, embedding_dim=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_blocks=cfg.n_layers, num_heads=cfg.n_heads, use_bias=cfg.use_bias, norm_eps=cfg.norm_eps,
        qk_dim_factor=cfg.qk_dim_factor, v_dim_factor=cfg.v_dim_factor, ffn_proj_factor=cfg.ffn_proj_factor,
        ffn_round_up_to_multiple_of=cfg.ffn_round_up_to_multiple_of, gate_soft_cap=cfg.gate_soft_cap,
        output_logit_soft_cap=cfg.output_logit_soft_cap, eps=cfg.eps, weight_mode=cfg.weight_mode,
        tie_word_embeddings=cfg.tie_embeddings, chunk_size=cfg.chunk_size, add_out_norm=True,
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native", step_kernel="native",
        mode="inference", autocast_kernel_dtype="float32", inference_state_dtype="float32", return_last_states=True,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )


def export_layout(cfg: XLSTMConfig, *, lm_head: bool, dtype: str) -> ExportLayout:
    """transformers' layout: xLSTMForCausalLM (backbone. prefix) when there is an lm_head to keep, else
    xLSTMModel. The config is the reference's (native torch kernels, float32 kernel and state dtypes)."""
    hf = to_transformers_config(cfg)
    hf.architectures = ["xLSTMForCausalLM" if lm_head else "xLSTMModel"]
    hf.dtype = dtype
    # transformers sizes its cache with qk_dim and v_dim rounded up to multiples of 64, the layers with the
    # exact int(d * factor): where they differ a call with the cache fails, so the export turns it off
    if (hf.qk_dim, hf.v_dim) != (cfg.qk_dim, cfg.v_dim):
        hf.use_cache = False

    def key(normal: str) -> str:
        return normal if not lm_head or normal == "lm_head.weight" else "backbone." + normal

    # the reference's kernels and float32 dtypes, and the cache off, whatever the source ran with
    owned = ("chunkwise_kernel", "sequence_kernel", "step_kernel", "mode", "autocast_kernel_dtype",
             "inference_state_dtype", "return_last_states", "use_cache")
    return ExportLayout(f"transformers {hf.architectures[0]}", rules_for(cfg), key, hf.save_pretrained, owned)


def build_transformers_model(cfg: XLSTMConfig):
    """An xLSTMModel for `cfg` without running transformers' weight init (its fused-mode init fails on
    mismatched bias shapes, and every parameter is overwritten anyway)."""
    from transformers import xLSTMModel
    from transformers.initialization import no_init_weights

    with no_init_weights():
        return xLSTMModel(to_transformers_config(cfg)).float().eval()


def reference(checkpoint):
    """transformers' xLSTMModel (float32, native torch kernels) on the source tensors:
    ids [1, n] -> final-norm (out_norm) output at the last token."""
    from jaxembed.convert.verify import transformers_reference

    # no cache: transformers sizes its cache with the config's rounded-up qk_dim, which differs
    # from the layer's int(d_model * qk_dim_factor) unless that is a multiple of 64
    return transformers_reference(build_transformers_model(checkpoint.config), checkpoint, r"^backbone\.",
                                  use_cache=False)
