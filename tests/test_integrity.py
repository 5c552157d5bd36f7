"""Nothing silently wrong: a damaged checkpoint is refused by name (three families), an existing
artefact is replaced only on request and atomically (SIGKILL at random points leaves the old or
the new, complete), evaluation results are keyed by what was evaluated, and bad input is one
clear line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxembed import checkpoint, models
from jaxembed.config import config_from_dict
from jaxembed.errors import ConfigError, ConversionError
from jaxembed.testing import TINY_CONFIGS


def _save(directory: Path, family: str, seed: int = 0, **kw) -> Path:
    cfg = config_from_dict(TINY_CONFIGS[family])
    params = models.family(cfg).init_params(cfg, jax.random.key(seed))
    return checkpoint.save(directory, cfg, params, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {f: _save(tmp_path_factory.mktemp(f) / "ckpt", f, seed=i) for i, f in enumerate(TINY_CONFIGS)}


def _largest_file(root: Path) -> Path:
    return max((p for p in (root / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _file_kinds(root: Path) -> dict[str, Path]:
    """One file of each kind in a checkpoint: the manifest, orbax's metadata files, its ocdbt
    manifests and the largest data file."""
    kinds = {"jaxembed.json": root / checkpoint.MANIFEST, "data": _largest_file(root)}
    for path in sorted((root / "params").rglob("*")):
        if path.is_file() and "/d/" not in path.as_posix():
            kinds.setdefault(path.relative_to(root).as_posix(), path)
    return kinds


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":  # 400 bytes inverted in the middle, size unchanged
        mid = len(data) // 2
        for i in range(max(0, mid - 200), min(len(data), mid + 200)):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # zero: the same size, all zeros
        path.write_bytes(bytes(len(data)))


@pytest.mark.parametrize("how", ["flip", "truncate", "zero"])
@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_a_damaged_checkpoint_is_refused_by_name(saved, family, how, tmp_path):
    """Every kind of file of the checkpoint, flipped (400 bytes), truncated or zeroed: refused, and
    the message names the damaged file (none loads, so none embeds)."""
    checkpoint.load(saved[family])  # intact: loads, checksums verified
    kinds = _file_kinds(saved[family])
    assert len(kinds) >= 8, sorted(kinds)
    for kind in kinds:
        copy = tmp_path / kind.replace("/", "_")
        shutil.copytree(saved[family], copy)
        target = _file_kinds(copy)[kind]
        _damage(target, how)
        with pytest.raises(ConversionError) as err:
            checkpoint.load(copy)
        message = str(err.value)
        assert str(copy) in message and len(message) < 700 and "kvstore" not in message, (kind, message)
        named = "not a valid jaxembed manifest" if kind == "jaxembed.json" else target.relative_to(copy).as_posix()
        assert "corrupt" in message or kind == "jaxembed.json", (kind, message)
        assert named in message, (kind, message)


def test_a_checkpoint_loads_again_unchanged(saved):
    """Reading a checkpoint writes nothing into it (its files keep matching their checksums)."""
    for _ in range(2):
        checkpoint.load(saved["xlstm"])


def test_a_checkpoint_records_a_checksum_per_tensor_and_an_identity(saved, tmp_path):
    import json

    manifest = json.loads((saved["mamba2"] / checkpoint.MANIFEST).read_text())
    tensors = manifest["checksums"]["tensors"]
    assert manifest["checksums"]["algorithm"] == "xxh3_128"
    assert "layers/xbcdt_proj" in tensors and "embedding" in tensors
    cfg, _, _, ident = checkpoint.load(saved["mamba2"])
    again = _save(tmp_path / "again", "mamba2", seed=0)
    other = _save(tmp_path / "other", "mamba2", seed=5)
    assert checkpoint.load(again)[3] == ident != checkpoint.load(other)[3]  # same weights, same identity


def test_params_rewritten_under_stale_tensor_checksums_are_refused_by_tensor(saved, tmp_path):
    """Params written again (one tensor changed) under a manifest whose file checksums were brought up
    to date and whose tensor checksums were not: the files pass, the tensors do not, and the error
    names the tensor instead of loading it under the old model's fingerprint. A tensor stored as
    ints (every checksum consistent) is named too."""
    import json

    import orbax.checkpoint as ocp

    def rewrite(edit):
        copy = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        shutil.copytree(saved["mamba2"], copy)
        params = jax.tree.map(np.asarray, ocp.StandardCheckpointer().restore(copy / "params"))
        edit(params["layers"])
        shutil.rmtree(copy / "params")
        with ocp.StandardCheckpointer() as writer:
            writer.save(copy / "params", params)
        manifest = json.loads((copy / checkpoint.MANIFEST).read_text())
        manifest["checksums"]["files"] = checkpoint.file_checksums(copy)
        if np.issubdtype(params["layers"]["A_log"].dtype, np.integer):
            manifest["checksums"]["tensors"] = checkpoint.tensor_checksums(params)
        (copy / checkpoint.MANIFEST).write_text(json.dumps(manifest))
        return copy

    stale = rewrite(lambda layers: layers.update(A_log=layers["A_log"] + 1))
    with pytest.raises(ConversionError, match="1 tensor.s. differ from the checksums recorded .*: layers/A_log$"):
        checkpoint.load(stale)
    checkpoint.load(stale, verify=False)  # asked not to check: loads
    as_ints = rewrite(lambda layers: layers.update(A_log=layers["A_log"].astype(np.int32)))
    with pytest.raises(ConversionError, match="layers/A_log: dtype int32, expected a float type"):
        checkpoint.load(as_ints)


def test_unknown_manifest_keys_and_bad_token_ids_are_errors(saved, tmp_path):
    import json

    copy = tmp_path / "ckpt"
    shutil.copytree(saved["mamba2"], copy)
    manifest = json.loads((copy / checkpoint.MANIFEST).read_text())
    manifest["embedder"]["query_tempalte"] = "typo {prompt}"
    (copy / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConversionError, match=r"unknown 'embedder' settings \['query_tempalte'\]"):
        checkpoint.load(copy)
    with pytest.raises(ConfigError, match=r"eos_token_id must be a token id in \[0, vocab_size = 64\)"):
        config_from_dict({**TINY_CONFIGS["mamba2"], "eos_token_id": 64})


def test_the_tokenizer_and_the_manifest_sections_are_checked_and_verify_false_vouches_for_nothing(tmp_path, tokenizer):
    """The checksums covered params/ only: a permuted tokenizer.json, an edited norm eps or template, or a
    manifest stripped of its checksums (over another model's params) loaded silently; and verify=False gave
    the manifest's identity to whatever params were there (a resumed corpus run mixed two models' rows)."""
    import json

    a = _save(tmp_path / "a", "mamba2", seed=0, tokenizer=tokenizer)
    b = _save(tmp_path / "b", "mamba2", seed=3)
    ident = checkpoint.load(a)[3]

    def copy_with(edit):
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(a, copy)
        manifest = json.loads((copy / checkpoint.MANIFEST).read_text())
        edit(copy, manifest)
        (copy / checkpoint.MANIFEST).write_text(json.dumps(manifest))
        return copy

    def permute_vocab(copy, manifest):
        definition = json.loads((copy / "tokenizer.json").read_text())
        vocab = definition["model"]["vocab"]
        names = list(vocab)
        vocab.update({names[3]: vocab[names[4]], names[4]: vocab[names[3]]})
        (copy / "tokenizer.json").write_text(json.dumps(definition))

    cases = {
        "changed: tokenizer.json": permute_vocab,
        "config or embedder settings differ": lambda c, m: m["config"].update(norm_eps=1e-2),
        "config or embedder settings differ ": lambda c, m: m["embedder"].update(query_template="Q: {prompt}"),
        "format_version 2 with no checksums": lambda c, m: m.pop("checksums"),
        "format_version 2 with no checksums ": lambda c, m: (shutil.rmtree(c / "params"),
                                                             shutil.copytree(b / "params", c / "params"),
                                                             m.update(checksums={})),
    }
    for why, edit in cases.items():
        copy = copy_with(edit)
        with pytest.raises(ConversionError, match=why.strip()):
            checkpoint.load(copy)
    # verify=False loads what is there and claims no identity: the embedder computes it from the params
    swapped = copy_with(lambda c, m: (shutil.rmtree(c / "params"), shutil.copytree(b / "params", c / "params")))
    cfg, params, _, unchecked = checkpoint.load(swapped, verify=False)
    assert unchecked is None
    from jaxembed.embedder import Embedder

    assert Embedder(params, cfg).fingerprint == checkpoint.load(b)[3] != ident


def test_existing_outputs_are_replaced_only_on_request(tmp_path):
    first = _save(tmp_path / "ckpt", "mamba2", seed=0)
    ident = checkpoint.load(first)[3]
    with pytest.raises(ConversionError, match="already there; pass --overwrite"):
        _save(tmp_path / "ckpt", "mamba2", seed=1)
    assert checkpoint.load(first)[3] == ident
    _save(tmp_path / "ckpt", "mamba2", seed=1, overwrite=True)
    assert checkpoint.load(first)[3] != ident
    unrelated = tmp_path / "photos"
    unrelated.mkdir()
    (unrelated / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(ConversionError, match="not empty and not a jaxembed checkpoint"):
        _save(unrelated, "mamba2", overwrite=True)
    assert sorted(p.name for p in unrelated.iterdir()) == ["cat.jpg"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left behind


KILL_WORKER = textwrap.dedent("""
    import sys, jax
    sys.path.insert(0, {tests!r})
    from test_integrity import _save
    from jaxembed import checkpoint
    kind, target = sys.argv[1], sys.argv[2]
    if kind == "checkpoint":
        print("ready", flush=True)
        _save(__import__("pathlib").Path(target), "rwkv7", seed=1, overwrite=True)
    else:
        import numpy as np
        from jaxembed.cli import write_atomically
        emb = np.random.default_rng(1).standard_normal((4000, 256)).astype(np.float32)
        print("ready", flush=True)
        write_atomically(__import__("pathlib").Path(target), lambda f: np.save(f, emb))
    print("done", flush=True)
""")


def _kill_at_random_points(kind: str, target: Path, points: int, seed: int) -> list[str]:
    """Run the worker `points` times, SIGKILL each after a random delay inside its write; returns
    how each run ended ('killed' or 'finished')."""
    script = target.parent / "kill_worker.py"
    script.write_text(KILL_WORKER.format(tests=str(Path(__file__).parent)))
    rng = np.random.default_rng(seed)
    ends, full = [], None
    for i in range(points + 1):
        proc = subprocess.Popen([sys.executable, str(script), kind, str(target)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        if i == 0:  # the first run finishes: it times the write, and the kills spread over it
            assert proc.stdout.readline().strip() == "done" and proc.wait(timeout=120) == 0
            full = time.perf_counter() - t0
            continue
        time.sleep(rng.uniform(0, full))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        ends.append("killed" if proc.returncode == -signal.SIGKILL else "finished")
    return ends


def test_sigkill_during_a_checkpoint_write_leaves_the_old_or_the_new(tmp_path):
    """`convert` and the trainer's `export` both write through `checkpoint.save`."""
    target = _save(tmp_path / "ckpt", "rwkv7", seed=0)
    old = checkpoint.load(target)[3]
    new = checkpoint.load(_save(tmp_path / "reference", "rwkv7", seed=1))[3]
    ends = _kill_at_random_points("checkpoint", target, points=6, seed=0)  # each point is a process (~4 s)
    assert ends.count("killed") >= 2, ends
    assert checkpoint.load(target)[3] in (old, new)  # complete and verified, whichever it is
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")]
    for p in leftovers:  # temporaries of killed writes, never the published checkpoint
        assert p.name.startswith((".ckpt.tmp-", ".ckpt.old-"))
    # the next write removes the killed writers' temporaries (a 7B's are ~14 GB each; they were only named)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _save(target, "rwkv7", seed=1, overwrite=True)
    killed = [p.name for p in leftovers if p.name.startswith(".ckpt.tmp-")]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    removals = [str(w.message) for w in caught if "removed" in str(w.message)]  # .old- ones are only named
    assert all(name in removals[0] for name in killed[:4]) if killed else not removals


def test_only_the_temporaries_of_gone_writers_on_this_host_are_removed(tmp_path):
    """A live writer's (this process), another host's (a shared filesystem: its pid means nothing here) and
    an unnamed older one's temporary are kept and named; a gone writer's is removed."""
    import socket

    done = subprocess.Popen(["true"])
    done.wait()
    host = socket.gethostname()
    names = {"gone": f".m.tmp-{host}.{done.pid}-a1b2c3d4", "alive": f".m.tmp-{host}.{os.getpid()}-a1b2c3d4",
             "elsewhere": f".m.tmp-other-host.1.{done.pid}-a1b2c3d4", "unnamed": ".m.tmp-k3j4l5m6",
             "made": checkpoint.temporary_sibling(tmp_path / "m").name}
    for name in names.values():
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "x").write_text("x")
    with pytest.warns(UserWarning) as caught:
        checkpoint._clear_stale_temporaries(tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "gone")
    assert f"removed 1 temporary director(ies) left by killed writes of m: {names['gone']}" in str(caught[0].message)
    assert all(names[k] in str(caught[1].message) for k in ("alive", "elsewhere", "unnamed", "made"))


def test_sigkill_during_embed_output_leaves_the_old_or_the_new(tmp_path):
    target = tmp_path / "emb.npy"
    old = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(target, old)
    new = np.random.default_rng(1).standard_normal((4000, 256)).astype(np.float32)
    ends = _kill_at_random_points("embed", target, points=6, seed=1)
    assert ends.count("killed") >= 2, ends
    got = np.load(target)
    assert np.array_equal(got, new) or np.array_equal(got, old)


def test_evaluation_results_are_keyed_by_the_model(saved, tmp_path, tokenizer):
    """Two different models saved under the same folder name get different mteb revisions; the same
    model and settings get the same one (so its cached results are reused, and only then). So do the
    same vocabulary with other merges (another tokenizer), and local tasks of the same names over other
    data."""
    import json
    from types import SimpleNamespace

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from jaxembed.embedder import Embedder
    from jaxembed.eval.run import evaluation_identity, tasks_identity

    def embedder(path, tok=tokenizer):
        cfg, params, settings, ident = checkpoint.load(path)
        return Embedder(params, cfg, fingerprint=ident, tokenizer=tok)

    args = SimpleNamespace(dtype=None, template=None, instructions="paper")
    a = _save(tmp_path / "a" / "model", "mamba2", seed=0)
    b = _save(tmp_path / "b" / "model", "mamba2", seed=9)
    ra, rb = (evaluation_identity(embedder(p), args, 512, []) for p in (a, b))
    assert ra != rb and ra == evaluation_identity(embedder(a), args, 512, [])
    assert evaluation_identity(embedder(a), SimpleNamespace(**{**vars(args), "dtype": "bfloat16"}), 512, []) != ra
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    definition["model"]["merges"] = definition["model"]["merges"][20:]  # the same vocabulary, other ids for text
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(definition)),
                                    eos_token=tokenizer.eos_token)
    text = "return the value of the list"
    assert other.get_vocab() == tokenizer.get_vocab() and other(text)["input_ids"] != tokenizer(text)["input_ids"]
    assert evaluation_identity(embedder(a, other), args, 512, []) != ra
    first, second = tmp_path / "tasks-a.jsonl", tmp_path / "tasks-b.jsonl"
    first.write_text('{"q": 1}\n')
    second.write_text('{"q": 2}\n')
    assert tasks_identity(str(first)) != tasks_identity(str(second))
    assert evaluation_identity(embedder(a), args, 512, tasks_identity(str(first))) != ra
    cfg, params, _, ident = checkpoint.load(a)
    assert Embedder(params, cfg).fingerprint == ident  # computed from the params when not recorded


def test_the_lm_head_stays_off_the_device_but_in_the_identity():
    """An embedder never reads the LM head, so it is not on the device; the computed fingerprint still
    covers it, cast as the params are (float16 runs as float32, bfloat16 rounds to nearest even)."""
    import jax.numpy as jnp

    from jaxembed.embedder import Embedder

    cfg = config_from_dict(TINY_CONFIGS["rwkv7"])  # RWKV7 always has an untied head
    family = models.family(cfg)
    params = family.init_params(cfg, jax.random.key(3))
    half = jax.tree.map(lambda x: x.astype(jnp.float16), params)
    for given, dtype in ((params, None), (params, "bfloat16"), (half, None)):
        expected = checkpoint.fingerprint(cfg, checkpoint.tensor_checksums(models.cast_params(family, given, dtype)))
        emb = Embedder(given, cfg, dtype=dtype)
        assert "lm_head" not in emb.params and emb.fingerprint == expected, dtype


def test_load_refuses_what_it_cannot_use(tmp_path):
    import jaxembed

    with pytest.raises(TypeError, match="model path"):
        jaxembed.load(None)
    with pytest.raises(ValueError, match="dtype must be None, 'float32' or 'bfloat16'"):
        jaxembed.load(tmp_path, dtype="float8")


def test_cli_errors_are_one_line_naming_file_and_line(saved, tmp_path, capsys):
    from jaxembed.cli import main

    bad = tmp_path / "texts.txt"
    bad.write_bytes(b"fine\nalso fine\nbroken \xff here\n")
    assert main(["embed", str(bad), "--model", str(saved["mamba2"]), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"jaxembed embed: error: {bad}, line 3: not valid UTF-8 (byte 0xff at column 8)\n"
    copy = tmp_path / "damaged"
    shutil.copytree(saved["mamba2"], copy)
    _damage(_largest_file(copy), "truncate")
    (tmp_path / "ok.txt").write_text("x\n")
    assert main(["embed", str(tmp_path / "ok.txt"), "--model", str(copy), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxembed embed: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    from jaxembed.convert.sources import resolve

    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConversionError, match=r"runs/modle: no such directory in runs/ \(not looked up"):
        resolve("runs/modle")


def test_non_finite_embeddings_are_one_line_from_the_cli(tmp_path, capsys):
    """NaN weights (recorded as written, so the checksums agree) still cannot pass: the embeddings
    are checked, and the CLI reports it as one line, exit 2."""
    from jaxembed.cli import main
    from jaxembed.testing import make_tokenizer

    tok = make_tokenizer(128)
    cfg = config_from_dict({**TINY_CONFIGS["mamba2"], "vocab_size": len(tok)})
    params = models.family(cfg).init_params(cfg, jax.random.key(0))
    params["norm_f"] = params["norm_f"] * float("nan")
    model = checkpoint.save(tmp_path / "nan", cfg, params, tokenizer=tok)
    (tmp_path / "t.txt").write_text("hello\n")
    assert main(["embed", str(tmp_path / "t.txt"), "--model", str(model), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxembed embed: error: the embeddings of 1 of 1 inputs are not finite") and err.count(
        "\n") == 1


def test_save_through_a_symlink_keeps_the_link_and_the_umask(tmp_path):
    real = tmp_path / "models" / "real"
    first = _save(real, "xlstm", seed=0)
    link = tmp_path / "link"
    link.symlink_to(real)
    _save(link, "xlstm", seed=1, overwrite=True)
    assert link.is_symlink() and checkpoint.load(link)[3] == checkpoint.load(first)[3]
    mask = os.umask(0)
    os.umask(mask)
    assert (real.stat().st_mode & 0o777) == (0o777 & ~mask)  # not mkdtemp's 0700
    assert not [p for p in real.parent.iterdir() if p.name.startswith(".")]


def test_without_an_exchange_the_old_checkpoint_is_put_back_on_failure(tmp_path, monkeypatch):
    target = _save(tmp_path / "ckpt", "mamba2", seed=0)
    old = checkpoint.load(target)[3]
    monkeypatch.setattr(checkpoint, "_rename_exchange", lambda a, b: False)
    real_rename, calls = os.rename, []

    def failing_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 3:  # (new -> target: not empty), (target -> old), then new -> target fails
            raise OSError(5, "Input/output error")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError):
        _save(target, "mamba2", seed=1, overwrite=True)
    monkeypatch.setattr(os, "rename", real_rename)
    assert checkpoint.load(target)[3] == old


def test_load_takes_numpy_and_jax_dtypes(saved):
    import jax.numpy as jnp

    import jaxembed

    for dtype in (jnp.bfloat16, np.float32, "bfloat16"):
        assert jaxembed.load(saved["mamba2"], dtype=dtype).params["layers"]["xbcdt_proj"].dtype == jnp.dtype(dtype)
