"""Mistral and Qwen2 checkpoints (transformers `MistralModel` / `Qwen2Model` and their CausalLM
wrappers, `save_pretrained` layout): config.json with model_type "mistral" or "qwen2"."""

from __future__ import annotations

import math
from pathlib import Path

from jaxembed.convert.core import TRANSPOSE, ExportLayout, Rule
from jaxembed.convert.sources import ConversionError, read_json
from jaxembed.models.transformer import TransformerConfig

EXPECTS = "Mistral / Qwen2: a transformers config.json (model_type mistral or qwen2)"
MODEL_TYPES = ("mistral", "qwen2")

LAYER = "layers.{i}."
RULES = [
    Rule("embedding", "embed_tokens.weight"),
    Rule("norm_f", "norm.weight"),
    Rule("lm_head", "lm_head.weight", optional=True),
    Rule("layers/attn_norm", LAYER + "input_layernorm.weight"),
    Rule("layers/wq", LAYER + "self_attn.q_proj.weight", TRANSPOSE),
    Rule("layers/wk", LAYER + "self_attn.k_proj.weight", TRANSPOSE),
    Rule("layers/wv", LAYER + "self_attn.v_proj.weight", TRANSPOSE),
    Rule("layers/bq", LAYER + "self_attn.q_proj.bias"),
    Rule("layers/bk", LAYER + "self_attn.k_proj.bias"),
    Rule("layers/bv", LAYER + "self_attn.v_proj.bias"),
    Rule("layers/wo", LAYER + "self_attn.o_proj.weight", TRANSPOSE),
    Rule("layers/mlp_norm", LAYER + "post_attention_layernorm.weight"),
    Rule("layers/w_gate", LAYER + "mlp.gate_proj.weight", TRANSPOSE),
    Rule("layers/w_up", LAYER + "mlp.up_proj.weight", TRANSPOSE),
    Rule("layers/w_down", LAYER + "mlp.down_proj.weight", TRANSPOSE),
]
RENAMES = [(r"^model\.", "")]


def rules_for(cfg: TransformerConfig) -> list[Rule]:
    return RULES if cfg.qkv_bias else [r for r in RULES if not r.path.startswith("layers/b")]


def ignored_keys(cfg: TransformerConfig) -> list[str]:
    return ["lm_head.weight"] if cfg.tie_embeddings else []


def detect(directory: Path):
    config_json = directory / "config.json"
    if not config_json.exists():
        return None
    raw = read_json(config_json)
    if not isinstance(raw, dict) or raw.get("model_type") not in MODEL_TYPES:
        return None
    return "transformers", _config(raw, str(config_json)), ()


def _config(raw: dict, origin: str) -> TransformerConfig:
    model_type = raw["model_type"]
    try:
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' "swish" is SiLU
            raise ConversionError(f"{origin}: hidden_act={raw['hidden_act']!r}; only SiLU (SwiGLU) is supported")
        # transformers takes a (legacy) rope_scaling over rope_parameters when a config holds both
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConversionError(
                f"{origin}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported"
            )
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise ConversionError(f"{origin}: rope_theta must be a positive number, got {theta!r}")
        window = _window(raw, origin)
        eos = raw.get("eos_token_id")
        return TransformerConfig(
            vocab_size=raw["vocab_size"], d_model=raw["hidden_size"], n_layers=raw["num_hidden_layers"],
            n_heads=raw["num_attention_heads"], n_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            d_ff=raw["intermediate_size"], head_dim=raw.get("head_dim"), rope_theta=float(theta),
            sliding_window=window, qkv_bias=model_type == "qwen2", norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=eos[0] if isinstance(eos, list) else eos, pad_token_id=raw.get("pad_token_id"),
        )
    except KeyError as err:
        raise ConversionError(f"{origin}: not a valid {model_type} config (missing field {err})") from None


def _window(raw: dict, origin: str):
    """The sliding window as transformers reads the config. Its size: `sliding_window`, 4096 when the key is
    absent (transformers' default; null is none). Which layers slide: for Qwen2, those whose `layer_types` entry
    says so, or without `layer_types` those from `max_window_layers` on (28 by default), and only with
    `use_sliding_window`; for Mistral every layer, except that a config with `layer_types` is read by
    transformers as Ministral, whose entries decide. One window for every layer or for none is supported."""
    n = raw["num_hidden_layers"]
    window = raw.get("sliding_window", 4096)
    if raw["model_type"] == "qwen2":
        window = window if raw.get("use_sliding_window", False) else None
        first_sliding = raw.get("max_window_layers", 28)
        default = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(n)]
        named_by = "layer_types" if raw.get("layer_types") else f"max_window_layers={first_sliding}"
    else:
        default, named_by = ["sliding_attention"] * n, "layer_types (read by transformers as Ministral)"
    types = raw.get("layer_types") or default
    if len(types) != n:
        raise ConversionError(f"{origin}: layer_types has {len(types)} entries for {n} layers")
    sliding = sum(t == "sliding_attention" for t in types) if window is not None else 0
    if sliding == 0:
        return None
    if sliding < n:
        raise ConversionError(f"{origin}: {raw['model_type']} with a sliding window on {sliding} of its {n} layers "
                              f"(from {named_by}) is not supported; a window on every layer or on none is")
    return window


def export_layout(cfg: TransformerConfig, *, lm_head: bool, dtype: str) -> ExportLayout:
    """transformers' layout: Qwen2 when q/k/v have biases, else Mistral; the CausalLM class (model. prefix)
    when there is an lm_head to keep."""
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.d_ff,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )
    if cfg.qkv_bias:  # a window on every layer: max_window_layers 0
        hf = transformers.Qwen2Config(**common, use_sliding_window=cfg.sliding_window is not None,
                                      sliding_window=cfg.sliding_window, max_window_layers=0)
    else:
        hf = transformers.MistralConfig(**common, sliding_window=cfg.sliding_window)
    family = "Qwen2" if cfg.qkv_bias else "Mistral"
    hf.architectures = [f"{family}ForCausalLM" if lm_head else f"{family}Model"]
    hf.dtype = dtype

    def key(normal: str) -> str:
        return normal if not lm_head or normal == "lm_head.weight" else "model." + normal

    return ExportLayout(f"transformers {hf.architectures[0]}", rules_for(cfg), key, hf.save_pretrained)


def reference(checkpoint):
    """transformers' MistralModel / Qwen2Model (float32, eager attention) on the source tensors."""
    import transformers

    from jaxembed.convert.verify import transformers_reference

    raw = read_json(checkpoint.directory / "config.json")
    cls = transformers.MistralModel if raw["model_type"] == "mistral" else transformers.Qwen2Model
    hf_config = transformers.AutoConfig.for_model(**raw)
    hf_config._attn_implementation = "eager"
    model = cls(hf_config).float().eval()
    return transformers_reference(model, checkpoint, r"^model\.")
