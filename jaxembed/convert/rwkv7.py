"""RWKV7 checkpoints: BlinkDL's .pth and fla-hub's Hugging Face layout, one name table.

Layouts:

* blinkdl: an RWKV-x070 `.pth` (a flat state dict, no config file): a directory holding one, or
  the file itself. Keys `emb.weight`, `blocks.{i}.ln0/ln1/ln2`, `blocks.{i}.att.*`,
  `blocks.{i}.ffn.*`, `ln_out`, `head.weight`. Dimensions come from tensor shapes (heads and head
  size from r_k, LoRA ranks from w1/a1/v1/g1, the channel-mix width from ffn.key); the norms'
  eps are those of BlinkDL's rwkv package (LayerNorm 1e-5, head GroupNorm 64e-5).
* fla: fla-org/flash-linear-attention's `RWKV7Model` / `RWKV7ForCausalLM` (`save_pretrained`):
  config.json with model_type "rwkv7" + safetensors, keys `[model.]layers.{i}.attn.*` etc.

`RENAMES` brings fla's names to BlinkDL's, the normal form of the rules (so a missing key is
reported under its BlinkDL name). The tensors differ in two ways. Vectors are [1, 1, d] in
BlinkDL and mostly [d] in fla: the VECTOR hook accepts either. The low-rank (LoRA) matrices are
stored as used, x @ W with W [in, out], by BlinkDL, but as torch Linear weights [out, in] by fla;
no shape tells the two apart when a rank equals d_model, so fla's are renamed with a ".T" suffix
and read by rules of their own that transpose.

Two things the shared rule table cannot express are checked by `detect`, which knows the layout:
each LoRA matrix must come in the layout's own orientation for every layer (the rules for both
orientations are optional), and layer 0 has no value-residual LoRA (v0/v1/v2): fla does not save
it, BlinkDL's files may hold an unused copy, which is renamed to `unused.*` and ignored; the
stacked params keep zeros there and layer 0 never reads them. (For a hub id, an unsharded fla
checkpoint's weights arrive only after detection, so this check is skipped there.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxembed.config import ConfigError
from jaxembed.convert.core import TRANSPOSE, ExportLayout, Hook, Rule, normalise_keys
from jaxembed.convert.sources import ConversionError, TensorSource, read_json, weight_files
from jaxembed.models.rwkv7 import RWKV7Config

EXPECTS = ("RWKV7: a BlinkDL RWKV-x070 .pth (a directory holding one, or the file), or an fla-hub "
           "config.json (model_type rwkv7) with safetensors")

BLINKDL, FLA = "blinkdl", "fla"

# [d] or [1, 1, d] -> [d]: a reshape of a vector, never a transpose. Written back as [d], as fla
# stores most vectors; fla's token-shift mixes x_r ... x_g are [1, 1, d] (VECTOR_1_1_D, export only)
VECTOR = Hook(
    "vector",
    lambda s: (s[-1],) if len(s) in (1, 3) and all(x == 1 for x in s[:-1]) else ("not [d] or [1, 1, d]:", *s),
    lambda a: np.ascontiguousarray(a.reshape(-1)),
    lambda a: np.ascontiguousarray(a.reshape(-1)),
)
VECTOR_1_1_D = dataclasses.replace(VECTOR, name="vector [1, 1, d]", invert=lambda a: a.reshape(1, 1, -1))

ATT, FFN = "blocks.{i}.att.", "blocks.{i}.ffn."
LORA = ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2")
VALUE_RESIDUAL = ("v0", "v1", "v2")  # absent from layer 0

RULES = [
    Rule("embedding", "emb.weight"),
    Rule("ln0_weight", "blocks.0.ln0.weight"),
    Rule("ln0_bias", "blocks.0.ln0.bias"),
    Rule("ln_out_weight", "ln_out.weight"),
    Rule("ln_out_bias", "ln_out.bias"),
    Rule("lm_head", "head.weight", optional=True),  # embedders never use it
    *(Rule(f"layers/{ln}_{wb}", f"blocks.{{i}}.{ln}.{wb}") for ln in ("ln1", "ln2") for wb in ("weight", "bias")),
    *(Rule(f"layers/{name}", ATT + name, VECTOR) for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0",
                                                               "k_k", "k_a")),
    Rule("layers/v0", ATT + "v0", VECTOR, optional=True),  # layer 0 has none; see detect
    Rule("layers/r_k", ATT + "r_k"),
    *(Rule(f"layers/{name}", ATT + f"{name}.weight", TRANSPOSE) for name in ("receptance", "key", "value", "output")),
    Rule("layers/ln_x_weight", ATT + "ln_x.weight"),
    Rule("layers/ln_x_bias", ATT + "ln_x.bias"),
    Rule("layers/ffn_x_k", FFN + "x_k", VECTOR),
    Rule("layers/ffn_key", FFN + "key.weight", TRANSPOSE),
    Rule("layers/ffn_value", FFN + "value.weight", TRANSPOSE),
    # LoRA matrices: BlinkDL's as stored, fla's (renamed *.T) transposed; detect checks completeness
    *(Rule(f"layers/{m}", ATT + m, optional=True) for m in LORA),
    *(Rule(f"layers/{m}", ATT + m + ".T", TRANSPOSE, optional=True) for m in LORA),
]

_LAYER = r"^layers\.(\d+)\."
RENAMES = [
    (r"^model\.", ""),  # RWKV7ForCausalLM
    (r"^embeddings\.weight$", "emb.weight"),
    (r"^norm\.(weight|bias)$", r"ln_out.\1"),
    (r"^lm_head\.weight$", "head.weight"),
    (_LAYER + r"pre_norm\.", r"blocks.\1.ln0."),
    (_LAYER + r"attn_norm\.", r"blocks.\1.ln1."),
    (_LAYER + r"ffn_norm\.", r"blocks.\1.ln2."),
    (_LAYER + r"attn\.", r"blocks.\1.att."),
    (_LAYER + r"ffn\.", r"blocks.\1.ffn."),
    (r"\.att\.r_proj\.", ".att.receptance."),
    (r"\.att\.k_proj\.", ".att.key."),
    (r"\.att\.v_proj\.", ".att.value."),
    (r"\.att\.o_proj\.", ".att.output."),
    (r"\.att\.g_norm\.", ".att.ln_x."),
    (r"\.att\.([wavg])_lora\.lora\.0\.weight$", r".att.\g<1>1.T"),  # Linear(d, rank): [rank, d]
    (r"\.att\.([wavg])_lora\.lora\.2\.weight$", r".att.\g<1>2.T"),  # Linear(rank, d): [d, rank]
    (r"\.att\.([wav])_lora\.lora\.2\.bias$", r".att.\g<1>0"),  # w0, a0, v0
    (r"^blocks\.0\.att\.(v[012](\.T)?)$", r"unused.blocks.0.att.\1"),  # layer 0 never uses them
]


def rules_for(cfg: RWKV7Config) -> list[Rule]:
    return RULES


# stacked params that layer 0 holds as zeros (it never reads them): with one layer no tensor supplies them at all
ZERO_FILLED = tuple(f"layers/{name}" for name in VALUE_RESIDUAL)


def ignored_keys(cfg: RWKV7Config) -> list[str]:
    return [r"unused\..*"]


# ---- detection and config readers --------------------------------------------------------


def _is_rwkv7(keys) -> bool:
    return "emb.weight" in keys and any(re.fullmatch(r"blocks\.\d+\.att\.(r_k|k_k|k_a)", k) for k in keys)


def _layout_name(normal: str, layout: str) -> str:
    """A LoRA key's name as the layout spells it (fla's without the optional `model.` prefix), for messages."""
    if layout == BLINKDL:
        return normal
    i, m = re.match(r"blocks\.(\d+)\.att\.(\w+)", normal).groups()
    which = {"0": "lora.2.bias", "1": "lora.0.weight", "2": "lora.2.weight"}[m[1]]
    return f"layers.{i}.attn.{m[0]}_lora.{which}"


def _check_lora_keys(raw_keys, layout: str, n_layers: int) -> None:
    """Every layer's LoRA matrices in the layout's orientation (v0/v1/v2 from layer 1 on), none in the
    other's. The rules for both orientations are optional, so this is where a missing one is caught."""
    names = normalise_keys(raw_keys, RENAMES)  # normalised -> raw
    own, other = ("", ".T") if layout == BLINKDL else (".T", "")
    missing, unexpected = [], []
    for i in range(n_layers):
        att = ATT.format(i=i)
        needed = [m for m in LORA if i > 0 or m not in VALUE_RESIDUAL] + (["v0"] if i > 0 else [])
        missing += [_layout_name(att + m, layout) for m in needed if att + m + ("" if m == "v0" else own) not in names]
        unexpected += [names[att + m + other] for m in LORA if att + m + other in names]
    if missing or unexpected:
        lines = [f"{len(items)} {title} key(s):\n    "
                 + "\n    ".join(items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else []))
                 for title, items in (("missing", missing), ("unexpected", unexpected)) if items]
        raise ConversionError(f"checkpoint ({layout} layout) does not match the model:\n  " + "\n  ".join(lines))


def _blinkdl(file: Path):
    source = TensorSource([file])
    keys = set(source.keys())
    if any(re.search(r"\.ffn\.s(_emb|_emb_x|0|1|2)(\.weight)?$", k) for k in keys):
        raise ConversionError(f"{file}: an RWKV7 DeepEmbed checkpoint (ffn.s_emb, ...); only plain x070 is supported")
    n_layers = 1 + max((int(m.group(1)) for k in keys if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    needed = ["emb.weight", "blocks.0.att.r_k", "blocks.0.ffn.key.weight", "blocks.0.att.w1", "blocks.0.att.a1",
              "blocks.0.att.g1"] + (["blocks.1.att.v1"] if n_layers > 1 else [])
    missing = [k for k in needed if k not in keys]
    if missing:
        raise ConversionError(f"{file}: cannot read the RWKV7 dimensions: missing key(s) {missing}")
    shape = source.shape

    def dim(key, ndim, axis):
        if len(shape(key)) != ndim:
            raise ConversionError(f"{file}: {key} has shape {shape(key)}, expected {ndim} dimensions")
        return shape(key)[axis]

    vocab, d = dim("emb.weight", 2, 0), dim("emb.weight", 2, 1)
    heads, head_size = dim("blocks.0.att.r_k", 2, 0), dim("blocks.0.att.r_k", 2, 1)
    if heads * head_size != d:
        raise ConversionError(f"{file}: blocks.0.att.r_k is [{heads}, {head_size}] but d_model is {d}")
    if n_layers > 1:
        v_rank = dim("blocks.1.att.v1", 2, 1)
    else:  # a one-layer model never uses its value LoRA; keep the file's rank if it has one
        v_rank = dim("blocks.0.att.v1", 2, 1) if "blocks.0.att.v1" in keys else 32
    try:
        cfg = RWKV7Config(
            vocab_size=vocab, d_model=d, n_layers=n_layers, head_size=head_size,
            d_ffn=dim("blocks.0.ffn.key.weight", 2, 0), decay_low_rank=dim("blocks.0.att.w1", 2, 1),
            a_low_rank=dim("blocks.0.att.a1", 2, 1), v_low_rank=v_rank, gate_low_rank=dim("blocks.0.att.g1", 2, 1),
        )
    except ConfigError as err:
        raise ConversionError(f"{file}: {err}") from None
    _check_lora_keys(keys, BLINKDL, n_layers)
    return BLINKDL, cfg, (str(file.resolve()),)  # absolute: weight_files picks exactly this file


# fla.models.rwkv7.RWKV7Config defaults, for fields a config.json leaves out
FLA_DEFAULTS = dict(
    hidden_size=2048, hidden_ratio=4, intermediate_size=None, num_hidden_layers=24, head_dim=64, num_heads=None,
    decay_low_rank_dim=64, gate_low_rank_dim=128, a_low_rank_dim=64, v_low_rank_dim=16, hidden_act="sqrelu",
    norm_first=True, norm_bias=True, norm_eps=1e-5, attn=None, eos_token_id=2, vocab_size=32000, value_dim=None,
)


def _fla_low_rank(value, d: int, head_dim: int, scale: float, per_head: bool) -> int:
    """fla's RWKV7Attention sizing when the config leaves a rank as None."""
    if value is not None:
        return value
    factor = head_dim / 64 if per_head else 1.0
    return max(32, int(round(scale * d**0.5 * factor / 32) * 32))


def _fla_config(raw: dict, origin: str) -> RWKV7Config:
    c = {**FLA_DEFAULTS, **raw}
    d, n_layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c["head_dim"] if c["head_dim"] is not None else d // c["num_heads"]
    problems = []
    if c["attn"]:
        problems.append(f"hybrid attention layers (attn={c['attn']!r}) are not supported")
    if c["hidden_act"] != "sqrelu":
        problems.append(f"hidden_act={c['hidden_act']!r}; only sqrelu is supported")
    if not c["norm_first"]:
        problems.append("norm_first=false (no LayerNorm on the embeddings) is not supported")
    if not c["norm_bias"]:
        problems.append("norm_bias=false (LayerNorms without bias) is not supported")
    value_dim = c["value_dim"]
    if value_dim is not None and any(v != d for v in (value_dim if isinstance(value_dim, list) else [value_dim])):
        problems.append(f"value_dim={value_dim} != hidden_size={d} is not supported")
    if problems:
        raise ConversionError(f"{origin}: unsupported RWKV7 variant: " + "; ".join(problems))
    d_ffn = c["intermediate_size"]
    if d_ffn is None:  # fla's RWKV7FeedForward: hidden_ratio * d rounded up to a multiple of 32
        d_ffn = int(d * (c["hidden_ratio"] if c["hidden_ratio"] is not None else 4))
        d_ffn = 32 * ((d_ffn + 31) // 32)
    eos = c["eos_token_id"][0] if isinstance(c["eos_token_id"], list) else c["eos_token_id"]
    try:
        return RWKV7Config(
            vocab_size=c["vocab_size"], d_model=d, n_layers=n_layers, head_size=head_dim, d_ffn=d_ffn,
            decay_low_rank=_fla_low_rank(c["decay_low_rank_dim"], d, head_dim, 2.5, True),
            a_low_rank=_fla_low_rank(c["a_low_rank_dim"], d, head_dim, 2.5, True),
            v_low_rank=_fla_low_rank(c["v_low_rank_dim"], d, head_dim, 1.7, True),
            gate_low_rank=_fla_low_rank(c["gate_low_rank_dim"], d, head_dim, 5.0, False),
            norm_eps=c["norm_eps"], head_norm_eps=head_dim * c["norm_eps"],  # fla's GroupNorm eps
            eos_token_id=eos,
        )
    except ConfigError as err:
        raise ConversionError(f"{origin}: {err}") from None


def _fla(directory: Path, raw: dict):
    origin = str(directory / "config.json")
    try:
        cfg = _fla_config(raw, origin)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        if isinstance(err, ConversionError):
            raise
        raise ConversionError(f"{origin}: not a valid fla RWKV7 config ({type(err).__name__}: {err})") from None
    # The LoRA check needs the key names: from the shard index, or the weight files. A hub checkpoint's
    # single weight file is only downloaded after detection; then the check is skipped.
    index = directory / "model.safetensors.index.json"
    if index.exists():
        keys = list(read_json(index).get("weight_map", {}))
    elif any(directory.glob("*.safetensors")) or any(directory.glob("*.bin")):
        keys = TensorSource(weight_files(directory)).keys()
    else:
        keys = None
    if keys is not None:
        _check_lora_keys(keys, FLA, cfg.n_layers)
    return FLA, cfg, ()


def detect(path: Path):
    """(layout name, config, preferred weight files) if `path` holds an RWKV7 checkpoint we know."""
    if path.is_file():  # sources.resolve passes a .pth file through as is
        if path.suffix != ".pth":
            return None
        keys = TensorSource([path]).keys()
        if not _is_rwkv7(keys):
            raise ConversionError(f"{path}: a .pth file is read as a BlinkDL RWKV7 checkpoint (emb.weight, "
                                  f"blocks.N.att.r_k, ...), but this one has keys {sorted(keys)[:8]}")
        return _blinkdl(path)
    config_json = path / "config.json"
    if config_json.exists():
        raw = read_json(config_json)
        return _fla(path, raw) if isinstance(raw, dict) and raw.get("model_type") == "rwkv7" else None
    if (path / "params.json").exists():
        return None
    candidates = [f for f in sorted(path.glob("*.pth")) if _is_rwkv7(TensorSource([f]).keys())]
    if len(candidates) > 1:
        raise ConversionError(f"{path}: several RWKV7 checkpoints {[f.name for f in candidates]}; pass the "
                              f".pth file to read")
    return _blinkdl(candidates[0]) if candidates else None


# ---- the reference: BlinkDL's rwkv package -------------------------------------------------------


def _fla_to_blinkdl(raw: str) -> tuple[str, bool] | None:
    """(BlinkDL name, transpose?) of an fla key, written out independently of RENAMES (which it checks)."""
    parts = raw.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    top = {"embeddings.weight": "emb.weight", "norm.weight": "ln_out.weight", "norm.bias": "ln_out.bias",
           "lm_head.weight": "head.weight"}
    if ".".join(parts) in top:
        return top[".".join(parts)], False
    if len(parts) < 4 or parts[0] != "layers":
        return None
    i, block, rest = parts[1], parts[2], parts[3:]
    norms = {"pre_norm": "ln0", "attn_norm": "ln1", "ffn_norm": "ln2"}
    if block in norms:
        return f"blocks.{i}.{norms[block]}.{'.'.join(rest)}", False
    if block == "ffn":
        return f"blocks.{i}.ffn.{'.'.join(rest)}", False
    if block != "attn":
        return None
    projections = {"r_proj": "receptance", "k_proj": "key", "v_proj": "value", "o_proj": "output", "g_norm": "ln_x"}
    if rest[0] in projections:
        return f"blocks.{i}.att.{projections[rest[0]]}.{'.'.join(rest[1:])}", False
    if rest[0].endswith("_lora") and len(rest) == 4 and rest[1] == "lora":
        which = {("0", "weight"): "1", ("2", "weight"): "2", ("2", "bias"): "0"}.get((rest[2], rest[3]))
        return (f"blocks.{i}.att.{rest[0][0]}{which}", rest[3] == "weight") if which else None
    return f"blocks.{i}.att.{'.'.join(rest)}", False  # x_r ... x_g, k_k, k_a, r_k


def blinkdl_reference(state: dict, *, identity_head: bool = True):
    """BlinkDL's rwkv package (RWKV_x070, strategy "cpu fp32") on a state dict under BlinkDL's names:
    run(ids list) -> ln_out(x) at the last token, [d] float64 (with identity_head; else the logits).

    The package reads `NAME + '.pth'`, so the tensors go through a temporary file; it must be
    imported with RWKV_V7_ON=1 (set here unless rwkv.model is already imported).
    """
    import os
    import sys
    import tempfile

    import torch

    if "rwkv.model" not in sys.modules:
        os.environ["RWKV_V7_ON"] = "1"
    try:
        from rwkv import model as rwkv_model
    except ImportError:
        raise ConversionError("RWKV7's reference is BlinkDL's rwkv package: pip install rwkv") from None
    if not hasattr(rwkv_model, "RWKV_x070"):
        raise ConversionError("rwkv.model was imported without RWKV_V7_ON=1, so it has no RWKV7; set the variable "
                              "before anything imports rwkv.model")
    state = dict(state)
    if identity_head:  # logits = ln_out(x) @ I: the final-norm output
        state["head.weight"] = torch.eye(state["emb.weight"].shape[1], dtype=torch.float32)
    tmp = tempfile.TemporaryDirectory()
    torch.save(state, os.path.join(tmp.name, "model.pth"))
    model = rwkv_model.RWKV_x070(os.path.join(tmp.name, "model"), "cpu fp32")

    def run(ids) -> np.ndarray:
        _ = tmp  # the package may keep the file memory-mapped: it lives as long as run
        with torch.no_grad():
            out, _state = model.forward([int(i) for i in ids], None)
        return out.double().numpy()

    return run


def reference(checkpoint):
    """BlinkDL's rwkv package on the source tensors: ids [1, n] -> last-token final-norm output [d]."""
    import torch

    from jaxembed.convert.verify import rounded_source_tensors

    cfg = checkpoint.config
    if not (math.isclose(cfg.norm_eps, 1e-5, rel_tol=1e-9) and math.isclose(cfg.head_norm_eps, 64e-5, rel_tol=1e-9)):
        raise ConversionError(f"BlinkDL's rwkv package hardcodes LayerNorm eps 1e-5 and head GroupNorm eps 64e-5; "
                              f"this model uses {cfg.norm_eps:g} and {cfg.head_norm_eps:g}, so it has no reference")
    source = TensorSource(checkpoint.files) if checkpoint.layout == FLA else None
    state = {}
    for raw, tensor in rounded_source_tensors(checkpoint):
        if checkpoint.layout == BLINKDL:
            name, transpose = raw, False
        else:
            mapped = _fla_to_blinkdl(raw)
            if mapped is None:
                raise ConversionError(f"reference: no BlinkDL name for fla key {raw!r}")
            name, transpose = mapped
            if name.endswith(".att.w0"):  # kept float32 by the converter (FLOAT32_PARAMS), so unrounded here too
                tensor = np.asarray(source.get(raw), np.float32)
        state[name] = torch.from_numpy(np.ascontiguousarray(tensor.T if transpose else tensor))
    run = blinkdl_reference(state)
    return lambda ids: run(np.asarray(ids)[0])


# ---- export: the fla layout ---------------------------------------------------------------------

TOKEN_SHIFT = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")  # the attention's mixes, [1, 1, d] in fla


def _fla_name(normal: str) -> str | None:
    """The fla name (RWKV7Model's, no `model.` prefix) of a normalised (BlinkDL) key; None for layer 0's
    value-residual LoRA, which fla does not have. The inverse of RENAMES, which `jaxembed export` checks."""
    top = {"emb.weight": "embeddings.weight", "ln_out.weight": "norm.weight", "ln_out.bias": "norm.bias",
           "head.weight": "lm_head.weight"}
    if normal in top:
        return top[normal]
    i, block, rest = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.(.+)", normal).groups()
    norms = {"ln0": "pre_norm", "ln1": "attn_norm", "ln2": "ffn_norm"}
    if block in norms:
        return f"layers.{i}.{norms[block]}.{rest}"
    if block == "ffn":
        return f"layers.{i}.ffn.{rest}"
    lora = re.fullmatch(r"([wavg])([012])(\.T)?", rest)
    if lora:
        m, which = lora.group(1), lora.group(2)
        if i == "0" and m == "v":
            return None
        return f"layers.{i}.attn.{m}_lora.lora." + {"0": "2.bias", "1": "0.weight", "2": "2.weight"}[which]
    name, _, tail = rest.partition(".")
    projections = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj", "ln_x": "g_norm"}
    return f"layers.{i}.attn.{projections.get(name, name)}" + (f".{tail}" if tail else "")


def export_rules(cfg: RWKV7Config) -> list[Rule]:
    """RULES as fla stores the tensors: the LoRA matrices as torch Linear weights (the `.T` rules), the
    token-shift mixes as [1, 1, d]."""
    rules = []
    for rule in RULES:
        name = rule.path.rsplit("/", 1)[-1]
        if name in LORA and not rule.key.endswith(".T"):
            continue
        rules.append(dataclasses.replace(rule, hook=VECTOR_1_1_D) if name in TOKEN_SHIFT else rule)
    return rules


def to_fla_config(cfg: RWKV7Config, *, lm_head: bool = True, dtype: str = "float32") -> dict:
    """config.json of fla's RWKV7Model / RWKV7ForCausalLM for `cfg` (the fields its RWKV7Config reads)."""
    if not math.isclose(cfg.head_norm_eps, cfg.head_size * cfg.norm_eps, rel_tol=1e-9):
        raise ConversionError(f"fla's RWKV7 uses head GroupNorm eps = head_dim * norm_eps = "
                              f"{cfg.head_size * cfg.norm_eps:g}; this model uses {cfg.head_norm_eps:g}, which the "
                              f"fla layout cannot express")
    d = cfg.d_model
    return {
        "model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM" if lm_head else "RWKV7Model"],
        "attn_mode": "chunk", "hidden_size": d, "hidden_ratio": cfg.d_ffn / d, "intermediate_size": cfg.d_ffn,
        "num_hidden_layers": cfg.n_layers, "head_dim": cfg.head_size, "num_heads": cfg.n_heads,
        "decay_low_rank_dim": cfg.decay_low_rank, "gate_low_rank_dim": cfg.gate_low_rank,
        "a_low_rank_dim": cfg.a_low_rank, "v_low_rank_dim": cfg.v_low_rank, "hidden_act": "sqrelu",
        "norm_first": True, "norm_bias": True, "norm_eps": cfg.norm_eps, "attn": None, "use_cache": True,
        "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": False, "vocab_size": cfg.vocab_size,
        "value_dim": [d] * cfg.n_layers, "torch_dtype": dtype,
    }


def export_layout(cfg: RWKV7Config, *, lm_head: bool, dtype: str) -> ExportLayout:
    """fla-hub's layout: RWKV7ForCausalLM (model. prefix) when there is an lm_head, else RWKV7Model."""
    config = to_fla_config(cfg, lm_head=lm_head, dtype=dtype)

    def key(normal: str) -> str | None:
        name = _fla_name(normal)
        return name if name is None or not lm_head or name == "lm_head.weight" else "model." + name

    def write_config(directory) -> None:
        (Path(directory) / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return ExportLayout(f"fla {config['architectures'][0]}", export_rules(cfg), key, write_config)
