"""Mamba2 checkpoints: three source layouts, one name table.

Layouts (all share the mixer's parameter names; only prefixes and config files differ):

* transformers `Mamba2Model` / `Mamba2ForCausalLM` (`save_pretrained`): config.json with
  model_type "mamba2"; keys `[backbone.]embeddings.weight`, `[backbone.]layers.{i}.mixer.*`.
* mamba_ssm (state-spaces/mamba2-*): config.json with d_model, n_layer, ssm_cfg,
  pad_vocab_size_multiple; keys `backbone.embedding.weight`, ...; every field ssm_cfg leaves
  out takes mamba_ssm's default.
* Codestral Mamba in mistral_inference form: params.json (dim, n_layers, n_groups, ...) and
  consolidated.safetensors, keys `model.backbone.*`; otherwise mamba_ssm defaults.
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxembed.config import Mamba2Config
from jaxembed.convert.core import CONV1D_DEPTHWISE, TRANSPOSE, ExportLayout, Hook, Rule, fused_rows
from jaxembed.convert.sources import ConversionError, read_json

EXPECTS = ("Mamba2: a transformers config.json (model_type mamba2), a mamba_ssm config.json "
           "(d_model, n_layer, ssm_cfg) or a Codestral params.json")

LAYER = "layers.{i}."
MIXER = LAYER + "mixer."

RULES = [
    Rule("embedding", "embedding.weight"),
    Rule("norm_f", "norm_f.weight"),
    Rule("lm_head", "lm_head.weight", optional=True),  # embedders never use it; kept when untied
    Rule("layers/norm", LAYER + "norm.weight"),
    Rule("layers/conv_weight", MIXER + "conv1d.weight", CONV1D_DEPTHWISE),
    Rule("layers/conv_bias", MIXER + "conv1d.bias"),
    Rule("layers/dt_bias", MIXER + "dt_bias"),
    Rule("layers/A_log", MIXER + "A_log"),
    Rule("layers/D", MIXER + "D"),  # D_has_hdim checkpoints are reshaped by the hook below
    Rule("layers/mixer_norm", MIXER + "norm.weight"),
    Rule("layers/out_proj", MIXER + "out_proj.weight", TRANSPOSE),
    Rule("layers/out_proj_bias", MIXER + "out_proj.bias"),
]

# model. (mistral_inference wrapper) and backbone. (CausalLM) prefixes; transformers says "embeddings"
RENAMES = [(r"^model\.", ""), (r"^backbone\.", ""), (r"^embeddings\.", "embedding.")]


def _in_proj_rules(cfg: Mamba2Config) -> list[Rule]:
    """mamba_ssm's in_proj [z; x, B, C, dt] as our two matrices, z_proj and xbcdt_proj."""
    total = cfg.d_in_proj
    return [
        Rule(f"layers/{name}{suffix}", MIXER + "in_proj." + key,
             fused_rows("in_proj", name, start, size, total, weight=key == "weight"))
        for name, start, size in (("z_proj", 0, cfg.d_inner), ("xbcdt_proj", cfg.d_inner, cfg.d_xbcdt))
        for suffix, key in (("", "weight"), ("_bias", "bias"))
    ]


def rules_for(cfg: Mamba2Config) -> list[Rule]:
    rules = RULES + _in_proj_rules(cfg)
    if not cfg.d_has_hdim:
        return rules
    d_by_head = Hook(
        "D_by_head",
        lambda s: (cfg.n_heads, cfg.head_dim) if s == (cfg.d_inner,) else s,
        lambda a: a.reshape(cfg.n_heads, cfg.head_dim),
        lambda a: a.reshape(cfg.d_inner),
    )
    return [Rule(r.path, r.key, d_by_head) if r.path == "layers/D" else r for r in rules]


def ignored_keys(cfg: Mamba2Config) -> list[str]:
    # A tied lm_head is saved as a second copy of the embedding by mamba_ssm; nothing else is skipped.
    return ["lm_head.weight"] if cfg.tie_embeddings else []


# ---- config readers ---------------------------------------------------------------------

# mamba_ssm.models.config_mamba.MambaConfig and mamba_ssm.modules.mamba2.Mamba2 defaults
MAMBA_SSM_DEFAULTS = dict(
    d_intermediate=0, vocab_size=50277, ssm_cfg={}, attn_layer_idx=[], rms_norm=True, residual_in_fp32=True,
    pad_vocab_size_multiple=8, tie_embeddings=True,
)
MAMBA2_BLOCK_DEFAULTS = dict(
    d_state=128, d_conv=4, expand=2, headdim=64, d_ssm=None, ngroups=1, D_has_hdim=False, rmsnorm=True,
    norm_before_gate=False, dt_limit=(0.0, math.inf), bias=False, conv_bias=True, chunk_size=256,
)


def _mamba_ssm_config(raw: dict, origin: str) -> Mamba2Config:
    c = {**MAMBA_SSM_DEFAULTS, **raw}
    ssm = {**MAMBA2_BLOCK_DEFAULTS, **(c.get("ssm_cfg") or {})}
    layer = ssm.pop("layer", "Mamba1")
    problems = []
    if layer != "Mamba2":
        problems.append(f"ssm_cfg.layer is {layer!r}; only Mamba2 layers are supported")
    if c["d_intermediate"]:
        problems.append(f"d_intermediate={c['d_intermediate']} (an MLP after each mixer) is not supported")
    if c["attn_layer_idx"]:
        problems.append(f"hybrid attention layers {c['attn_layer_idx']} are not supported")
    if not c["rms_norm"]:
        problems.append("rms_norm=false (LayerNorm blocks) is not supported")
    if not ssm["rmsnorm"] or ssm["norm_before_gate"]:
        problems.append("only the gated RMSNorm with norm_before_gate=false is supported")
    d_inner = ssm["expand"] * c["d_model"]
    if ssm["d_ssm"] not in (None, d_inner):
        problems.append(f"d_ssm={ssm['d_ssm']} != d_inner={d_inner} (partial SSM with an MLP) is not supported")
    if problems:
        raise ConversionError(f"{origin}: unsupported Mamba2 variant: " + "; ".join(problems))
    vocab, multiple = c["vocab_size"], c["pad_vocab_size_multiple"]
    vocab += -vocab % multiple
    return Mamba2Config(
        vocab_size=vocab, d_model=c["d_model"], n_layers=c["n_layer"], d_state=ssm["d_state"], d_conv=ssm["d_conv"],
        expand=ssm["expand"], head_dim=ssm["headdim"], n_groups=ssm["ngroups"], chunk_size=ssm["chunk_size"],
        norm_eps=1e-5, dt_limit=tuple(ssm["dt_limit"]), use_bias=ssm["bias"], use_conv_bias=ssm["conv_bias"],
        residual_in_fp32=c["residual_in_fp32"], tie_embeddings=c["tie_embeddings"], d_has_hdim=ssm["D_has_hdim"],
    )


def _transformers_config(path: Path) -> Mamba2Config:
    from transformers import Mamba2Config as HFMamba2Config

    origin = str(path)
    try:  # from_json_file also decodes transformers' encoding of inf in time_step_limit
        hf = HFMamba2Config.from_json_file(path)
    except Exception as err:
        raise ConversionError(f"{origin}: invalid transformers Mamba2 config ({err})") from None
    if hf.hidden_act != "silu":
        raise ConversionError(f"{origin}: hidden_act={hf.hidden_act!r}; only Mamba2 with SiLU is supported")
    if hf.hidden_size * hf.expand != hf.num_heads * hf.head_dim:
        raise ConversionError(
            f"{origin}: hidden_size*expand={hf.hidden_size * hf.expand} "
            f"!= num_heads*head_dim={hf.num_heads * hf.head_dim}"
        )
    eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
    return Mamba2Config(
        vocab_size=hf.vocab_size, d_model=hf.hidden_size, n_layers=hf.num_hidden_layers, d_state=hf.state_size,
        d_conv=hf.conv_kernel, expand=hf.expand, head_dim=hf.head_dim, n_groups=hf.n_groups, chunk_size=hf.chunk_size,
        norm_eps=hf.layer_norm_epsilon, dt_limit=tuple(hf.time_step_limit), use_bias=hf.use_bias,
        use_conv_bias=hf.use_conv_bias, residual_in_fp32=hf.residual_in_fp32, tie_embeddings=hf.tie_word_embeddings,
        eos_token_id=eos, pad_token_id=hf.pad_token_id,
    )


def _codestral_config(raw: dict, origin: str) -> Mamba2Config:
    required = ["dim", "n_layers", "vocab_size", "n_groups"]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConversionError(f"{origin}: missing fields {missing}")
    as_mamba_ssm = {
        "d_model": raw["dim"], "n_layer": raw["n_layers"], "vocab_size": raw["vocab_size"],
        "ssm_cfg": {"ngroups": raw["n_groups"], "layer": "Mamba2"},
        **{k: raw[k] for k in ("rms_norm", "residual_in_fp32", "pad_vocab_size_multiple", "tie_embeddings")
           if k in raw},
    }
    return _mamba_ssm_config(as_mamba_ssm, origin)


def detect(directory: Path) -> tuple[str, Mamba2Config, tuple[str, ...]] | None:
    """(layout name, config, preferred weight files) if `directory` holds a Mamba2 checkpoint we know."""
    config_json, params_json = directory / "config.json", directory / "params.json"
    try:
        return _detect(config_json, params_json)
    except ConversionError:
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as err:
        origin = config_json if config_json.exists() else params_json
        detail = f"missing field {err}" if isinstance(err, KeyError) else str(err)
        raise ConversionError(f"{origin}: not a valid Mamba2 config ({type(err).__name__}: {detail})") from None


def _detect(config_json: Path, params_json: Path):
    if config_json.exists():
        raw = read_json(config_json)
        if not isinstance(raw, dict):
            raise ConversionError(f"{config_json}: expected a JSON object")
        if raw.get("model_type") == "mamba2":
            return "transformers", _transformers_config(config_json), ()
        if "d_model" in raw and ("ssm_cfg" in raw or "n_layer" in raw):
            return "mamba_ssm", _mamba_ssm_config(raw, str(config_json)), ("pytorch_model.bin", "model.safetensors")
    if params_json.exists():
        raw = read_json(params_json)
        if isinstance(raw, dict) and "dim" in raw and raw.get("model_type", "mamba") == "mamba":
            return "codestral", _codestral_config(raw, str(params_json)), ("consolidated.safetensors",)
    return None


def to_transformers_config(cfg: Mamba2Config):
    """The equivalent transformers Mamba2Config (for `--verify`, `jaxembed export` and tests)."""
    from transformers import Mamba2Config as HFMamba2Config

    if cfg.d_has_hdim:
        raise ConversionError("transformers' Mamba2 has no per-channel D (D_has_hdim); cannot build a reference")
    return HFMamba2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, state_size=cfg.d_state,
        conv_kernel=cfg.d_conv, expand=cfg.expand, head_dim=cfg.head_dim, num_heads=cfg.n_heads, n_groups=cfg.n_groups,
        chunk_size=cfg.chunk_size, layer_norm_epsilon=cfg.norm_eps, time_step_limit=tuple(cfg.dt_limit),
        use_bias=cfg.use_bias, use_conv_bias=cfg.use_conv_bias, residual_in_fp32=cfg.residual_in_fp32,
        tie_word_embeddings=cfg.tie_embeddings, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )


def export_layout(cfg: Mamba2Config, *, lm_head: bool, dtype: str) -> ExportLayout:
    """transformers' layout: Mamba2ForCausalLM (backbone. prefix) when there is an lm_head to keep, else
    Mamba2Model (a tied head is transformers' tie_word_embeddings)."""
    hf = to_transformers_config(cfg)  # raises for D_has_hdim, which transformers has no place for
    hf.architectures = ["Mamba2ForCausalLM" if lm_head else "Mamba2Model"]
    hf.dtype = dtype

    def key(normal: str) -> str:
        name = "embeddings.weight" if normal == "embedding.weight" else normal
        return name if not lm_head or name == "lm_head.weight" else "backbone." + name

    return ExportLayout(f"transformers {hf.architectures[0]}", rules_for(cfg), key, hf.save_pretrained)



def reference(checkpoint):
    """transformers' Mamba2Model (float32) on the source tensors: ids [1, n] -> last-token final-norm output."""
    from transformers import Mamba2Model

    from jaxembed.convert.verify import transformers_reference

    model = Mamba2Model(to_transformers_config(checkpoint.config)).float().eval()
    return transformers_reference(model, checkpoint, r"^(model\.)?(backbone\.)?")
