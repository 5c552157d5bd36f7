"""`jaxembed export`: a converted model written back in its source layout, read by the reference.

Mamba2 and xLSTM: random transformers checkpoints (every parameter random), converted, exported;
the export's tensors equal the source checkpoint's bit for bit, transformers' own classes load it
and their final-norm output at the last position matches jaxembed's encode_ids (fp32, odd lengths).
RWKV7 (transformers has no class for it): an fla-hub checkpoint, converted and exported, equals the
source, and reads back both through jaxembed's fla converter and BlinkDL's rwkv package (the
converter's reference) to the original model's hidden states."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
from conftest import rel_err
from safetensors.torch import load_file

import jaxembed
from jaxembed import checkpoint, models
from jaxembed.cli import main
from jaxembed.convert import ConversionError, convert, detect, read_checkpoint
from jaxembed.convert import mamba2 as mamba2_layouts
from jaxembed.convert import rwkv7 as rwkv7_layouts
from jaxembed.convert import xlstm as xlstm_layouts
from jaxembed.convert.core import Hook
from jaxembed.convert.export import export
from jaxembed.testing import make_hf_mamba2, save_mamba_ssm_layout
from jaxembed.testing.rwkv7 import make_blinkdl_rwkv7, save_fla_layout
from jaxembed.testing.xlstm import make_hf_xlstm

TOL = 1e-5  # relative, fp32 against fp32 on the same weights
LENGTHS = (5, 19)  # odd, one batch: one compilation per family
TEXTS = ["def f(x): return x", "Return a list of lines", "", "naïve café — 日本"]

# BlinkDL's package is TorchScript, which torch 2.13 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")


def seqs_for(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in LENGTHS]


def assert_same_state_dict(exported, source):
    a, b = load_file(exported), load_file(source)
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not different, different


def flat(params) -> dict:
    return {"/".join(k.key for k in path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(
        params)[0]}


def assert_same_params(a, b):
    """Same leaves, dtypes and bits."""
    a, b = flat(a), flat(b)
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                 or not np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8))]
    assert not different, different


def last_hidden(model, seqs):
    base = getattr(model, "backbone", model)
    with torch.no_grad():
        return [base(input_ids=torch.tensor([s])).last_hidden_state[0, -1].double().numpy() for s in seqs]


def assert_config_as_source(dst, src, owned=()):
    """Every field of the source's config.json comes back in the export's with its value, but for what the
    export itself decides (its classes, dtype, transformers version; `owned`). Fields jaxembed does not model
    were written as transformers' defaults (a Mistral's bos_token_id and max_position_embeddings) or dropped
    (a second EOS id)."""
    from jaxembed.convert.export import _EXPORT_OWNED

    source, written = (json.loads((path / "config.json").read_text()) for path in (src, dst))
    source = {k: v for k, v in source.items() if k not in _EXPORT_OWNED + owned}
    assert {k: written.get(k, "(missing)") for k in source} == source


SETTINGS = {"query_template": "Instruct: {prompt}\nQuery: ", "default_instruction": "Given a question, find code"}


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory, tokenizer):
    """A random Mamba2ForCausalLM with a tokenizer, converted, and exported through the CLI."""
    root = tmp_path_factory.mktemp("export_mamba2")
    model = make_hf_mamba2(seed=3, vocab_size=len(tokenizer), n_groups=2, chunk_size=8, causal_lm=True)
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(root / "src")
    tokenizer.save_pretrained(root / "src")
    convert(root / "src", root / "jx", progress=False, **SETTINGS)
    assert main(["export", str(root / "jx"), str(root / "hf"), "--format", "hf"]) == 0
    return root, model


def test_mamba2_export_loads_in_transformers(mamba2):
    from transformers import AutoTokenizer, Mamba2ForCausalLM

    root, _ = mamba2
    dst = root / "hf"
    assert_same_state_dict(dst / "model.safetensors", root / "src" / "model.safetensors")
    assert_config_as_source(dst, root / "src")
    ours = jaxembed.load(root / "jx")
    assert detect(dst)[2] == ours.config  # config.json reads back to the same config
    hf = Mamba2ForCausalLM.from_pretrained(dst).eval()
    seqs = seqs_for(ours.config.vocab_size)
    out = ours.encode_ids(seqs, normalize_embeddings=False)
    errs = [rel_err(o, r) for o, r in zip(out, last_hidden(hf, seqs), strict=True)]
    print("Mamba2 export vs jaxembed: relative errors", [f"{e:.1e}" for e in errs])
    assert max(errs) <= TOL
    # the tokenizer: transformers' from the export gives the source's ids, which jaxembed's are (plus EOS)
    ids = AutoTokenizer.from_pretrained(dst)(TEXTS)["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(root / "src")(TEXTS)["input_ids"]
    assert ours.tokenize(TEXTS) == [x + [ours.eos_token_id] for x in ids]


def test_export_carries_the_query_settings_back_to_convert_and_load(mamba2, tmp_path):
    """The query template and default instruction go out beside the weights and come back through `convert`
    and through `jaxembed.load` of the export itself (both dropped them once: queries embedded from the export
    had no instruction); options given win; a malformed settings file is refused, not skipped."""
    root, _ = mamba2
    assert json.loads((root / "hf" / checkpoint.EMBEDDER_SETTINGS_FILE).read_text()) == SETTINGS
    back = jaxembed.load(convert(root / "hf", tmp_path / "back", progress=False))
    ours = jaxembed.load(root / "jx")
    assert checkpoint.load(tmp_path / "back")[2] == SETTINGS
    expected = ours.encode_query(["sort a list"])
    np.testing.assert_array_equal(back.encode_query(["sort a list"]), expected)
    direct = jaxembed.load(root / "hf")
    assert (direct.query_template, direct.default_instruction) == tuple(SETTINGS.values())
    np.testing.assert_array_equal(direct.encode_query(["sort a list"]), expected)
    assert jaxembed.load(root / "hf", default_instruction="Find it").default_instruction == "Find it"
    other = convert(root / "hf", tmp_path / "other", progress=False, default_instruction="Find the function")
    assert checkpoint.load(other)[2] == {**SETTINGS, "default_instruction": "Find the function"}
    (tmp_path / "bad").mkdir()
    for name in os.listdir(root / "hf"):
        shutil.copy(root / "hf" / name, tmp_path / "bad" / name)
    (tmp_path / "bad" / checkpoint.EMBEDDER_SETTINGS_FILE).write_text('{"query_templat": "Q: {prompt}"}')
    with pytest.raises(ConversionError, match="jaxembed_embedder.json: expected a mapping of"):
        convert(tmp_path / "bad", tmp_path / "bad_out", progress=False)
    with pytest.raises(ConversionError, match="jaxembed_embedder.json: expected a mapping of"):
        jaxembed.load(tmp_path / "bad")
    (tmp_path / "bad" / checkpoint.EMBEDDER_SETTINGS_FILE).write_text("\ufeff" + json.dumps(SETTINGS),
                                                                     encoding="utf-8")  # an editor's BOM: read
    assert jaxembed.load(tmp_path / "bad").query_template == SETTINGS["query_template"]
    (tmp_path / "bad" / checkpoint.EMBEDDER_SETTINGS_FILE).write_text('{"query_template": "Q: {query}"}')
    with pytest.raises(ConversionError, match="jaxembed_embedder.json: query_template must contain"):
        jaxembed.load(tmp_path / "bad")


def test_bfloat16_export_keeps_the_decays_float32(mamba2, tmp_path):
    root, _ = mamba2
    dst = export(root / "jx", tmp_path / "bf16", dtype="bfloat16")
    written = load_file(dst / "model.safetensors")
    float32 = sorted({k.rsplit(".", 1)[-1] for k, v in written.items() if v.dtype == torch.float32})
    assert float32 == ["A_log", "D", "dt_bias"]  # Mamba2's FLOAT32_PARAMS, as jaxembed keeps them
    assert {v.dtype for v in written.values()} == {torch.float32, torch.bfloat16}
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    # read back by the converter: the params cast by jaxembed's casting rule, bit for bit
    config, params, _, _ = checkpoint.load(root / "jx")
    cast = models.cast_params(models.family(config), params, "bfloat16")
    assert_same_params(read_checkpoint(dst).params, cast)


def test_xlstm_export_in_shards_loads_in_transformers(tmp_path, tokenizer):
    """Written in several shards with transformers' index; the config turns the cache off (its qk_dim
    rounding does not fit these layers), so a plain call works. tie_word_embeddings is set: transformers'
    xLSTMForCausalLM never ties, so its own lm_head must come back too (it was dropped)."""
    from transformers import AutoConfig, xLSTMForCausalLM

    model = make_hf_xlstm(seed=5, vocab_size=len(tokenizer), use_bias=True, num_heads=2, chunk_size=8,
                          causal_lm=True, tie_word_embeddings=True)
    assert not torch.equal(model.lm_head.weight, model.backbone.embeddings.weight)
    model.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "jx", tokenizer=tokenizer, progress=False)
    dst = export(tmp_path / "jx", tmp_path / "hf", max_shard_bytes=60_000)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    # every file as a plain open() makes it under the umask (safetensors' own are 0600: their owner's only)
    mask = os.umask(0)
    os.umask(mask)
    assert {oct(p.stat().st_mode & 0o777) for p in dst.iterdir()} == {oct(0o666 & ~mask)}
    exported = {k: v for shard in shards for k, v in load_file(dst / shard).items()}
    source = load_file(tmp_path / "src" / "model.safetensors")
    assert sorted(exported) == sorted(source) and all(torch.equal(exported[k], source[k]) for k in source)
    ours = jaxembed.load(tmp_path / "jx")
    assert detect(dst)[2] == ours.config
    assert_config_as_source(dst, tmp_path / "src", owned=xlstm_layouts.export_layout(
        ours.config, lm_head=True, dtype="float32").owned)
    assert AutoConfig.from_pretrained(dst).use_cache is False
    hf = xLSTMForCausalLM.from_pretrained(dst).eval()
    seqs = seqs_for(ours.config.vocab_size, seed=1)
    out = ours.encode_ids(seqs, normalize_embeddings=False)
    errs = [rel_err(o, r) for o, r in zip(out, last_hidden(hf, seqs), strict=True)]
    print("xLSTM export vs jaxembed: relative errors", [f"{e:.1e}" for e in errs])
    assert max(errs) <= TOL


def test_xlstm_fused_tensors_are_put_back_together(tmp_path):
    """weight_mode "fused": each fused key is rebuilt from the params its row slices became, bit for bit.
    (transformers 5.x's from_pretrained cannot load a fused xLSTM at all, its own save_pretrained
    output included: its fused-gate weight init fails on the bias shapes.)"""
    model = make_hf_xlstm(seed=6, weight_mode="fused", use_bias=True, num_heads=2, chunk_size=8)
    model.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "jx", progress=False)
    with pytest.warns(UserWarning, match="has no tokenizer files; the export has none either"):
        dst = export(tmp_path / "jx", tmp_path / "hf")
    assert_same_state_dict(dst / "model.safetensors", tmp_path / "src" / "model.safetensors")
    assert detect(dst)[2] == detect(tmp_path / "src")[2]


def test_rwkv7_fla_export_reads_back_through_the_converter_and_blinkdl(tmp_path, tokenizer):
    state = make_blinkdl_rwkv7(seed=7, vocab_size=len(tokenizer), d_model=128, n_layers=2, d_ffn=256,
                               layer0_value_lora=False)
    save_fla_layout(state, tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "jx", progress=False)
    dst = export(tmp_path / "jx", tmp_path / "fla")
    assert_same_state_dict(dst / "model.safetensors", tmp_path / "src" / "model.safetensors")
    assert_config_as_source(dst, tmp_path / "src")
    original = jaxembed.load(tmp_path / "jx")
    reread = jaxembed.load(dst)  # the export read back by jaxembed's fla-layout converter
    assert reread.config == original.config
    assert_same_params(reread.params, original.params)  # the same model, bit for bit
    seqs = seqs_for(original.config.vocab_size, seed=2)
    out = reread.encode_ids(seqs, normalize_embeddings=False)
    reference = rwkv7_layouts.reference(read_checkpoint(dst))  # BlinkDL's rwkv package on the exported tensors
    with torch.jit.optimized_execution(False):  # the package is TorchScript: skip its profiling runs (~3 s)
        errs = [rel_err(o, reference(np.asarray([s]))) for o, s in zip(out, seqs, strict=True)]
    print("RWKV7 export, read back by jaxembed vs BlinkDL's rwkv: relative errors", [f"{e:.1e}" for e in errs])
    assert max(errs) <= TOL
    assert reread.tokenize(TEXTS) == original.tokenize(TEXTS)


@pytest.mark.parametrize("cls_name, kwargs", [
    ("Qwen2ForCausalLM", dict(num_key_value_heads=1, use_sliding_window=True, sliding_window=5, max_window_layers=0,
                              rope_theta=1e6)),
    ("MistralModel", dict(num_key_value_heads=2, head_dim=24, sliding_window=None, bos_token_id=7,
                          eos_token_id=[3, 4], max_position_embeddings=777)),
])
def test_transformer_baselines_export(cls_name, kwargs, tmp_path):
    """Mistral / Qwen2: the tensors and the config come back as they were, and transformers loads every
    weight (the parity of the same params and config with transformers is tests/test_transformer_parity.py's)."""
    import transformers

    config_cls = transformers.MistralConfig if cls_name.startswith("Mistral") else transformers.Qwen2Config
    config = config_cls(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, rms_norm_eps=1e-6, tie_word_embeddings=False, **kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "jx", progress=False)
    with pytest.warns(UserWarning, match="no tokenizer"):
        dst = export(tmp_path / "jx", tmp_path / "hf")
    assert_same_state_dict(dst / "model.safetensors", tmp_path / "src" / "model.safetensors")
    assert detect(dst)[2] == detect(tmp_path / "src")[2]
    assert_config_as_source(dst, tmp_path / "src")
    loaded, info = getattr(transformers, cls_name).from_pretrained(dst, output_loading_info=True)
    assert not any(info.values()), info
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(),
                                                 strict=True))


def test_export_errors_name_the_problem(mamba2, tmp_path, capsys, monkeypatch):
    root, model = mamba2
    jx, dst = root / "jx", tmp_path / "out"
    with pytest.raises(ConversionError, match="unknown export format 'onnx'"):
        export(jx, dst, format="onnx")
    with pytest.raises(ConversionError, match="not a jaxembed model directory"):
        export(root / "src", dst)
    assert main(["export", str(tmp_path / "missing"), str(dst)]) == 2
    assert "no such directory" in capsys.readouterr().err
    # an existing model is replaced only with --overwrite, atomically, leaving no temporaries
    (dst).mkdir()
    (dst / "config.json").write_text("{}")
    (dst / "model.safetensors").write_bytes(b"old")
    assert main(["export", str(jx), str(dst)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err and (dst / "model.safetensors").read_bytes() == b"old"
    assert main(["export", str(jx), str(dst), "--overwrite"]) == 0
    assert load_file(dst / "model.safetensors").keys() == load_file(root / "hf" / "model.safetensors").keys()
    assert not list(tmp_path.glob(".out.*"))
    # ... and only when it loses nothing: the swap replaces the directory, not just the export's files
    (dst / "generation_config.json").write_text("{}")
    (dst / "eval").mkdir()
    with pytest.raises(ConversionError, match=r"files an export does not write: eval/, generation_config.json"):
        export(jx, dst, overwrite=True)
    assert (dst / "generation_config.json").exists() and (dst / "eval").is_dir()
    (dst / "generation_config.json").unlink()
    (dst / "eval").rmdir()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not a model directory"):
        export(jx, other, overwrite=True)
    with pytest.raises(ConversionError, match="must not be the model directory"):
        export(jx, jx, overwrite=True)
    with pytest.raises(ConversionError, match="must not be the model directory, hold it or be in it"):
        export(jx, jx / "params" / "hf")  # its files would be checked against jx's manifest: jx broken
    assert jaxembed.load(jx).config is not None
    # a hook without an inverse is named before anything is written
    original = mamba2_layouts.export_layout

    def opaque_layout(cfg, **kwargs):
        layout = original(cfg, **kwargs)
        opaque = Hook("opaque", lambda s: s, lambda a: a)
        rules = [r if r.path != "layers/D" else type(r)(r.path, r.key, opaque) for r in layout.rules]
        return type(layout)(layout.name, rules, layout.key, layout.write_config)

    monkeypatch.setattr(mamba2_layouts, "export_layout", opaque_layout)
    with pytest.raises(ConversionError, match=r"no inverse: opaque \(layers/D <- layers.\{i\}.mixer.D\)"):
        export(jx, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    monkeypatch.undo()
    # a model transformers has no place for: mamba_ssm's per-channel D
    save_mamba_ssm_layout(model, tmp_path / "hdim", d_has_hdim=True)
    convert(tmp_path / "hdim", tmp_path / "hdim_jx", progress=False)
    with pytest.raises(ConversionError, match="D_has_hdim"):
        export(tmp_path / "hdim_jx", tmp_path / "never")


def test_the_trainer_keeps_the_source_config_for_its_export(mamba2):
    """A run from a converted model (or the Hugging Face directory itself) hands the source's config.json to
    its export, so `jaxembed export` of the trained model writes its fields back too."""
    from types import SimpleNamespace

    from jaxembed.train.trainer import load_model

    root, _ = mamba2
    source = json.loads((root / "src" / "config.json").read_text())
    for path in (root / "jx", root / "src"):
        assert load_model(SimpleNamespace(model=SimpleNamespace(path=str(path), tokenizer=None)))[5] == source
