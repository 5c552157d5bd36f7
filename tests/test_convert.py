"""`jaxembed convert`: round trip, --verify, dtype, and the errors a broken checkpoint gets."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import TOLERANCE, hf_last_hidden, make_hf_mamba2, rel_err
from safetensors.torch import load_file, save_file

import jaxembed
from jaxembed.cli import main
from jaxembed.convert import ConversionError, read_checkpoint


def test_convert_round_trip_and_verify(hf_model_dir, tmp_path, capsys):
    src, model = hf_model_dir
    dst = tmp_path / "converted"
    assert main(["convert", str(src), str(dst), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "verify: max relative error" in printed
    assert float(printed.split("verify: max relative error")[1].split()[0]) < TOLERANCE["float32"]
    assert (dst / "jaxembed.json").exists() and (dst / "params").is_dir() and (dst / "tokenizer.json").exists()
    converted, original = jaxembed.load(dst), jaxembed.load(src)
    seqs = [np.arange(1, 30).tolist(), [3, 4, 5]]
    np.testing.assert_array_equal(converted.encode_ids(seqs), original.encode_ids(seqs))
    ref = hf_last_hidden(model, seqs)
    out = converted.encode_ids(seqs, normalize_embeddings=False)
    assert max(rel_err(o, r) for o, r in zip(out, ref, strict=True)) < TOLERANCE["float32"]
    assert converted.encode("hello").shape == (converted.embedding_dim,)  # the tokenizer came along


def test_convert_to_bfloat16_keeps_decays_float32(hf_model_dir, tmp_path):
    src, _ = hf_model_dir
    assert main(["convert", str(src), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    emb = jaxembed.load(tmp_path / "bf16")
    layers = emb.params["layers"]
    assert layers["xbcdt_proj"].dtype == np.dtype("bfloat16") and layers["out_proj"].dtype == np.dtype("bfloat16")
    assert layers["A_log"].dtype == layers["dt_bias"].dtype == layers["D"].dtype == np.float32
    manifest = json.loads((tmp_path / "bf16" / "jaxembed.json").read_text())
    assert manifest["config"]["architecture"] == "mamba2" and "transformers layout" in manifest["source"]


@pytest.fixture
def broken_dir(tmp_path):
    model = make_hf_mamba2(seed=3, n_groups=2)
    model.save_pretrained(tmp_path)
    return tmp_path


def _edit_weights(directory, edit):
    path = directory / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path)


def test_missing_unexpected_and_misshaped_keys_are_named(broken_dir):
    def edit(state):
        del state["layers.1.mixer.A_log"]
        state["layers.0.mixer.extra"] = torch.zeros(3)
        state["layers.0.mixer.out_proj.weight"] = torch.zeros(64, 100)
        state["layers.0.mixer.D"] = state["layers.0.mixer.D"].to(torch.int32)  # a weight must be real numbers

    _edit_weights(broken_dir, edit)
    with pytest.raises(ConversionError) as err:
        read_checkpoint(broken_dir)
    text = str(err.value)
    assert "1 missing key(s)" in text and "layers.1.mixer.A_log" in text
    assert "1 unexpected key(s)" in text and "layers.0.mixer.extra" in text
    assert "1 misshaped key(s)" in text and "layers.0.mixer.out_proj.weight: shape (64, 100)" in text
    assert "1 non-float key(s)" in text and "layers.0.mixer.D: dtype int32, expected a float type" in text
    assert "the config has" not in text  # every layer is there: no layer-count hint


@pytest.mark.parametrize("n_layers, hint", [(3, "the config has 3 layers, the weights hold layer(s) 0-1 (2)"),
                                            (1, "the config has 1 layer, the weights hold layer(s) 0-1 (2)")])
def test_a_layer_count_that_does_not_match_the_weights_is_named(broken_dir, n_layers, hint):
    """An edited num_hidden_layers makes a long list of missing or unexpected keys; the line above it says why."""
    raw = json.loads((broken_dir / "config.json").read_text())
    (broken_dir / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": n_layers}))
    with pytest.raises(ConversionError, match=r"does not match the model:\n  " + re.escape(hint)):
        read_checkpoint(broken_dir)


def test_a_tensor_in_two_weight_files_is_refused(broken_dir):
    """Weight files with no model.safetensors and no index to say which file is whose, one a stale copy:
    every tensor is in two files, and the converter names one instead of taking whichever sorts last.
    Beside a model.safetensors the copy is ignored, as transformers ignores it."""
    shutil.copy(broken_dir / "model.safetensors", broken_dir / "model_old.safetensors")
    read_checkpoint(broken_dir)
    (broken_dir / "model.safetensors").rename(broken_dir / "model_new.safetensors")
    with pytest.raises(ConversionError, match=r"tensor '.*' is in both model_new.safetensors and "
                                              r"model_old.safetensors"):
        read_checkpoint(broken_dir)


def test_a_single_file_beside_a_stale_index_is_what_transformers_reads(broken_dir, tmp_path):
    """save_pretrained single-file, then sharded, into one folder leaves both layouts; transformers reads
    model.safetensors, and so does the converter (not the index's shards, another model's weights)."""
    from transformers import Mamba2Model

    other = tmp_path / "other"
    make_hf_mamba2(seed=4, n_groups=2).save_pretrained(other, max_shard_size="20KB")
    for f in other.glob("model-*.safetensors"):
        shutil.copy(f, broken_dir / f.name)
    shutil.copy(other / "model.safetensors.index.json", broken_dir)
    expected = Mamba2Model.from_pretrained(broken_dir).state_dict()["layers.0.mixer.A_log"].numpy()
    got = read_checkpoint(broken_dir).params["layers"]["A_log"][0]
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_convert_never_replaces_a_directory_holding_its_source(hf_model_dir, tmp_path, capsys):
    src, _ = hf_model_dir
    out = tmp_path / "jx"
    assert main(["convert", str(src), str(out)]) == 0
    assert main(["convert", str(out), str(tmp_path / "again")]) == 2  # named, not "not a checkpoint"
    assert "already a jaxembed model (jaxembed.json); jaxembed.load reads it" in capsys.readouterr().err
    inner = out / "hf"
    shutil.copytree(src, inner)
    assert main(["convert", str(inner), str(out), "--overwrite"]) == 2
    assert "must not be the source directory or hold it" in capsys.readouterr().err and (inner / "config.json").exists()


def test_unsupported_and_unreadable_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"d_model": 64, "n_layer": 2, "vocab_size": 100, "ssm_cfg": {}, "d_intermediate": 0}))
    with pytest.raises(ConversionError, match="only Mamba2 layers are supported"):
        read_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"d_model": 64, "n_layer": 2, "vocab_size": 100, "ssm_cfg": {"layer": "Mamba2"}}))
    with pytest.raises(ConversionError, match="no weight files"):
        read_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConversionError, match="not a readable safetensors file"):
        read_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{broken json")
    with pytest.raises(ConversionError, match="not valid JSON"):
        read_checkpoint(tmp_path)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err


def test_bfloat16_verify_compares_like_with_like(hf_model_dir, tmp_path, capsys):
    src, _ = hf_model_dir
    assert main(["convert", str(src), str(tmp_path / "bf16"), "--dtype", "bfloat16", "--verify"]) == 0
    assert "verify: max relative error" in capsys.readouterr().out


@pytest.mark.parametrize("config, message", [
    ({"d_model": 64, "n_layer": 2, "ssm_cfg": {"layer": "Mamba2", "ngroups": 0}}, "n_groups must be a positive int"),
    ({"d_model": 64, "ssm_cfg": {"layer": "Mamba2"}}, "missing field 'n_layer'"),
    ({"d_model": "64", "n_layer": 2, "ssm_cfg": {"layer": "Mamba2"}}, "not a valid Mamba2 config"),
    ([1, 2, 3], "expected a JSON object"),
])
def test_malformed_configs_are_named(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        read_checkpoint(tmp_path)


def test_converted_directory_is_checked_on_load(hf_model_dir, tmp_path):
    src, _ = hf_model_dir
    dst = tmp_path / "converted"
    assert main(["convert", str(src), str(dst)]) == 0
    manifest = json.loads((dst / "jaxembed.json").read_text())
    manifest["config"]["d_model"] = 32
    (dst / "jaxembed.json").write_text(json.dumps(manifest))
    with pytest.raises(ConversionError, match=r"layers/xbcdt_proj: shape \(2, 64, .*\), expected \(2, 32,"):
        jaxembed.load(dst)


def test_a_format_1_checkpoint_loads_with_in_proj_split(hf_model_dir, tmp_path, monkeypatch):
    """Format 1 stored mamba_ssm's fused in_proj [d, z | xBC | dt]; it loads as the two params
    format 2 converts it to, bit for bit, with the identity its tensors had."""
    from jaxembed import checkpoint

    src, _ = hf_model_dir
    assert main(["convert", str(src), str(tmp_path / "now")]) == 0
    cfg, params, settings, _ = checkpoint.load(tmp_path / "now")
    layers = dict(params["layers"])
    layers["in_proj"] = np.concatenate([layers.pop("z_proj"), layers.pop("xbcdt_proj")], axis=-1)
    old = {**params, "layers": layers}
    monkeypatch.setattr(checkpoint, "FORMAT_VERSION", 1)
    checkpoint.save(tmp_path / "v1", cfg, old, embedder=settings)
    monkeypatch.undo()
    assert json.loads((tmp_path / "v1" / "jaxembed.json").read_text())["format_version"] == 1
    _, loaded, _, identity = checkpoint.load(tmp_path / "v1")
    assert identity == checkpoint.fingerprint(cfg, checkpoint.tensor_checksums(old))
    assert jaxembed.load(tmp_path / "v1").params["layers"].keys() == params["layers"].keys()
    for name, leaf in params["layers"].items():
        np.testing.assert_array_equal(np.asarray(loaded["layers"][name]), np.asarray(leaf), err_msg=name)
    # with biases (use_bias): in_proj_bias splits at the same column
    import jax

    from jaxembed.config import Mamba2Config
    from jaxembed.models import mamba2

    biased = Mamba2Config(vocab_size=32, d_model=16, n_layers=2, d_state=8, head_dim=8, chunk_size=8, use_bias=True)
    now = mamba2.init_params(biased, jax.random.key(0))
    now["layers"] = {k: v + 0.1 * np.arange(v.size).reshape(v.shape) for k, v in now["layers"].items()}
    fused = dict(now["layers"])
    for suffix in ("", "_bias"):
        fused["in_proj" + suffix] = np.concatenate([fused.pop("z_proj" + suffix), fused.pop("xbcdt_proj" + suffix)], -1)
    upgraded = checkpoint._upgrade(biased, {**now, "layers": fused}, 1)
    assert upgraded["layers"].keys() == now["layers"].keys()
    for name, leaf in now["layers"].items():
        np.testing.assert_array_equal(np.asarray(upgraded["layers"][name]), np.asarray(leaf), err_msg=name)


def test_convert_rejects_bad_arguments_before_reading(hf_model_dir, tmp_path, capsys):
    src, _ = hf_model_dir
    assert main(["convert", str(src), str(tmp_path / "o"), "--query-template", "no placeholder"]) == 2
    assert "must contain '{prompt}'" in capsys.readouterr().err and not (tmp_path / "o").exists()
    (tmp_path / "file").write_text("x")
    assert main(["convert", str(src), str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_hub_revision_reaches_every_download(hf_model_dir, monkeypatch):
    """load(hub_id, revision=...) asks the hub for that revision for the config, the file list and the
    weights (the hub is served from a local directory here); with a local path, revision is an error."""
    import huggingface_hub

    path, model = hf_model_dir
    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append(("snapshot", repo_id, revision))
        return str(path)

    def list_repo_files(repo_id, revision=None):
        calls.append(("list", repo_id, revision))
        return sorted(p.name for p in path.iterdir())

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    emb = jaxembed.load("some-org/tiny-mamba2", revision="v1.2")
    assert calls and all(c[1:] == ("some-org/tiny-mamba2", "v1.2") for c in calls), calls
    seqs = [[5, 9, 2, 7, 11]]
    out = emb.encode_ids(seqs, normalize_embeddings=False)
    assert rel_err(out[0], hf_last_hidden(model, seqs)[0]) < TOLERANCE["float32"]
    with pytest.raises(ConversionError, match="revision='v1.2' applies to Hugging Face hub ids"):
        jaxembed.load(path, revision="v1.2")
