"""Output options (`precision`, `truncate_dim`) against sentence-transformers: its `quantize_embeddings` on the
same float embeddings, and its `SentenceTransformer.encode` pipeline (truncate, normalise, quantise) around a
StaticEmbedding module, both with exact equality of values and dtypes."""

import json
import warnings

import numpy as np
import pytest
import torch
from sentence_transformers.util import truncate_embeddings as st_truncate
from sentence_transformers.util.quantization import quantize_embeddings as st_quantize

import jaxembed
from jaxembed.cli import main
from jaxembed.quantize import PRECISIONS, calibration_ranges, quantize_embeddings, truncate_embeddings

# all in one length bucket, so the embedder tests compile one program per normalize setting
TEXTS = ["alpha beta", "cat dog", "one two", "red blue", "sun moon", "tree leaf"]


def assert_same(ours, ref):
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (ours.dtype, ref.dtype, ours.shape, ref.shape)
    assert np.array_equal(ours, ref)


def reference(raw, precision, *, truncate_dim=None, normalize=True, **quantize):
    """sentence-transformers' order on raw float embeddings: truncate, normalise (torch), quantise."""
    x = torch.from_numpy(st_truncate(raw, truncate_dim))
    if normalize:
        x = torch.nn.functional.normalize(x, p=2, dim=1)
    x = x.numpy()
    return x if precision == "float32" else st_quantize(x, precision, **quantize)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_quantize_matches_sentence_transformers():
    rng = np.random.default_rng(0)
    big = rng.standard_normal((150, 37)).astype(np.float32)  # 37: the last packed byte is partial
    big[:, 3] = 0.25  # a constant dimension: step 1 (max == min)
    small = big[:20].astype(np.float64)
    calibration = rng.standard_normal((50, 37)).astype(np.float32) * 0.5  # narrower: values clip at 0 and 255
    ranges = np.vstack([calibration.min(0), calibration.max(0)])
    for precision in PRECISIONS:
        for x in (big, small, big[:0], big[7]):
            options = [{"ranges": ranges}, {"calibration_embeddings": calibration},
                       {"ranges": ranges, "calibration_embeddings": big}]  # ranges win, as in sentence-transformers
            if x.ndim == 2 and len(x) != 1:
                options.append({})  # the ranges of the batch itself
            for kw in options:
                assert_same(quiet(quantize_embeddings, x, precision, **kw), quiet(st_quantize, x, precision, **kw))
    assert np.array_equal(calibration_ranges(calibration), ranges)


def test_ranges_from_the_batch_warn_and_single_embeddings_fail():
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    with pytest.warns(UserWarning, match="from the 5 embeddings being quantized"):
        quantize_embeddings(x, "int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_embeddings(np.tile(x, (20, 1)), "uint8")  # 100 embeddings: no warning
    for single in (x[:1], x[0]):
        with pytest.raises(ValueError, match="single embedding"):
            quantize_embeddings(single, "int8")
    # ranges with the rows swapped, and a one-row calibration set: refused, not codes that mean nothing
    ranges = np.vstack([x.min(0), x.max(0)])
    with pytest.raises(ValueError, match=r"row 0 must hold the minima .* in 8 of 8 dimensions \(e.g. dimension 0\)"):
        quantize_embeddings(x, "int8", ranges=ranges[::-1])
    with pytest.raises(ValueError, match="calibration_embeddings has one row"):
        quantize_embeddings(x, "uint8", calibration_embeddings=x[:1])


def test_truncate_matches_the_sentence_transformers_order():
    raw = np.random.default_rng(2).standard_normal((9, 24)).astype(np.float32) * 3
    for dim in (1, 5, 16, 24):
        np.testing.assert_allclose(truncate_embeddings(raw, dim, normalize=True), reference(raw, "float32",
                                   truncate_dim=dim), rtol=0, atol=1e-6)
        assert_same(truncate_embeddings(raw, dim, normalize=False), raw[:, :dim])
        # normalised before truncation (as Embedder.encode has them): the same
        unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
        np.testing.assert_allclose(truncate_embeddings(unit, dim, normalize=True), reference(raw, "float32",
                                   truncate_dim=dim), rtol=0, atol=1e-6)


def test_the_sentence_transformer_encode_pipeline(tokenizer):
    """`SentenceTransformer.encode(truncate_dim=, normalize_embeddings=, precision=)` on a static-embedding model
    equals our truncate + quantise applied to its plain float output."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    weights = np.random.default_rng(3).standard_normal((len(tokenizer), 24)).astype(np.float32)
    model = SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_weights=weights)], device="cpu")
    texts = [f"text {i} " + "words " * (i % 4) for i in range(8)]
    raw = model.encode(texts)
    for dim in (None, 5, 13):
        for normalize in (False, True):
            x = raw if dim is None and not normalize else truncate_embeddings(raw, dim or 24, normalize=normalize)
            for precision in PRECISIONS:
                ref = quiet(model.encode, texts, truncate_dim=dim, normalize_embeddings=normalize, precision=precision)
                ours = quiet(quantize_embeddings, x, precision)
                if precision == "float32":
                    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
                else:
                    assert_same(ours, ref)


def test_embedder_output_options(hf_model_dir):
    path, _ = hf_model_dir
    model = jaxembed.load(path)
    raw = model.encode(TEXTS, normalize_embeddings=False)
    ref_float = reference(raw, "float32", truncate_dim=20)
    ranges = np.vstack([ref_float.min(0), ref_float.max(0)]) * 0.8
    np.testing.assert_allclose(model.encode(TEXTS, truncate_dim=20), ref_float, rtol=0, atol=1e-6)
    np.testing.assert_allclose(model.encode(TEXTS, truncate_dim=20, normalize_embeddings=False), raw[:, :20])
    for precision in ("int8", "uint8", "binary", "ubinary"):
        kw = {"ranges": ranges} if precision.endswith("int8") else {}
        assert_same(model.encode(TEXTS, truncate_dim=20, precision=precision, **kw),
                    reference(raw, precision, truncate_dim=20, **kw))
    assert_same(model.encode_query(TEXTS, truncate_dim=20, precision="uint8", ranges=ranges),
                reference(raw, "uint8", truncate_dim=20, ranges=ranges))  # no instruction: the same texts
    ids = model.tokenize(TEXTS)
    assert_same(model.encode_ids(ids, precision="binary"), reference(raw, "binary"))
    with pytest.warns(UserWarning, match="from the 6 embeddings"):
        assert_same(model.encode_document(TEXTS, precision="int8"), quiet(reference, raw, "int8"))
    assert_same(model.encode([], precision="ubinary", truncate_dim=20), np.zeros((0, 3), np.uint8))
    # checked before any work
    for kwargs, match in [({"precision": "int4"}, "precision must be one of"),
                          ({"truncate_dim": 65}, "from 1 to the embedding dimension 64"),
                          ({"truncate_dim": 0}, "truncate_dim"),
                          ({"precision": "int8", "truncate_dim": 20, "ranges": ranges[:, :10]}, r"shape \(2, 20\)"),
                          ({"precision": "int8", "calibration_embeddings": raw[:, :20]}, "20 dimensions"),
                          ({"precision": "binary", "ranges": ranges}, "for int8 and uint8")]:
        with pytest.raises(ValueError, match=match):
            model.encode(TEXTS, **kwargs)
    with pytest.raises(ValueError, match="single embedding"):
        model.encode("one text", precision="int8")


def test_bad_inputs_are_named():
    x = np.random.default_rng(4).standard_normal((4, 16)).astype(np.float32)
    cases = [
        (lambda: quantize_embeddings(x, "float16"), "precision must be one of"),
        (lambda: quantize_embeddings(x, None), "precision must be one of"),
        (lambda: quantize_embeddings(x.astype(np.int8), "binary"), "already quantized"),
        (lambda: quantize_embeddings(x[None], "binary"), "1 or 2 dimensions"),
        (lambda: quantize_embeddings([[1.0, 2.0], [3.0]], "int8"), "not an array of numbers"),
        (lambda: quantize_embeddings(x, "int8", ranges=x[:2, :8]), r"shape \(2, 16\)"),
        (lambda: quantize_embeddings(x, "int8", ranges=np.ones(16)), "2 dimensions"),
        (lambda: quantize_embeddings(x, "int8", ranges=np.full((2, 16), np.nan)), "non-finite"),
        (lambda: quantize_embeddings(x, "uint8", calibration_embeddings=x[:, :8]), "8 dimensions"),
        (lambda: quantize_embeddings(x, "uint8", calibration_embeddings=x[:0]), "is empty"),
        (lambda: quantize_embeddings(np.where(x > 1, np.nan, x), "int8", ranges=x[:2]), "non-finite"),
        (lambda: truncate_embeddings(x, 17, normalize=True), "from 1 to the embedding dimension 16"),
        (lambda: truncate_embeddings(x, True, normalize=True), "truncate_dim"),
        (lambda: truncate_embeddings(x, 2.0, normalize=True), "truncate_dim"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()


def test_cli_precision_and_truncate_dim(hf_model_dir, tmp_path, capsys):
    path, _ = hf_model_dir
    src = tmp_path / "texts.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    raw = jaxembed.load(path).encode(TEXTS, normalize_embeddings=False)
    assert main(["embed", str(src), "--model", str(path), "-o", str(tmp_path / "b.npy"), "--precision", "binary",
                 "--truncate-dim", "20", "--quiet"]) == 0
    assert_same(np.load(tmp_path / "b.npy"), reference(raw, "binary", truncate_dim=20))
    # not the embeddings themselves: a value at a bucket edge could fall either side by a rounding difference
    calibration = reference(raw, "float32", truncate_dim=20) * 0.9 + 0.01
    np.save(tmp_path / "cal.npy", calibration)
    assert main(["embed", str(src), "--model", str(path), "-o", str(tmp_path / "q.npy"), "--precision", "int8",
                 "--truncate-dim", "20", "--calibration", str(tmp_path / "cal.npy"), "--quiet"]) == 0
    expected = reference(raw, "int8", truncate_dim=20, calibration_embeddings=calibration)
    assert_same(np.load(tmp_path / "q.npy"), expected)
    capsys.readouterr()
    assert main(["embed", str(src), "--model", str(path), "--precision", "int8", "--truncate-dim", "20",
                 "--calibration", str(tmp_path / "cal.npy"), "--quiet"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["embedding"] for r in rows] == expected.tolist()  # jsonl: the integers
    assert main(["embed", str(src), "--model", str(path), "--precision", "binary", "--ranges",
                 str(tmp_path / "cal.npy"), "--quiet"]) == 2
    assert "for int8 and uint8" in capsys.readouterr().err
