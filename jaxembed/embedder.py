"""The public encode API: prompts, batching by length bucket, pooling, on a model's params
(tokenizing, the query template and the buckets themselves are `jaxembed.text`).

Conventions follow sentence-transformers: `encode(texts, prompt=..., batch_size=...,
normalize_embeddings=...)` returns a float32 numpy array [n, d] (or [d] for one string),
`encode_query` / `encode_document` apply the query template to queries only, and
`similarity(a, b)` is the cosine similarity matrix.

Texts get the model's EOS appended, and the embedding is the final-norm output at that EOS
(Section 3.1). An empty string therefore embeds as the tokenizer's special tokens plus EOS
alone. Nothing is truncated unless `max_length` is given, and then a warning counts the
truncated texts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxembed import models
from jaxembed.errors import TruncationWarning, check_bool, check_positive_int, warn_every_time
from jaxembed.kernels import check_backend
from jaxembed.quantize import check_output_options, quantize_embeddings, truncate_embeddings
from jaxembed.schedule import _check_vertical, check_chunk_sizes, embed
from jaxembed.text import (  # noqa: F401  (re-exported: the embedder's public names)
    MIN_BUCKET,
    QUERY_TEMPLATE,
    batch_bucket,
    batch_shapes,
    bucket_length,
    check_query_template,
    check_texts,
    check_token_ids,
    load_tokenizer,
    lone_surrogate,
    make_batches,
    text_ids,
    tokenize_texts,
)

DEFAULT_SINGLE_SEQUENCE_V = 4096  # Appendix F: batch 1 saturates around V = 4096


# One module-level jit: equal configs hash equal, so every Embedder of a model shares compiled programs.
embed_jit = jax.jit(embed, static_argnums=1,
                    static_argnames=("vertical_chunk_size", "chunk_size", "normalize", "kernels"))


def default_vertical_chunk_size(batch_size: int, chunk_size: int) -> int:
    """Appendix F: V = 2Q for batched inference; for one sequence, a large V (about 4096)."""
    if batch_size <= 1:
        return max(chunk_size, -(-DEFAULT_SINGLE_SEQUENCE_V // chunk_size) * chunk_size)
    return 2 * chunk_size


class Embedder:
    """Text embedder over a recurrent language model (see `jaxembed.load`)."""

    def __init__(
        self,
        params,
        config,
        *,
        tokenizer=None,
        dtype=None,
        chunk_size: int | None = None,
        query_template: str = QUERY_TEMPLATE,
        default_instruction: str | None = None,
        max_tokens_per_batch: int | None = None,
        kernels: str = "auto",
        fingerprint: str | None = None,
    ):
        self.config = config
        self._fingerprint = fingerprint
        self.kernels = check_backend(kernels)
        self.family = models.family(config)
        chunk_size = config.chunk_size if chunk_size is None else chunk_size
        check_chunk_sizes(None, chunk_size)
        self.chunk_size = int(chunk_size)
        if self.chunk_size != config.chunk_size:  # the family's own limits (RWKV7: at most wkv7.MAX_CHUNK), now
            dataclasses.replace(config, chunk_size=self.chunk_size)
        # Embedders never read the LM head (vocab x d: 0.25-0.5 GiB at 7B), so it stays off the device. The
        # identity still covers it, as a converted checkpoint's recorded fingerprint does.
        self._unused = {}  # what the identity covers beyond self.params, as given (cast only if it is asked for)
        self._dtype = dtype
        if isinstance(params, dict) and "lm_head" in params:
            if fingerprint is None:
                self._unused["lm_head"] = params["lm_head"]
            params = {name: leaf for name, leaf in params.items() if name != "lm_head"}
        self.params = models.cast_params(self.family, params, dtype)
        self.tokenizer = tokenizer
        self.query_template = check_query_template(query_template)
        if default_instruction is not None and not isinstance(default_instruction, str):
            raise TypeError(f"default_instruction must be a string, got {type(default_instruction).__name__}")
        self.default_instruction = default_instruction
        check_positive_int("max_tokens_per_batch", max_tokens_per_batch, optional=True)
        self.max_tokens_per_batch = max_tokens_per_batch
        self.last_stats: dict = {}

    # ---- properties -------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """The model's identity (config and every tensor's checksum): a converted checkpoint's is
        recorded when it is written; otherwise it is computed once from the params."""
        if self._fingerprint is None:
            from jaxembed import checkpoint

            unused = {name: models.cast_host_param(self.family, name, leaf, self._dtype)
                      for name, leaf in self._unused.items()}
            self._fingerprint = checkpoint.fingerprint(self.config, checkpoint.tensor_checksums({**self.params,
                                                                                               **unused}))
            self._unused = {}
        return self._fingerprint

    @property
    def embedding_dim(self) -> int:
        return self.config.hidden_size

    def get_sentence_embedding_dimension(self) -> int:  # sentence-transformers name
        return self.embedding_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_id(self) -> int:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = self.config.eos_token_id
        if eos is None:
            raise ValueError("this model has no EOS token id (neither its tokenizer nor its config names one)")
        return int(eos)

    # ---- text -------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], *, max_length: int | None = None) -> list[list[int]]:
        """Token ids with EOS appended. With max_length, longer texts are cut (keeping EOS) and counted."""
        return self._tokenize(texts, max_length)[0]

    def _tokenize(self, texts, max_length):
        self._require_tokenizer()
        check_positive_int("max_length", max_length, optional=True)
        out, truncated = tokenize_texts(self.tokenizer, texts, self.eos_token_id, max_length)
        if truncated:
            warn_every_time(f"max_length={max_length}: truncated {truncated} of {len(out)} texts (counted in "
                            f"last_stats['truncated'])", TruncationWarning, stacklevel=3)
        return out, truncated

    def _check_room_after(self, prompt: str, max_length: int | None) -> None:
        """A prompt that fills max_length on its own cuts every text to the same ids: identical embeddings.
        Counted alone, a prompt may hold one token more than in context (a trailing space that byte-level BPE
        merges into the text's first word), so only a prompt longer than max_length - 1 by that count is refused."""
        if max_length is None or not prompt:
            return
        self._require_tokenizer()
        check_positive_int("max_length", max_length)
        n = len(tokenize_texts(self.tokenizer, [prompt], self.eos_token_id)[0][0])
        if n > max_length:
            raise ValueError(f"the prompt {prompt[:60]!r} is {n - 1} tokens: with EOS, max_length={max_length} leaves "
                             "no token of the texts (each would embed as the prompt alone); raise max_length or "
                             "shorten the prompt")

    def encode(
        self,
        texts: str | Sequence[str],
        prompt: str | None = None,
        batch_size: int = 32,
        normalize_embeddings: bool = True,
        show_progress_bar: bool | None = None,
        max_length: int | None = None,
        vertical_chunk_size: int | None | str = "auto",
        max_tokens_per_batch: int | None = None,
        convert_to_numpy: bool = True,
        precision: str = "float32",
        truncate_dim: int | None = None,
        ranges: np.ndarray | None = None,
        calibration_embeddings: np.ndarray | None = None,
    ) -> np.ndarray:
        """Embed texts: [n, d] float32 (or [d] for a single string).

        prompt: a literal prefix for every text (e.g. the output of `query_prompt`).
        vertical_chunk_size: "auto" (Appendix F, per device batch: V = 2Q for several rows, about 4096 for one),
            None (horizontal) or V, a multiple of Q.
        max_tokens_per_batch: cap on padded tokens per batch (default: the embedder's); a text longer than the cap
            runs as a batch of its own (it is never cut: max_length does that).
        truncate_dim, precision, ranges, calibration_embeddings: as in sentence-transformers (see `encode_ids`).
        """
        single = isinstance(texts, str)
        texts = [texts] if single else check_texts(texts)
        check_bool("normalize_embeddings", normalize_embeddings)
        check_bool("convert_to_numpy", convert_to_numpy)
        output = dict(precision=precision, truncate_dim=truncate_dim, ranges=ranges,
                      calibration_embeddings=calibration_embeddings)
        check_output_options(self.embedding_dim, rows=len(texts), **output)
        if not texts:
            self.last_stats = {"texts": 0, "tokens": 0, "seconds": 0.0, "tokens_per_second": 0.0, "batches": 0,
                               "truncated": 0}
            return self._output(np.empty((0, self.embedding_dim), np.float32), normalize_embeddings, **output)
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
            self._check_room_after(prompt, max_length)
            texts = [prompt + t for t in texts]
        ids, truncated = self._tokenize(texts, max_length)
        out = self.encode_ids(
            ids,
            normalize_embeddings=normalize_embeddings,
            vertical_chunk_size=vertical_chunk_size,
            batch_size=batch_size,
            show_progress_bar=show_progress_bar,
            max_tokens_per_batch=max_tokens_per_batch,
            **output,
        )
        self.last_stats["truncated"] = truncated
        if not convert_to_numpy:
            out = jnp.asarray(out)
        return out[0] if single else out

    def query_prompt(self, instruction: str | None = None) -> str:
        """The query prefix: the template filled with the instruction ("" if there is none)."""
        instruction = instruction if instruction is not None else self.default_instruction
        if instruction is not None and not isinstance(instruction, str):
            raise TypeError(f"instruction must be a string, got {type(instruction).__name__} ({instruction!r:.40})")
        if instruction is not None and (problem := lone_surrogate(instruction)):
            raise ValueError(f"instruction {problem}")
        return "" if instruction is None else self.query_template.format(prompt=instruction)

    def encode_query(self, texts, instruction: str | None = None, **kwargs) -> np.ndarray:
        """Queries get the instruction template (Section 3.1); `prompt=` overrides it verbatim."""
        kwargs.setdefault("prompt", self.query_prompt(instruction) or None)
        return self.encode(texts, **kwargs)

    def encode_document(self, texts, **kwargs) -> np.ndarray:
        """Documents are embedded without instruction, so a corpus is embedded once for all tasks."""
        return self.encode(texts, **kwargs)

    def warmup(self, max_length: int, *, batch_size: int = 32, vertical_chunk_size: int | None | str = "auto",
               max_tokens_per_batch: int | None = None, normalize_embeddings: bool = True,
               partial_batches: bool = False, show_progress_bar: bool | None = None) -> list[tuple[int, int]]:
        """Compile ahead the programs `encode(..., batch_size=...)` runs for texts of up to `max_length` tokens
        (EOS included): one per length bucket (`bucket_length`: powers of two up to Q, then Q times 1, 2, 3, 4,
        6, 8, 12, ...; at most 2x padding, 1.25x beyond 32Q), for a full batch, and with partial_batches also
        for every power-of-two row count below it (the last batch of a call, a server's lone long input);
        see `text.make_batches`. With the persistent compilation cache (`jaxembed.compile_cache`) the programs
        are written to disk, so a later process loads them instead of compiling. Returns the [rows, length]
        shapes run."""
        check_positive_int("max_length", max_length)
        check_positive_int("batch_size", batch_size)
        budget = max_tokens_per_batch if max_tokens_per_batch is not None else self.max_tokens_per_batch
        shapes = batch_shapes(max_length, batch_size, budget, self.chunk_size, partial_batches=partial_batches)
        for rows, length in tqdm(shapes, desc="compiling", unit="shape",
                                 disable=None if show_progress_bar is None else not show_progress_bar):
            # one call on zeros (AOT `lower().compile()` would not fill jit's own cache of programs)
            jax.block_until_ready(self._embed_batch(np.zeros((rows, length), np.int32), np.ones(rows, np.int32),
                                                    vertical_chunk_size, normalize_embeddings))
        return shapes

    def _embed_batch(self, ids: np.ndarray, lengths: np.ndarray, vertical_chunk_size, normalize: bool):
        """One device batch, dispatched (not waited for). V follows Appendix F for the rows that run together
        (one sequence: a large V); a batch no longer than V runs horizontally, and is passed as such so that
        it shares the program of every V it fits in."""
        V = self.resolve_vertical_chunk_size(vertical_chunk_size, ids.shape[0])
        if V is not None and ids.shape[1] <= V:
            V = None
        return embed_jit(self.params, self.config, ids, lengths, vertical_chunk_size=V, chunk_size=self.chunk_size,
                         normalize=normalize, kernels=self.kernels)

    # ---- streams and sections (jaxembed.stream) ------------------------------------------
    def encode_stream(self, pieces: Iterable[str], *, prompt: str | None = None, normalize_embeddings: bool = True,
                      vertical_chunk_size: int | str | None = "auto", show_progress_bar: bool | None = None
                      ) -> np.ndarray:
        """The embedding [d] of the concatenated pieces (any iterable of strings: a generator, a file's
        lines) with EOS appended, exactly `encode("".join(pieces))`, in memory that does not depend on the
        total length: ids are made incrementally and run V at a time from carried per-layer states.

        prompt: a literal prefix (e.g. `query_prompt(...)`). vertical_chunk_size: "auto", V (a multiple of Q), or
        None (horizontal: the ids are kept and run in one pass at the end, so memory grows with the length).
        """
        from jaxembed.stream import StateStream, stream_ids

        self._require_tokenizer()
        check_bool("normalize_embeddings", normalize_embeddings)
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        if isinstance(pieces, str):
            pieces = [pieces]
        elif isinstance(pieces, (bytes, bytearray)):
            raise TypeError(f"pieces must be a string or an iterable of strings, got {type(pieces).__name__}; "
                            "decode it first")
        stream = StateStream(self.params, self.config, vertical_chunk_size=self._stream_chunk_size(
            vertical_chunk_size), runtime=self._runtime(), normalize=normalize_embeddings)
        texts = pieces if not prompt else _prefixed(prompt, pieces)
        last = None  # the newest id stays out of the states: the pooled position is at or after it
        with tqdm(unit="tok", unit_scale=True, desc="embedding stream",
                  disable=(None if show_progress_bar is None else not show_progress_bar)) as bar:
            for ids in stream_ids(self.tokenizer, texts):
                if not ids:
                    continue
                check_token_ids([ids], self.vocab_size)
                stream.feed(([last] if last is not None else []) + ids[:-1])
                last = ids[-1]
                bar.update(len(ids))
        if last is None:  # an empty text: as encode(""), the tokenizer's own special ids and EOS
            tail = tokenize_texts(self.tokenizer, [""], self.eos_token_id)[0][0]
        else:
            tail = [last] if last == self.eos_token_id else [last, self.eos_token_id]
        out = np.asarray(stream.embedding(tail), np.float32)
        self.last_stats = {"tokens": stream.tokens + len(stream.pending) + len(tail)}
        _check_finite(out[None], np.arange(1), 1, self.last_stats["tokens"])
        return out

    def encode_sections(self, sections: Iterable[str], *, prompt: str | None = None,
                        normalize_embeddings: bool = True, vertical_chunk_size: int | str | None = "auto",
                        show_progress_bar: bool | None = None) -> np.ndarray:
        """Contextual section embeddings [n, d] in one pass: row i embeds sections 0..i followed by EOS,
        exactly `encode_ids([ids_0 + ... + ids_i + [eos]])[0]`, where ids_i is section i tokenized on its
        own (no special tokens; the tokenizer's leading ones, e.g. BOS, and the prompt's ids before
        section 0). At each boundary the per-layer states are forked: EOS runs from a copy.
        `sections` may be any iterable of strings (read as it goes)."""
        from jaxembed.stream import StateStream, special_ids

        self._require_tokenizer()
        check_bool("normalize_embeddings", normalize_embeddings)
        if isinstance(sections, (str, bytes, bytearray)):  # iterated, it would be one section per character
            raise TypeError(f"sections must be an iterable of strings, one per section, got a single "
                            f"{type(sections).__name__}; pass [text] for one section")
        stream = StateStream(self.params, self.config, vertical_chunk_size=self._stream_chunk_size(
            vertical_chunk_size), runtime=self._runtime(), normalize=normalize_embeddings)
        prefix, _ = special_ids(self.tokenizer)
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
            prefix = prefix + text_ids(self.tokenizer, prompt, add_special_tokens=False)["input_ids"]
        rows = []
        with tqdm(unit="section", desc="embedding sections",
                  disable=(None if show_progress_bar is None else not show_progress_bar)) as bar:
            for i, section in enumerate(sections):
                if not isinstance(section, str):
                    raise TypeError(f"section {i} is a {type(section).__name__}, not a string")
                ids = text_ids(self.tokenizer, section, add_special_tokens=False)["input_ids"]
                if not ids:
                    raise ValueError(f"section {i} is empty (no tokens): every section needs at least one token")
                check_token_ids([ids], self.vocab_size)
                stream.feed((prefix if i == 0 else []) + list(ids))
                stream.flush()
                rows.append(np.asarray(stream.embedding([self.eos_token_id]), np.float32))
                bar.update(1)
        if not rows:
            raise ValueError("no sections to embed (the list is empty)")
        out = np.stack(rows)
        _check_finite(out, np.arange(len(rows)), len(rows), stream.tokens)
        return out

    def encode_id_sections(self, sections: Iterable[Sequence[int]], *, normalize_embeddings: bool = True,
                           vertical_chunk_size: int | str | None = "auto") -> np.ndarray:
        """`encode_sections` for token-id sections used as given: row i embeds sections 0..i + [EOS]."""
        from jaxembed.stream import embed_section_stream

        check_bool("normalize_embeddings", normalize_embeddings)
        out = embed_section_stream(self.params, self.config, sections, self.eos_token_id,
                             vertical_chunk_size=self._stream_chunk_size(vertical_chunk_size),
                             chunk_size=self.chunk_size, normalize=normalize_embeddings, kernels=self.kernels)
        return np.asarray(out, np.float32)

    def _stream_chunk_size(self, vertical_chunk_size) -> int | None:
        """V for streams and sections ("auto": the batch-1 default; None: horizontal, one pass at the end)."""
        if not self.family.VERTICAL:
            raise ValueError(f"{self.config.architecture} models have no constant-size state: they cannot stream "
                             "or fork states")
        return self.resolve_vertical_chunk_size(vertical_chunk_size, 1)

    def _runtime(self):
        from jaxembed.runtime import Runtime

        return Runtime(self.chunk_size, self.kernels)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "this embedder has no tokenizer: pass tokenizer=... to jaxembed.load (a path, a hub id or a "
                "transformers tokenizer), or use encode_ids with token ids"
            )

    @staticmethod
    def similarity(a, b) -> np.ndarray:
        """Cosine similarity matrix [n, m] (accepts [d] or [n, d] arrays)."""
        a, b = np.atleast_2d(np.asarray(a, np.float32)), np.atleast_2d(np.asarray(b, np.float32))
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
            raise ValueError(f"similarity takes [d] or [n, d] embeddings of one d, got shapes {a.shape} and {b.shape}")
        a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
        b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
        return a @ b.T

    # ---- ids --------------------------------------------------------------------------
    def resolve_vertical_chunk_size(self, vertical_chunk_size, batch_size: int) -> int | None:
        if isinstance(vertical_chunk_size, str):
            if vertical_chunk_size != "auto":
                raise ValueError(f"vertical_chunk_size must be 'auto', None or an int, got {vertical_chunk_size!r}")
            if not self.family.VERTICAL:
                return None  # attention: horizontal only
            return default_vertical_chunk_size(batch_size, self.chunk_size)
        check_chunk_sizes(vertical_chunk_size, self.chunk_size)
        _check_vertical(self.config, vertical_chunk_size)  # whatever the lengths: short batches never reach V
        return None if vertical_chunk_size is None else int(vertical_chunk_size)

    def encode_ids(
        self,
        ids: Sequence[Sequence[int]],
        *,
        normalize_embeddings: bool = True,
        vertical_chunk_size: int | None | str = "auto",
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        max_tokens_per_batch: int | None = None,
        precision: str = "float32",
        truncate_dim: int | None = None,
        ranges: np.ndarray | None = None,
        calibration_embeddings: np.ndarray | None = None,
    ) -> np.ndarray:
        """Embed token-id sequences used exactly as given (no EOS added): row i is the
        final-norm output at the last token of ids[i]. Returns float32 [n, d].

        Output options, applied in sentence-transformers' order (truncate, normalise, quantise):
        truncate_dim: keep the first truncate_dim dimensions (Matryoshka), re-normalised with normalize_embeddings.
        precision: "float32", "int8", "uint8", "binary" or "ubinary" (`jaxembed.quantize.quantize_embeddings`).
        For int8/uint8 the per-dimension buckets come from `ranges` ([2, dim]: minima, maxima), else from
        `calibration_embeddings` ([m, dim] float embeddings of a representative set, with the same truncate_dim),
        else, as in sentence-transformers, from this call's own embeddings: then the values depend on the batch
        (a warning below 100 embeddings; one embedding is an error), so pass ranges for anything stored or compared.
        """
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_tokens_per_batch", max_tokens_per_batch, optional=True)
        check_bool("normalize_embeddings", normalize_embeddings)
        seqs = check_token_ids(ids, self.vocab_size)
        output = dict(precision=precision, truncate_dim=truncate_dim, ranges=ranges,
                      calibration_embeddings=calibration_embeddings)
        check_output_options(self.embedding_dim, rows=len(seqs), **output)
        if not seqs:
            self.last_stats = {"texts": 0, "tokens": 0, "seconds": 0.0, "tokens_per_second": 0.0, "batches": 0}
            return self._output(np.empty((0, self.embedding_dim), np.float32), normalize_embeddings, **output)
        self.resolve_vertical_chunk_size(vertical_chunk_size, 1)  # a bad V is an error before any work
        budget = max_tokens_per_batch if max_tokens_per_batch is not None else self.max_tokens_per_batch
        lengths = np.array([len(s) for s in seqs])
        out = np.empty((len(seqs), self.embedding_dim), np.float32)
        batches = make_batches(lengths, batch_size, budget, self.chunk_size)
        total_tokens = int(lengths.sum())
        start = time.perf_counter()
        with tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="embedding",
                  disable=(None if show_progress_bar is None else not show_progress_bar)) as bar:
            # One batch in flight: batch k+1 is padded and dispatched (JAX dispatches asynchronously)
            # before batch k is read back, so the host's work overlaps the device's.
            in_flight = None
            for rows, padded_len, n_rows in batches:
                batch = np.zeros((n_rows, padded_len), np.int32)
                batch_lengths = np.ones(n_rows, np.int32)
                for j, i in enumerate(rows):
                    batch[j, : lengths[i]] = seqs[i]
                    batch_lengths[j] = lengths[i]
                emb = self._embed_batch(batch, batch_lengths, vertical_chunk_size, normalize_embeddings)
                if in_flight is not None:
                    self._read_back(out, *in_flight, lengths, bar)
                in_flight = (emb, rows, n_rows, padded_len)
            self._read_back(out, *in_flight, lengths, bar)
        elapsed = time.perf_counter() - start
        self.last_stats = {"texts": len(seqs), "tokens": total_tokens, "seconds": elapsed,
                           "tokens_per_second": total_tokens / max(elapsed, 1e-9), "batches": len(batches)}
        return self._output(out, normalize_embeddings, **output)

    @staticmethod
    def _read_back(out, emb, rows, n_rows, padded_len, lengths, bar):
        out[rows] = np.asarray(emb, np.float32)[: len(rows)]  # sliced on the host: no program per batch size
        _check_finite(out[rows], rows, n_rows, padded_len)
        bar.update(int(lengths[rows].sum()))

    @staticmethod
    def _output(out, normalize, *, precision, truncate_dim, ranges, calibration_embeddings) -> np.ndarray:
        """Truncate (re-normalising: the same as normalising after truncation), then quantise."""
        if truncate_dim is not None:
            out = truncate_embeddings(out, truncate_dim, normalize=normalize)
        if precision == "float32":
            return out
        return quantize_embeddings(out, precision, ranges=ranges, calibration_embeddings=calibration_embeddings)


def _prefixed(prompt: str, pieces: Iterable[str]) -> Iterator[str]:
    yield prompt
    yield from pieces


def _check_finite(embeddings, rows, n_rows: int, padded_len: int):
    """A NaN or inf embedding would poison a whole index silently: stop and name the inputs."""
    bad = ~np.isfinite(embeddings).all(axis=1)
    if bad.any():
        raise FloatingPointError(
            f"the embeddings of {int(bad.sum())} of {len(rows)} inputs are not finite (input indices "
            f"{rows[bad][:8].tolist()}, batch of {n_rows} x {padded_len} tokens): check the weights "
            f"(NaN or inf parameters) and the dtype (bfloat16/float16 overflow); on the CPU see jaxembed/xla_cpu.py")
