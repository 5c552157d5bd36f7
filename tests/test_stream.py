"""Streaming and contextual section embeddings (jaxembed.stream): carried per-layer states give exactly
the whole-text embeddings, for every recurrent family, horizontal reference against V in {Q, 2Q}."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import rel_err

from jaxembed import embed, models
from jaxembed.config import Mamba2Config, load_config
from jaxembed.embedder import Embedder
from jaxembed.stream import (
    IncrementalTokenizer,
    embed_section_stream,
    embed_sections,
    embed_stream,
    piece_lengths,
    stream_ids,
)

ROOT = Path(__file__).resolve().parents[1]
Q = 8
VOCAB = 384


def _config(architecture):
    if architecture == "mamba2":
        return Mamba2Config(vocab_size=VOCAB, d_model=32, n_layers=2, d_state=8, head_dim=8, n_groups=2,
                            chunk_size=Q, eos_token_id=0)
    path = {"rwkv7": "configs/models/bench-memory-4l-256-rwkv7.yaml", "xlstm": "configs/models/tiny-train-xlstm.yaml"}
    cfg = load_config(ROOT / path[architecture])
    small = {"vocab_size": VOCAB, "chunk_size": Q, "n_layers": 2, "eos_token_id": 0}
    if architecture == "rwkv7":
        small["d_model"] = 64
    return dataclasses.replace(cfg, **small)


@pytest.fixture(scope="module", params=["mamba2", "rwkv7", "xlstm"])
def embedder(request, tokenizer):
    cfg = _config(request.param)
    params = models.family(cfg).init_params(cfg, jax.random.key(3))
    return Embedder(params, cfg, tokenizer=tokenizer, kernels="xla")


TEXT = ("def frobnicate(items, weights):\n    \"\"\"Scale every item.\"\"\"\n    return [a * b for a, b in "
        "zip(items, weights)]   # ünïcode, tabs\tand  runs   of spaces\n\n") * 6


def _random_pieces(text, n, seed):
    cuts = sorted(np.random.default_rng(seed).choice(np.arange(1, len(text)), n, replace=False).tolist())
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_stream_equals_encode_of_the_whole_text(embedder, V=Q):
    """Pieces cut at random places (mid-word, mid-token, inside whitespace runs), one character pieces and
    a generator: the embedding of the whole text, with and without a prompt. (V = 2Q: notebook 06.)"""
    prompt = embedder.query_template.format(prompt="find the function")
    ref = embedder.encode([TEXT, prompt + TEXT], vertical_chunk_size=None)
    for pieces in (_random_pieces(TEXT, 40, V), list(TEXT[:150]) + [TEXT[150:]]):
        got = embedder.encode_stream((p for p in pieces), vertical_chunk_size=V)
        assert rel_err(got, ref[0]) <= 1e-5
    got = embedder.encode_stream(_random_pieces(TEXT, 7, 1), prompt=prompt, vertical_chunk_size=V)
    assert rel_err(got, ref[1]) <= 1e-5
    horizontal = embedder.encode_stream(_random_pieces(TEXT, 7, 2), vertical_chunk_size=None)  # one pass at the end
    assert rel_err(horizontal, ref[0]) <= 1e-5
    # the pure function on ids, at a total that is a multiple of V (the last id went into the states and the
    # pooled position was a pad: relative errors 1.3 to 1.7) and one more; pieces of 3 ids and one empty piece
    ids = embedder.tokenize([TEXT])[0]
    totals = [2 * V, 2 * V + 1]
    padded = np.zeros((2, 2 * V + 1), np.int32)
    for row, n in zip(padded, totals, strict=True):
        row[:n] = ids[:n]
    whole = np.asarray(embed(embedder.params, embedder.config, padded, np.array(totals), kernels="xla"))
    for n, reference in zip(totals, whole, strict=True):
        pieces = [ids[i: min(i + 3, n)] for i in range(0, n, 3)] + [[]]
        got = embed_stream(embedder.params, embedder.config, pieces, vertical_chunk_size=V, kernels="xla")
        assert rel_err(got, reference) <= 1e-5, n


def test_sections_equal_the_embeddings_of_their_prefixes(embedder):
    """Row i of embed_sections = embed of sections 0..i + EOS, section lengths 1, 7, Q-1, Q, Q+1, 3Q+5 in
    a shuffled order (21 sections), V = 2Q, jitted with the boundaries traced; the streamed form, also
    with one section alone. (V = Q: notebook 06.)"""
    cfg, eos = embedder.config, embedder.eos_token_id
    rng = np.random.default_rng(0)
    lengths = rng.permutation([1, 7, Q - 1, Q, Q + 1, 3 * Q + 5] * 3 + [2, Q + 1, 1]).tolist()
    sections = [rng.integers(1, VOCAB, n).tolist() for n in lengths]
    prefixes = [sum(sections[: i + 1], []) + [eos] for i in range(len(sections))]
    t = max(map(len, prefixes))
    ids = np.zeros((len(prefixes), t), np.int32)
    for row, p in zip(ids, prefixes, strict=True):
        row[: len(p)] = p
    ref = np.asarray(embed(embedder.params, cfg, ids, np.array([len(p) for p in prefixes]), kernels="xla"))
    doc = np.array(sum(sections, []) + rng.integers(1, VOCAB, 5).tolist(), np.int32)  # tokens after the last end
    ends = np.cumsum(lengths).astype(np.int32)
    # jitted whole, the boundaries a traced array
    run = jax.jit(lambda p, d, b: embed_sections(p, cfg, d, b, eos=eos, vertical_chunk_size=2 * Q, kernels="xla"))
    got = np.asarray(run(embedder.params, doc, ends))
    errs = [rel_err(g, r) for g, r in zip(got, ref, strict=True)]
    assert max(errs) <= 1e-5, errs
    # the streamed form (sections read one by one, as encode_sections does), and one section alone
    streamed = np.asarray(embed_section_stream(embedder.params, cfg, iter(sections), eos, vertical_chunk_size=2 * Q,
                                               kernels="xla"))
    assert max(rel_err(g, r) for g, r in zip(streamed, ref, strict=True)) <= 1e-5
    one = embed_section_stream(embedder.params, cfg, [sections[0]], eos, vertical_chunk_size=2 * Q, kernels="xla")
    assert one.shape == (1, cfg.hidden_size) and rel_err(one[0], ref[0]) <= 1e-5


def test_encode_sections_of_text(embedder, tokenizer):
    """The Embedder's text API: each section tokenized on its own; row i = encode_ids of the prefix + EOS;
    40 sections streamed from a generator."""
    sections = [f"def f{i}(x):\n    return x * {i}\n" if i % 3 else f"# part {i}: " + "words " * (i % 7 + 1)
                for i in range(40)]
    ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in sections]
    picked = [0, 1, 13, 39]
    ref = embedder.encode_ids([sum(ids[: i + 1], []) + [embedder.eos_token_id] for i in picked],
                              vertical_chunk_size=None)
    got = embedder.encode_sections((s for s in sections), vertical_chunk_size=2 * Q)
    assert got.shape == (40, embedder.embedding_dim)
    assert max(rel_err(got[i], r) for i, r in zip(picked, ref, strict=True)) <= 1e-5


def test_incremental_tokenizer_matches_the_whole_text(tokenizer):
    """Ids are committed before the end (not held until finish) and equal tokenizing the joined text."""
    whole = tokenizer(TEXT)["input_ids"]
    for seed in range(5):
        pieces = _random_pieces(TEXT, 60, seed)
        chunks = list(stream_ids(tokenizer, pieces))
        assert sum(chunks, []) == whole
        assert sum(len(c) for c in chunks[: len(chunks) // 2]) > len(whole) // 4  # streamed, not held back
    inc = IncrementalTokenizer(tokenizer)
    parts = [inc.feed(p) for p in ("a  ", " b", "\t", "\n c")] + [inc.finish()]
    assert sum(parts, []) == tokenizer("a   b\t\n c")["input_ids"]


def test_incremental_tokenizer_with_a_start_of_text_rule():
    """Llama / Mistral tokenizers prepend "▁" to a text (a Prepend normalizer, metaspace): the held-back text
    must not be tokenized as the start of a text."""
    import itertools

    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    from jaxembed.testing import local_corpus

    tok = Tokenizer(tokenizer_models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    tok.train_from_iterator(itertools.islice(local_corpus(), 2000),
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<unk>"], show_progress=False))
    metaspace = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    whole = metaspace(TEXT)["input_ids"]
    for seed in range(3):
        chunks = list(stream_ids(metaspace, _random_pieces(TEXT, 40, seed)))
        assert sum(chunks, []) == whole
        assert sum(len(c) for c in chunks[: len(chunks) // 2]) > len(whole) // 4


def test_piece_lengths_are_exact_and_few_shapes():
    for n in (0, 1, 7, 8, 9, 29, 64, 1000):
        pieces = piece_lengths(n, 16)
        assert sum(pieces) == n and all(p == 16 or (p < 16 and p & (p - 1) == 0) for p in pieces)
        assert len([p for p in pieces if p < 16]) == bin(n % 16).count("1")


def test_bad_inputs_get_clear_errors(tokenizer):
    cfg = _config("mamba2")
    e = Embedder(models.family(cfg).init_params(cfg, jax.random.key(0)), cfg, tokenizer=tokenizer, kernels="xla")
    with pytest.raises(ValueError, match="no sections to embed"):
        e.encode_sections([], vertical_chunk_size=Q)
    with pytest.raises(ValueError, match="section 1 is empty"):
        e.encode_sections(["a b", "", "c"], vertical_chunk_size=Q)
    with pytest.raises(TypeError, match="section 1 is a int, not a string"):
        e.encode_sections(["a", 3], vertical_chunk_size=Q)
    with pytest.raises(TypeError, match="piece 2 is a bytes, not a string"):
        e.encode_stream(["a", "b", b"c"], vertical_chunk_size=Q)
    for empty in (["", ""], []):  # the empty text, as encode("".join(pieces)) embeds it (it was an error)
        assert rel_err(e.encode_stream(empty, vertical_chunk_size=Q), e.encode("")) <= 1e-6
    with pytest.raises(ValueError, match="not a multiple of the chunk size"):
        e.encode_stream(["abc"], vertical_chunk_size=Q + 1)
    with pytest.raises(ValueError, match=r"ids\[0\]\[1\] = 384 is out of the vocabulary range"):
        embed_sections(e.params, cfg, [1, VOCAB], [2], vertical_chunk_size=Q)
    with pytest.raises(ValueError, match=r"strictly increasing section ends in \[1, 3\]"):
        embed_sections(e.params, cfg, [1, 2, 3], [2, 2], vertical_chunk_size=Q)
    with pytest.raises(ValueError, match="boundaries must be a non-empty int array"):
        embed_sections(e.params, cfg, [1, 2, 3], [], vertical_chunk_size=Q)
    with pytest.raises(ValueError, match="section 0 is empty"):
        embed_section_stream(e.params, cfg, [[]], 0, vertical_chunk_size=Q)
