"""The encode API against transformers' reference outputs, plus its input checks."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, hf_last_hidden, rel_err

import jaxembed
from jaxembed.convert import ConversionError


@pytest.fixture(scope="module")
def embedder(hf_model_dir):
    path, model = hf_model_dir
    return jaxembed.load(path), model


def reference(model, tokenizer, texts):
    """transformers' final-norm output at the EOS appended to each tokenized text, L2-normalised."""
    ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    ref = hf_last_hidden(model, ids)
    return ref / np.linalg.norm(ref, axis=-1, keepdims=True)


TEXTS = [
    "Return the sum of a list.",
    "",
    ("A much longer document about JSON decoding, which keeps going for a while so that it spans several chunks "
     "of the intra-layer chunk size and more than one vertical chunk as well."),
    "x",
    "Serialize obj to a JSON formatted str.",
]


def test_encode_matches_reference_in_input_order(embedder, tokenizer):
    emb, model = embedder
    out = emb.encode(TEXTS, batch_size=2)
    assert out.shape == (len(TEXTS), emb.embedding_dim) and out.dtype == np.float32
    ref = reference(model, tokenizer, TEXTS)
    for o, r in zip(out, ref, strict=True):
        assert rel_err(o, r) < TOLERANCE["float32"]
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), 1.0, rtol=1e-6)


def test_empty_string_is_eos_alone(embedder, tokenizer):
    emb, model = embedder
    ref = hf_last_hidden(model, [[tokenizer.eos_token_id]])[0]
    assert rel_err(emb.encode("", normalize_embeddings=False), ref) < TOLERANCE["float32"]


def test_special_token_strings_in_text_are_text(embedder, tokenizer):
    """A text holding the EOS string ("<eos>" here; Mistral's "</s>" is an HTML tag) is embedded as text:
    the string is not read as the EOS token, so it neither takes the place of the appended EOS nor ends
    the sequence early, and EOS comes exactly once, last, also from a tokenizer that adds EOS itself.
    The stream path agrees."""
    from tokenizers.processors import TemplateProcessing

    emb, model = embedder
    eos, literal = tokenizer.eos_token_id, tokenizer.eos_token
    texts = ["sort a list" + literal, "sort " + literal + " a list", "sort a list"]
    ids = emb.tokenize(texts)
    for text, seq in zip(texts, ids, strict=True):
        assert seq.count(eos) == 1 and seq[-1] == eos, (text, seq)
        assert seq[:-1] == tokenizer(text, split_special_tokens=True)["input_ids"]
    assert ids[0] != ids[2] and len(ids[1]) > len(ids[2]) + 1
    out = emb.encode(texts[:2], normalize_embeddings=False)
    np.testing.assert_array_less([rel_err(o, r) for o, r in zip(out, hf_last_hidden(model, ids[:2]), strict=True)],
                                 TOLERANCE["float32"])
    assert rel_err(emb.encode_stream(["sort ", literal[:2], literal[2:] + " a list"], normalize_embeddings=False),
                   out[1]) < 1e-6
    adds_eos = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer.__class__.from_str(
        tokenizer.backend_tokenizer.to_str()), eos_token=literal)
    adds_eos.backend_tokenizer.post_processor = TemplateProcessing(single=f"$A {literal}",
                                                                   special_tokens=[(literal, eos)])
    with_own_eos = jaxembed.Embedder(emb.params, emb.config, tokenizer=adds_eos)
    assert with_own_eos.tokenize(texts) == ids


def test_query_template_only_on_queries(embedder, tokenizer):
    emb, model = embedder
    q = emb.encode_query(["sort a list"], instruction="Retrieve code for the query")
    d = emb.encode_document(["sort a list"])
    ref_q = reference(model, tokenizer, ["Instruction: Retrieve code for the query\nQuery: sort a list"])
    ref_d = reference(model, tokenizer, ["sort a list"])
    assert rel_err(q[0], ref_q[0]) < TOLERANCE["float32"]
    assert rel_err(d[0], ref_d[0]) < TOLERANCE["float32"]
    # a literal prompt is prepended verbatim; E5-style templates are configurable
    p = emb.encode(["sort a list"], prompt="Instruct: find\nQuery: ")
    assert rel_err(p[0], reference(model, tokenizer, ["Instruct: find\nQuery: sort a list"])[0]) < TOLERANCE["float32"]
    sim = emb.similarity(q, np.stack([d[0], p[0]]))
    assert sim.shape == (1, 2)
    np.testing.assert_allclose(sim[0, 0], q[0] @ d[0], rtol=1e-5)


def test_max_length_truncates_with_a_count(embedder, tokenizer):
    emb, model = embedder
    with pytest.warns(UserWarning, match="truncated 1 of 2 texts"):
        out = emb.encode([TEXTS[2], "short"], max_length=10)
    ids = tokenizer(TEXTS[2])["input_ids"][:9] + [tokenizer.eos_token_id]
    ref = hf_last_hidden(model, [ids])[0]
    assert rel_err(out[0], ref / np.linalg.norm(ref)) < TOLERANCE["float32"]
    with warnings.catch_warnings(record=True) as caught:  # every call's cut is reported, not only the first's
        for _ in range(2):
            emb.encode([TEXTS[2]], max_length=10)
    assert [str(w.message).split(" (")[0] for w in caught] == ["max_length=10: truncated 1 of 1 texts"] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emb.encode(["short"])  # no truncation, no warning, by default
    # a prompt that fills max_length alone would give every text the same ids: refused, with the lengths
    prompt = "Instruction: find the code that does this\nQuery: "
    n = len(tokenizer(prompt)["input_ids"])
    with pytest.raises(ValueError, match=f"the prompt .* is {n} tokens: with EOS, max_length={n} leaves no token"):
        emb.encode(TEXTS[:2], prompt=prompt, max_length=n)
    with pytest.warns(UserWarning, match="truncated [12] of 2"):  # the prompt's last space may merge into a text
        emb.encode(TEXTS[:2], prompt=prompt, max_length=n + 1)


def test_a_truncation_warning_under_python_dash_c_is_a_warning():
    """`warn_every_time` handed linecache `__main__`'s globals: under `python -c` (and the REPL) that raised
    ImportError instead of warning."""
    import subprocess
    import sys

    code = ("from jaxembed.errors import TruncationWarning, warn_every_time\n"
            "warn_every_time('max_length=4: truncated 1 of 1 texts', TruncationWarning)\nprint('went on')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "went on\n", out.stderr
    assert "TruncationWarning: max_length=4: truncated 1 of 1 texts" in out.stderr


def test_buckets_bound_the_number_of_programs(hf_model_dir):
    path, _ = hf_model_dir
    emb = jaxembed.load(path)
    from jaxembed.embedder import embed_jit

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, emb.vocab_size, n).tolist() for n in rng.integers(1, 64, 40)]
    before = embed_jit._cache_size()
    out = emb.encode_ids(ids, vertical_chunk_size=32, batch_size=8)
    # lengths 1..63 with Q = 8: buckets 8, 16, 24, 32, 48, 64, one program each for 40 sequences
    # (plus one for a final batch with fewer rows)
    assert embed_jit._cache_size() - before <= 7
    unbudgeted_batches = emb.last_stats["batches"]
    budget = emb.encode_ids(ids, vertical_chunk_size=32, batch_size=8, max_tokens_per_batch=256)
    np.testing.assert_allclose(budget, out, rtol=1e-5, atol=1e-6)
    assert emb.last_stats["batches"] > unbudgeted_batches


def test_embed_is_pure_and_composable(embedder):
    """jaxembed.embed works inside a user's jit, vmap and grad."""
    emb, _ = embedder
    cfg, params = emb.config, emb.params
    ids = jnp.asarray(np.random.default_rng(1).integers(0, emb.vocab_size, (2, 40)), jnp.int32)
    lengths = jnp.array([40, 13])
    f = jax.jit(jaxembed.embed, static_argnums=1, static_argnames=("vertical_chunk_size",))
    direct = f(params, cfg, ids, lengths, vertical_chunk_size=16)
    mapped = jax.vmap(lambda i, n: jaxembed.embed(params, cfg, i, n, vertical_chunk_size=16))(
        ids[:, None], lengths[:, None]
    )
    np.testing.assert_allclose(mapped[:, 0], direct, rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda p: jnp.sum(jaxembed.embed(p, cfg, ids, lengths)[0] ** 3))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("call, error, message", [
    (lambda e: e.encode(["ok", 3]), TypeError, r"texts\[1\] is int"),
    (lambda e: e.encode([b"bytes"]), TypeError, r"texts\[0\] is bytes"),
    (lambda e: e.encode_ids([[1, 2], [5, 100000]]), ValueError,
     r"ids\[1\]\[1\] = 100000 is out of the vocabulary range"),
    (lambda e: e.encode_ids([[1, -1]]), ValueError, r"ids\[0\]\[1\] = -1 is out of the vocabulary range"),
    (lambda e: e.encode_ids([[1], []]), ValueError, r"ids\[1\] is empty"),
    (lambda e: e.encode_ids([[1.5, 2.0]]), TypeError, r"ids\[0\] must hold ints"),
    (lambda e: e.encode_ids([[1, 2]], vertical_chunk_size=12), ValueError,
     r"V=12 is not a multiple of the chunk size Q=8"),
    (lambda e: e.encode_ids([[1, 2]], batch_size=0), ValueError, "batch_size must be a positive int"),
    (lambda e: e.encode(["a"], vertical_chunk_size="big"), ValueError, "vertical_chunk_size must be"),
    # inputs that would be read by truth value or iterated into something else
    (lambda e: e.encode(["a"], normalize_embeddings="no"), TypeError, "normalize_embeddings must be True or False"),
    (lambda e: e.encode_ids([[1, 2]], normalize_embeddings=None), TypeError, "normalize_embeddings must be"),
    (lambda e: e.encode({"hello": 0}), TypeError, "texts must be a string or a sequence of strings, got dict"),
    (lambda e: e.encode_ids([[True, 2]]), TypeError, r"ids\[0\] holds booleans"),
    (lambda e: e.encode_query(["a"], instruction=5), TypeError, "instruction must be a string, got int"),
    (lambda e: e.encode(["ok", "a\ud800b"]), ValueError, r"texts\[1\] holds a lone surrogate \(U\+D800 at char"),
    (lambda e: e.encode_query(["a"], instruction="x\udfff"), ValueError, "instruction holds a lone surrogate"),
    (lambda e: e.encode_stream(["ok ", "a\ud800 b"]), ValueError, "holds a lone surrogate"),
    (lambda e: jaxembed.embed(e.params, e.config, jnp.zeros((2, 8), jnp.int32), np.array([3.7, 8.0])), TypeError,
     "lengths must be ints, got dtype float"),
    # each of these passed: one section per character, a set's arbitrary order, "no" read as true, ...
    (lambda e: e.encode_sections("chapter one"), TypeError, "got a single str; pass \\[text\\] for one section"),
    (lambda e: e.encode_stream(b"abc"), TypeError, "got bytes; decode it first"),
    (lambda e: e.encode({"a", "b"}), TypeError, "texts must be ordered .*got a set"),
    (lambda e: e.encode(["a"], convert_to_numpy="no"), TypeError, "convert_to_numpy must be True or False"),
    (lambda e: e.similarity(np.ones((2, 3, 4)), np.ones((2, 4))), ValueError, r"got shapes \(2, 3, 4\) and \(2, 4\)"),
    (lambda e: e.similarity(np.ones((2, 4)), np.ones((3, 5))), ValueError, "embeddings of one d"),
    (lambda e: e.encode_id_sections([1, 2, 3]), TypeError, "section 0 is a int, not a sequence of token ids"),
    (lambda e: jaxembed.embed_stream(e.params, e.config, [1, 2], vertical_chunk_size=8), TypeError,
     "piece 0 is a int, not a sequence of token ids"),
    (lambda e: jaxembed.embed_sections(e.params, e.config, np.array([2**32 + 5, 7, 9], np.int64), [1, 3],
                                       vertical_chunk_size=8), ValueError, r"= 4294967301 is out of the vocabulary"),
])
def test_bad_input_gets_a_clear_error(embedder, call, error, message):
    emb, _ = embedder
    with pytest.raises(error, match=message):
        call(emb)


def test_load_keeps_empty_settings_and_checks_them(hf_model_dir):
    """An empty query template is checked (and refused: no {prompt}), not replaced by the default; an
    empty default instruction is kept; a non-string one is refused."""
    path, _ = hf_model_dir
    with pytest.raises(ValueError, match="query_template must contain '{prompt}'"):
        jaxembed.load(path, query_template="")
    assert jaxembed.load(path, default_instruction="").query_prompt() == "Instruction: \nQuery: "
    with pytest.raises(TypeError, match="default_instruction must be a string, got int"):
        jaxembed.load(path, default_instruction=5)


def test_loading_errors(tmp_path, hf_model_dir):
    with pytest.raises(ConversionError, match="no such directory"):
        jaxembed.load(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConversionError, match="not a checkpoint"):
        jaxembed.load(tmp_path)
    with pytest.raises(ConversionError, match="Hugging Face Hub could not be reached"):
        jaxembed.load("state-spaces/mamba2-130m")  # HF_HUB_OFFLINE=1 in the tests
    path, _ = hf_model_dir
    no_tok = jaxembed.load(path, tokenizer=None)
    no_tok.tokenizer = None
    with pytest.raises(ValueError, match="has no tokenizer"):
        no_tok.encode(["a"])


def test_empty_inputs_and_pure_embed_checks(embedder):
    emb, _ = embedder
    emb.encode(["a", "b"])
    assert emb.encode([]).shape == (0, emb.embedding_dim) and emb.last_stats["texts"] == 0  # not the last call's
    emb.encode(["a", "b"])
    assert emb.encode_ids([]).shape == (0, emb.embedding_dim) and emb.last_stats["texts"] == 0
    ids = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 8\]"):
        jaxembed.embed(emb.params, emb.config, ids, jnp.array([0, 8]))
    with pytest.raises(ValueError, match=r"ids must be \[batch, time\]"):
        jaxembed.embed(emb.params, emb.config, jnp.zeros(8, jnp.int32), jnp.array([8]))


def test_bucket_padding_is_bounded():
    from jaxembed.embedder import bucket_length

    for q in (8, 12, 256):
        for n in range(1, 70 * q, max(1, q // 3)):
            b = bucket_length(n, q)
            assert n <= b and (b % q == 0 or b < q)
            assert b <= max(2 * n, 16) and (n <= 2 * q or b <= 1.5 * n) and (n <= 32 * q or b <= 1.25 * n), (n, q, b)


def test_batch_plan_keeps_mixed_lengths_apart_and_corpora_in_full_batches():
    """text.make_batches (encode, the corpus encoder and the server): every row once, padded to its batch's
    bucket, at most batch_size rows and the token budget; a long input never pads a much shorter one; a
    length-sorted corpus fills its batches; batch_shapes lists every shape a plan can hold."""
    from jaxembed.text import batch_shapes, bucket_length, make_batches

    rng = np.random.default_rng(0)
    q = 16
    for lengths, batch_size, budget in [(rng.integers(1, 3000, 500), 32, None), (rng.integers(1, 3000, 37), 8, 4096),
                                        ([2000, 50, 1999, 3, 700], 32, None), ([5], 4, None)]:
        lengths = np.asarray(lengths)
        plan = make_batches(lengths, batch_size, budget, q)
        rows = np.concatenate([r for r, _, _ in plan])
        assert sorted(rows.tolist()) == list(range(len(lengths)))
        shapes = set(batch_shapes(int(lengths.max()), batch_size, budget, q, partial_batches=True))
        for r, padded, n_rows in plan:
            assert padded == bucket_length(int(lengths[r].max()), q) and len(r) <= n_rows <= batch_size
            assert n_rows & (n_rows - 1) == 0 or n_rows == batch_size or budget  # a power of two or the cap
            assert budget is None or n_rows == 1 or n_rows * padded <= budget
            assert padded <= q or (2 * lengths[r] > padded).all(), (lengths[r], padded)
            assert (n_rows, padded) in shapes
    plan = make_batches([2000, 50, 1999, 3, 700], 32, None, q)
    assert [(sorted(r.tolist()), padded) for r, padded, _ in plan] == [([0, 2], 2048), ([4], 768), ([1], 64), ([3], 16)]
    dense = make_batches(np.arange(1000, 1256), 32, None, q)  # a sorted corpus's neighbours: 8 full batches
    assert [len(r) for r, _, _ in dense] == [32] * 8


def test_non_finite_embeddings_stop_with_the_inputs_named(embedder):
    emb, _ = embedder
    params = dict(emb.params, embedding=emb.params["embedding"].at[5].set(jnp.nan))  # token 5 is poisoned
    poisoned = jaxembed.Embedder(params, emb.config, tokenizer=emb.tokenizer)
    with pytest.raises(FloatingPointError, match=r"embeddings of 1 of 3 inputs are not finite \(input indices \[1\]"):
        poisoned.encode_ids([[1, 2], [7, 5, 3], [4]])


def test_xla_cpu_ynn_flag_plan():
    """jaxembed adds XLA:CPU's 'YNN fusions off' flag only where it cannot abort the process or
    override the user (jaxembed/xla_cpu.py)."""
    from jaxembed.xla_cpu import DISABLE_YNN, plan

    assert plan("", False, (0, 10, 2), False) == ("set", DISABLE_YNN)
    assert plan("--xla_dump_to=/d", False, (0, 11, 2), False) == ("set", f"--xla_dump_to=/d {DISABLE_YNN}")
    assert plan("--xla_cpu_experimental_ynn_fusion_type=+reduce", False, (0, 10, 2), False)[1] is None
    assert plan("", True, (0, 10, 2), False) == ("kept: opt-out", None)
    assert plan("", False, (0, 12, 0), False) == ("kept: jaxlib without the flag", None)  # unknown flags abort
    assert plan("", False, (0, 10, 2), True) == ("too late", None)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU setting")
def test_single_chunk_batches_compile_without_ynn_fusions(embedder):
    """The setting reaches the compiler: a batch of 16 single-chunk inputs (the case that gave NaN
    in about 1 process in 3 with jaxlib 0.10.2's YNN fusions) compiles to a program without them."""
    import jaxlib

    from jaxembed.embedder import embed_jit
    from jaxembed.xla_cpu import DISABLE_YNN, JAXLIB_WITH_FLAG, jaxlib_version

    if jaxlib_version() not in JAXLIB_WITH_FLAG:
        pytest.skip(f"jaxlib {jaxlib.__version__} is not known to have the flag")
    emb, _ = embedder
    assert DISABLE_YNN in os.environ["XLA_FLAGS"].split()
    ids, lengths = np.ones((16, emb.chunk_size), np.int32), np.full(16, emb.chunk_size, np.int32)
    compiled = embed_jit.lower(emb.params, emb.config, ids, lengths, chunk_size=emb.chunk_size).compile()
    assert "__ynn_fusion" not in compiled.as_text()
