"""Streaming and sectioned embeddings: a recurrent model's per-layer states carried across calls.

* `embed_stream`: ids arrive piece by piece; every V of them run through all layers from the carried
  states (exactly V tokens, no padding), so memory does not depend on the total length. The last < V
  ids and EOS run once more from the states, and the output at EOS is the embedding.
* `embed_sections`: the embedding of every prefix that ends at a section boundary, for one pass plus one
  EOS step per section. At a boundary the states are *forked*: EOS runs from a copy, and the states that
  continue into the next section never see it.

A state must be exactly the state after the last real token, so the ids between two cut points run as
pieces of exact lengths, never padded: V at a time, then the rest as powers of two (at most
log2(V) + 1 compiled programs per model, each reused for every document). Only the output at EOS is
computed from a padded block (right padding, which a causal model's EOS never sees).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxembed import models
from jaxembed.runtime import Runtime
from jaxembed.schedule import _layers, check_chunk_sizes, init_states
from jaxembed.text import bucket_length, check_token_ids, text_ids


@partial(jax.jit, static_argnums=(1, 4))
def _advance_states(params, config, ids, states, runtime: Runtime):
    """The per-layer states after ids [b, n] (exact: no padding)."""
    _, states = _layers(config, params, ids, states, runtime)
    return states


@partial(jax.jit, static_argnums=(1, 5, 6))
def _pool_from(params, config, ids, length, states, runtime: Runtime, normalize: bool):
    """The final-norm output at position length-1 of ids [1, n] (right-padded), run from `states`
    (which are not returned: this is the fork)."""
    x, _ = _layers(config, params, ids, states, runtime)
    family = models.family(config)
    out = family.final_norm(config, params, models.hidden(config, x)[0, length - 1])
    if normalize:
        out = out * lax.rsqrt(jnp.maximum(jnp.sum(out * out), 1e-24))
    return out


def piece_lengths(n: int, V: int | None) -> list[int]:
    """n as V, V, ..., then the binary digits of the rest (V None: of n): exact pieces from few compiled shapes."""
    out = [] if V is None else [V] * (n // V)
    rest = n if V is None else n % V
    bit = 1 << max(0, rest.bit_length() - 1)
    while rest:
        if rest & bit:
            out.append(bit)
            rest -= bit
        bit >>= 1
    return out


class StateStream:
    """A document's per-layer states, advanced by token ids; `embedding(tail)` forks them at the end."""

    def __init__(self, params, config, *, vertical_chunk_size: int | None, runtime: Runtime,
                 normalize: bool = True):
        """vertical_chunk_size: V, or None (horizontal: fed ids wait for `flush` / `embedding`, then run at
        once; memory grows with the length)."""
        if not models.family(config).VERTICAL:
            raise ValueError(f"{config.architecture} models have no constant-size state: they cannot stream "
                             "or fork states (embed the whole text with encode / embed)")
        check_chunk_sizes(vertical_chunk_size, runtime.chunk_size)
        self.params, self.config, self.runtime, self.normalize = params, config, runtime, normalize
        self.V = None if vertical_chunk_size is None else int(vertical_chunk_size)
        self.states = init_states(config, 1)
        self.pending: list[int] = []  # ids not yet in the states (fewer than V after every `feed`)
        self.tokens = 0  # ids taken into the states

    def feed(self, ids: Sequence[int]) -> None:
        """Take ids; every full V of them go into the states."""
        self.pending.extend(int(i) for i in ids)
        if self.V is None:
            return
        full = len(self.pending) // self.V * self.V
        for start in range(0, full, self.V):
            self._advance(self.pending[start: start + self.V])
        del self.pending[:full]

    def flush(self) -> None:
        """Take every pending id into the states (exact pieces), e.g. at a section boundary."""
        start = 0
        for n in piece_lengths(len(self.pending), self.V):
            self._advance(self.pending[start: start + n])
            start += n
        self.pending = []

    def embedding(self, tail: Sequence[int]) -> jax.Array:
        """The embedding of (everything fed) + pending + tail, tail ending in EOS; the states are unchanged."""
        ids = self.pending + [int(i) for i in tail]
        if not ids:  # the pooled id must run from the states: one that is already in them has no output here
            raise ValueError("embedding() needs at least one id not yet in the states (pending or tail)")
        padded = np.zeros((1, bucket_length(len(ids), self.runtime.chunk_size)), np.int32)
        padded[0, : len(ids)] = ids
        return _pool_from(self.params, self.config, padded, np.int32(len(ids)), self.states, self.runtime,
                          self.normalize)

    def _advance(self, ids: list[int]) -> None:
        self.states = _advance_states(self.params, self.config, np.asarray([ids], np.int32), self.states,
                                      self.runtime)
        self.tokens += len(ids)


def embed_stream(params, config, id_pieces: Iterable[Sequence[int]], *, vertical_chunk_size: int | None,
                 chunk_size: int | None = None, normalize: bool = True, kernels: str = "auto") -> jax.Array:
    """The embedding [d] of the concatenated id pieces (the last id is pooled: end them with EOS),
    computed V tokens at a time from carried states, in memory independent of the total length."""
    stream = StateStream(params, config, vertical_chunk_size=vertical_chunk_size, normalize=normalize,
                         runtime=Runtime(config.chunk_size if chunk_size is None else chunk_size, kernels))
    last: list[int] = []  # the newest id, held back: it is pooled, so it must run in the final block
    for i, piece in enumerate(id_pieces):
        _check_id_list("piece", i, piece)
        if len(piece):
            try:
                check_token_ids([piece], config.vocab_size)
            except (TypeError, ValueError) as err:
                raise type(err)(f"piece {i}: {err}") from None
            stream.feed([*last, *piece[:-1]])
            last = [int(piece[-1])]
    if not last:
        raise ValueError("no token ids to embed (every piece was empty)")
    return stream.embedding(last)


def embed_section_stream(params, config, sections: Iterable[Sequence[int]], eos: int, *,
                         vertical_chunk_size: int | None,
                         chunk_size: int | None = None, normalize: bool = True, kernels: str = "auto"
                         ) -> jax.Array:
    """`embed_sections` for sections given one by one (any iterable of id lists, read as it goes): row i is
    the embedding of sections[0] + ... + sections[i] + [eos]. [n, d]."""
    stream = StateStream(params, config, vertical_chunk_size=vertical_chunk_size, normalize=normalize,
                         runtime=Runtime(config.chunk_size if chunk_size is None else chunk_size, kernels))
    rows = []
    for i, ids in enumerate(sections):
        _check_id_list("section", i, ids)
        if not len(ids):
            raise ValueError(f"section {i} is empty (no tokens): every section needs at least one token")
        try:
            check_token_ids([ids], config.vocab_size)
        except (TypeError, ValueError) as err:
            raise type(err)(f"section {i}: {err}") from None
        stream.feed(ids)
        stream.flush()
        rows.append(stream.embedding([eos]))
    if not rows:
        raise ValueError("no sections to embed")
    return jnp.stack(rows)


def _check_id_list(kind: str, i: int, ids) -> None:
    """A piece or section is a sequence of ids: a flat id list passed where a list of them is due gives its
    first id here, which would fail as "object of type 'int' has no len()"."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"{kind} {i} is a {type(ids).__name__}, not a sequence of token ids (the {kind}s are an "
                        f"iterable of id lists: [[ids of {kind} 0], [ids of {kind} 1], ...])")


class IncrementalTokenizer:
    """Token ids of a text that arrives in pieces, equal to tokenizing the concatenated text.

    Text is held back from the start of its last whitespace run: tokenizers split there (byte-level BPE,
    SentencePiece's metaspace, whitespace splitters), so the ids before it cannot change whatever follows.
    The held-back text is tokenized after the last committed word as context, not as the start of a text,
    so start-of-text rules (a `Prepend("▁")` normalizer, as in Llama and Mistral tokenizers) do not apply to
    it. Each commit is checked: the committed text, tokenized the same way, must give the same ids. A run
    of text with no whitespace is held until whitespace or `finish` comes.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix, self.suffix = special_ids(tokenizer)
        self.buffer = ""
        self.started = False
        self.context, self._context_ids = "", []  # the last committed word and its ids

    def feed(self, text: str) -> list[int]:
        self.buffer += text
        cut = _last_whitespace_run(self.buffer)
        if cut <= 0:
            return self._start([])
        head = self.buffer[:cut]
        encoded = self._encode(self.buffer)
        if encoded is None:
            return self._start([])
        ids, offsets = encoded
        n = 0
        while n < len(ids) and offsets[n][1] <= cut:
            n += 1
        committed = ids[:n]
        if not n or self._encode(head) != (committed, offsets[:n]):  # not a stable split here: hold everything
            return self._start([])
        self.buffer = self.buffer[cut:]
        word = head.split()[-1]  # head ends in a non-whitespace character
        context_ids = self._encode(word, context="")
        if context_ids is not None:
            self.context, self._context_ids = word, context_ids[0]
        return self._start(committed)

    def finish(self) -> list[int]:
        encoded = self._encode(self.buffer) if self.buffer else ([], [])
        if encoded is None:
            raise ValueError("the stream's tokens cannot be made incrementally with this tokenizer (its ids "
                             "for a text depend on what came before); embed the text whole with encode")
        self.buffer = ""
        return self._start(encoded[0]) + list(self.suffix)

    def _start(self, ids: list[int]) -> list[int]:
        if not self.started and ids:
            self.started = True
            return list(self.prefix) + ids
        return ids

    def _encode(self, text: str, context: str | None = None):
        """(ids, char offsets) of `text` tokenized after the context, or None when the context's ids are not
        a prefix of the result (no clean split)."""
        context = self.context if context is None else context
        context_ids = self._context_ids if context == self.context else []
        enc = text_ids(self.tokenizer, context + text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        n = len(context_ids)
        if ids[:n] != context_ids:
            return None
        shift = len(context)
        return ids[n:], [(a - shift, b - shift) for a, b in offsets[n:]]


def special_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The special ids the tokenizer puts before and after a text (e.g. [bos] and [])."""
    bare = text_ids(tokenizer, "a", add_special_tokens=False)["input_ids"]
    full = text_ids(tokenizer, "a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i: i + len(bare)] == bare:
            return list(full[:i]), list(full[i + len(bare):])
    raise ValueError("cannot tell the tokenizer's special tokens apart from the text's")


def _last_whitespace_run(text: str) -> int:
    """The start of the last run of whitespace that follows a non-whitespace character (0: none)."""
    i = len(text)
    while i > 0 and not text[i - 1].isspace():
        i -= 1
    while i > 0 and text[i - 1].isspace():
        i -= 1
    return i


def stream_ids(tokenizer, pieces: Iterable[str]) -> Iterator[list[int]]:
    """Token ids of the concatenated pieces, piece by piece (see `IncrementalTokenizer`)."""
    inc = IncrementalTokenizer(tokenizer)
    for i, piece in enumerate(pieces):
        if not isinstance(piece, str):
            raise TypeError(f"piece {i} is a {type(piece).__name__}, not a string")
        yield inc.feed(piece)
    yield inc.finish()


def embed_sections(params, config, ids, boundaries, *, eos: int | None = None, vertical_chunk_size: int | None,
                   chunk_size: int | None = None, normalize: bool = True, kernels: str = "auto") -> jax.Array:
    """Contextual section embeddings of one document, jit-compatible (boundaries may be traced).

    Args:
      ids: int [t], the document's token ids.
      boundaries: int [n], strictly increasing section ends in [1, t]: row i is the embedding of
        ids[:boundaries[i]] followed by EOS, exactly `embed` of that prefix + [eos]. Checked when concrete;
        under jit they are the caller's promise (clipped into range).
      eos: the EOS id (default: the config's).
      vertical_chunk_size: V, the largest piece run at once (a multiple of Q); None: no limit (horizontal).
    Returns:
      [n, d] float32.

    One `lax.while_loop` walks the document in exact pieces, the largest power of two <= V that does not
    cross the next boundary (`lax.switch` over log2(V) + 1 static sizes), and at each boundary runs EOS
    from a copy of the per-layer states (the fork).
    """
    runtime = Runtime(config.chunk_size if chunk_size is None else chunk_size, kernels)
    if not models.family(config).VERTICAL:
        raise ValueError(f"{config.architecture} models have no constant-size state: they cannot fork states")
    check_chunk_sizes(vertical_chunk_size, runtime.chunk_size)
    eos = config.eos_token_id if eos is None else eos
    if eos is None:
        raise ValueError("no EOS id: pass eos= (the config names none)")
    ids, boundaries = _checked_sections(config, ids, boundaries)
    V = ids.shape[0] if vertical_chunk_size is None else int(vertical_chunk_size)
    return _embed_sections(params, config, ids, boundaries, int(eos), V, runtime, bool(normalize))


@partial(jax.jit, static_argnums=(1, 4, 5, 6, 7))
def _embed_sections(params, config, ids, boundaries, eos: int, V: int, runtime: Runtime, normalize: bool):
    t, n = ids.shape[0], boundaries.shape[0]
    sizes = [1 << k for k in range(V.bit_length()) if 1 << k <= min(V, t)]
    boundaries = jnp.clip(boundaries.astype(jnp.int32), 1, t)

    def advance_by(size):
        def run(states, pos):
            piece = lax.dynamic_slice(ids, (pos,), (size,))[None]
            return _layers(config, params, piece, states, runtime)[1]
        return run

    branches = [advance_by(size) for size in sizes]
    family = models.family(config)

    def fork(states):
        x, _ = _layers(config, params, jnp.full((1, 1), eos, jnp.int32), states, runtime)
        out = family.final_norm(config, params, models.hidden(config, x)[0, 0])
        return out * lax.rsqrt(jnp.maximum(jnp.sum(out * out), 1e-24)) if normalize else out

    def body(carry):
        pos, i, states, out = carry
        stop = boundaries[i]

        def at_boundary(_):
            return pos, i + 1, states, out.at[i].set(fork(states))

        def advance(_):
            # the largest size that fits before the next boundary: floor(log2(min(stop - pos, V)))
            room = jnp.minimum(stop - pos, sizes[-1])
            k = jnp.sum(jnp.asarray(sizes) <= room) - 1
            return pos + jnp.asarray(sizes)[k], i, lax.switch(k, branches, states, pos), out

        return lax.cond(pos == stop, at_boundary, advance, None)

    carry = (jnp.int32(0), jnp.int32(0), init_states(config, 1), jnp.zeros((n, config.hidden_size), jnp.float32))
    return lax.while_loop(lambda c: c[1] < n, body, carry)[3]


def _checked_sections(config, ids, boundaries):
    from jaxembed.schedule import _concrete

    # the values as given, before jnp.asarray makes int64 int32 (2**32 + 5 would be checked, and embedded, as 5)
    concrete_ids, concrete = _concrete("ids", ids), _concrete("boundaries", boundaries)
    ids = jnp.asarray(ids)
    boundaries = jnp.asarray(boundaries)
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[0] < 1:
        raise ValueError(f"ids must be a non-empty int array [t] (one document), got {ids.dtype} {ids.shape}")
    if boundaries.ndim != 1 or not jnp.issubdtype(boundaries.dtype, jnp.integer) or boundaries.shape[0] < 1:
        raise ValueError(f"boundaries must be a non-empty int array [n] of section ends, got {boundaries.dtype} "
                         f"{boundaries.shape}")
    if concrete_ids is None or concrete is None:
        return ids.astype(jnp.int32), boundaries  # traced: the caller's promise
    check_token_ids([concrete_ids], config.vocab_size)
    t = ids.shape[0]
    if concrete[0] < 1 or concrete[-1] > t or (np.diff(concrete) <= 0).any():
        raise ValueError(f"boundaries must be strictly increasing section ends in [1, {t}] (every section at "
                         f"least one token), got {concrete.tolist()[:16]}")
    return ids.astype(jnp.int32), boundaries
