"""The public encode API: tokenizer, prompts, length buckets, batching, pooling.

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

import numbers
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxembed import models
from jaxembed.kernels import check_backend
from jaxembed.schedule import check_chunk_sizes, embed

QUERY_TEMPLATE = "Instruction: {prompt}\nQuery: "  # Section 3.1; E5 models use "Instruct: {prompt}\nQuery: "
DEFAULT_SINGLE_SEQUENCE_V = 4096  # Appendix F: batch 1 saturates around V = 4096
MIN_BUCKET = 16
# bucket lengths above Q are Q times one of these: few programs, bounded padding
_MULTIPLIERS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


# One module-level jit: equal configs hash equal, so every Embedder of a model shares compiled programs.
embed_jit = jax.jit(embed, static_argnums=1, static_argnames=("vertical_chunk_size", "chunk_size", "normalize", "kernels"))


def default_vertical_chunk_size(batch_size: int, chunk_size: int) -> int:
    """Appendix F: V = 2Q for batched inference; for one sequence, a large V (about 4096)."""
    if batch_size <= 1:
        return max(chunk_size, -(-DEFAULT_SINGLE_SEQUENCE_V // chunk_size) * chunk_size)
    return 2 * chunk_size


def bucket_length(n: int, chunk_size: int) -> int:
    """The padded length for a batch whose longest sequence has n tokens.

    Powers of two up to Q, then Q times 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, ...: a
    corpus of mixed lengths compiles O(log(max length / Q)) programs, and a batch is padded by
    at most 2x, 1.5x beyond 2Q and 1.25x beyond 32Q (the chunked SSD computes in whole chunks
    of Q anyway). Vertical inference runs the t % V tail as a shorter chunk, so no bucket is
    rounded up to a multiple of V.
    """
    if n <= chunk_size:
        return min(chunk_size, max(MIN_BUCKET, 1 << max(0, n - 1).bit_length()))
    units = -(-n // chunk_size)
    for m in _MULTIPLIERS:
        if m >= units:
            return m * chunk_size
    step = 1 << max(0, (units // 4).bit_length() - 1)  # beyond the table: multiples of 2^k, waste < 25%
    return -(-units // step) * step * chunk_size


def _batch_bucket(n: int, max_rows: int) -> int:
    """Pad the batch dimension to a power of two (at most max_rows): few programs, < 2x waste."""
    return min(max_rows, 1 << max(0, n - 1).bit_length())


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
    ):
        self.config = config
        self.kernels = check_backend(kernels)
        self.family = models.family(config)
        chunk_size = config.chunk_size if chunk_size is None else chunk_size
        check_chunk_sizes(None, chunk_size)
        self.chunk_size = int(chunk_size)
        self.params = _to_device(params, dtype, getattr(self.family, "FLOAT32_PARAMS", ()))
        self.tokenizer = tokenizer
        if "{prompt}" not in query_template:
            raise ValueError(f"query_template must contain '{{prompt}}', got {query_template!r}")
        self.query_template = query_template
        self.default_instruction = default_instruction
        _check_positive_int("max_tokens_per_batch", max_tokens_per_batch, optional=True)
        self.max_tokens_per_batch = max_tokens_per_batch
        self.last_stats: dict = {}

    # ---- properties -------------------------------------------------------------------
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
        if self.tokenizer is None:
            raise ValueError(
                "this embedder has no tokenizer: pass tokenizer=... to jaxembed.load (a path, a hub id or a "
                "transformers tokenizer), or use encode_ids with token ids"
            )
        _check_positive_int("max_length", max_length, optional=True)
        out, truncated = tokenize_texts(self.tokenizer, texts, self.eos_token_id, max_length)
        if truncated:
            warnings.warn(f"max_length={max_length}: truncated {truncated} of {len(out)} texts (counted in "
                          f"last_stats['truncated'])", stacklevel=3)
        return out, truncated

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
    ) -> np.ndarray:
        """Embed texts: [n, d] float32 (or [d] for a single string).

        prompt: a literal prefix for every text (e.g. the output of `query_prompt`).
        vertical_chunk_size: "auto" (Appendix F), None (horizontal) or V, a multiple of Q.
        max_tokens_per_batch: cap on padded tokens per batch (default: the embedder's).
        """
        single = isinstance(texts, str)
        texts = [texts] if single else _check_texts(texts)
        if not texts:
            return np.empty((0, self.embedding_dim), np.float32)
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
            texts = [prompt + t for t in texts]
        ids, truncated = self._tokenize(texts, max_length)
        out = self.encode_ids(
            ids,
            normalize_embeddings=normalize_embeddings,
            vertical_chunk_size=vertical_chunk_size,
            batch_size=batch_size,
            show_progress_bar=show_progress_bar,
            max_tokens_per_batch=max_tokens_per_batch,
        )
        self.last_stats["truncated"] = truncated
        if not convert_to_numpy:
            out = jnp.asarray(out)
        return out[0] if single else out

    def query_prompt(self, instruction: str | None = None) -> str:
        """The query prefix: the template filled with the instruction ("" if there is none)."""
        instruction = instruction if instruction is not None else self.default_instruction
        return "" if instruction is None else self.query_template.format(prompt=instruction)

    def encode_query(self, texts, instruction: str | None = None, **kwargs) -> np.ndarray:
        """Queries get the instruction template (Section 3.1); `prompt=` overrides it verbatim."""
        kwargs.setdefault("prompt", self.query_prompt(instruction) or None)
        return self.encode(texts, **kwargs)

    def encode_document(self, texts, **kwargs) -> np.ndarray:
        """Documents are embedded without instruction, so a corpus is embedded once for all tasks."""
        return self.encode(texts, **kwargs)

    @staticmethod
    def similarity(a, b) -> np.ndarray:
        """Cosine similarity matrix [n, m] (accepts [d] or [n, d] arrays)."""
        a, b = np.atleast_2d(np.asarray(a, np.float32)), np.atleast_2d(np.asarray(b, np.float32))
        a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
        b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
        return a @ b.T

    # ---- ids --------------------------------------------------------------------------
    def resolve_vertical_chunk_size(self, vertical_chunk_size, batch_size: int) -> int | None:
        if isinstance(vertical_chunk_size, str):
            if vertical_chunk_size != "auto":
                raise ValueError(f"vertical_chunk_size must be 'auto', None or an int, got {vertical_chunk_size!r}")
            if not getattr(self.family, "VERTICAL", True):
                return None  # attention: horizontal only
            return default_vertical_chunk_size(batch_size, self.chunk_size)
        check_chunk_sizes(vertical_chunk_size, self.chunk_size)
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
    ) -> np.ndarray:
        """Embed token-id sequences used exactly as given (no EOS added): row i is the
        final-norm output at the last token of ids[i]. Returns float32 [n, d]."""
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("max_tokens_per_batch", max_tokens_per_batch, optional=True)
        seqs = _check_ids(ids, self.vocab_size)
        if not seqs:
            return np.empty((0, self.embedding_dim), np.float32)
        # Appendix F's policy depends on how many sequences run together, not on the batch_size cap
        V = self.resolve_vertical_chunk_size(vertical_chunk_size, min(batch_size, len(seqs)))
        budget = max_tokens_per_batch if max_tokens_per_batch is not None else self.max_tokens_per_batch
        lengths = np.array([len(s) for s in seqs])
        order = np.argsort(-lengths, kind="stable")
        out = np.empty((len(seqs), self.embedding_dim), np.float32)
        batches = _make_batches(order, lengths, batch_size, budget, lambda n: bucket_length(n, self.chunk_size))
        total_tokens = int(lengths.sum())
        start = time.perf_counter()
        with tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="embedding",
                  disable=(None if show_progress_bar is None else not show_progress_bar)) as bar:
            for rows, padded_len, max_rows in batches:
                n_rows = _batch_bucket(len(rows), max_rows)
                batch = np.zeros((n_rows, padded_len), np.int32)
                batch_lengths = np.ones(n_rows, np.int32)
                for j, i in enumerate(rows):
                    batch[j, : lengths[i]] = seqs[i]
                    batch_lengths[j] = lengths[i]
                emb = embed_jit(self.params, self.config, batch, batch_lengths, vertical_chunk_size=V,
                                chunk_size=self.chunk_size, normalize=normalize_embeddings, kernels=self.kernels)
                out[rows] = np.asarray(emb[: len(rows)], np.float32)
                _check_finite(out[rows], rows, n_rows, padded_len)
                bar.update(int(lengths[rows].sum()))
        elapsed = time.perf_counter() - start
        self.last_stats = {"texts": len(seqs), "tokens": total_tokens, "seconds": elapsed,
                           "tokens_per_second": total_tokens / max(elapsed, 1e-9), "batches": len(batches)}
        return out


def _check_finite(embeddings, rows, n_rows: int, padded_len: int):
    """A NaN or inf embedding would poison a whole index silently: stop and name the inputs."""
    bad = ~np.isfinite(embeddings).all(axis=1)
    if bad.any():
        raise FloatingPointError(
            f"the embeddings of {int(bad.sum())} of {len(rows)} inputs are not finite (input indices "
            f"{rows[bad][:8].tolist()}, batch of {n_rows} x {padded_len} tokens): check the weights "
            f"(NaN or inf parameters) and the dtype (bfloat16/float16 overflow); on the CPU see jaxembed/xla_cpu.py")


def tokenize_texts(tokenizer, texts, eos: int, max_length: int | None = None) -> tuple[list[list[int]], int]:
    """(token ids with EOS appended, number of texts cut to max_length). A cut text keeps its EOS."""
    encoded = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    out, truncated = [], 0
    for ids in encoded:
        ids = list(ids)
        if not ids or ids[-1] != eos:
            ids.append(eos)
        if max_length is not None and len(ids) > max_length:
            ids = ids[: max_length - 1] + [eos]
            truncated += 1
        out.append(ids)
    return out, truncated


def _make_batches(order, lengths, batch_size, budget, bucket):
    """Consecutive runs of the length-sorted order: at most batch_size rows and, with a budget,
    at most `budget` padded tokens (a longer single sequence still gets a batch of its own)."""
    batches, i = [], 0
    while i < len(order):
        padded = bucket(int(lengths[order[i]]))  # sorted descending: the first row is the longest
        n = batch_size
        if budget is not None:
            n = max(1, min(batch_size, budget // padded))
        rows = order[i : i + n]
        batches.append((rows, padded, n))
        i += n
    return batches


def _check_positive_int(name: str, value, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")


def _check_texts(texts) -> list[str]:
    if isinstance(texts, (bytes, bytearray)) or not hasattr(texts, "__iter__"):
        raise TypeError(f"texts must be a string or a sequence of strings, got {type(texts).__name__}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] is {type(t).__name__} ({t!r:.40}), not a string")
    return texts


def _check_ids(ids, vocab_size: int) -> list[np.ndarray]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"ids must be a sequence of token-id sequences, got {type(ids).__name__}")
    seqs = []
    for i, seq in enumerate(ids):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
            raise TypeError(f"ids[{i}] must be a sequence of ints, got {type(seq).__name__}")
        arr = np.asarray(seq)
        if arr.ndim != 1:
            raise ValueError(f"ids[{i}] must be one-dimensional, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"ids[{i}] is empty; every sequence needs at least one token (texts get EOS)")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"ids[{i}] must hold ints, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"ids[{i}][{j}] = {int(arr[j])} is out of the vocabulary range [0, {vocab_size})")
        seqs.append(arr.astype(np.int32))
    return seqs


def _to_device(params, dtype, keep_float32):
    """Params as jax arrays; with dtype, cast every floating leaf but the decay parameters."""
    if dtype is not None:
        dtype = jnp.dtype(dtype)
        if dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")

    def cast(path, leaf):
        name = str(getattr(path[-1], "key", ""))
        arr = jnp.asarray(leaf)
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            return arr
        if dtype is None:  # as stored, but float16 (overflow-prone in long recurrences) runs in float32
            return arr.astype(jnp.float32) if arr.dtype == jnp.float16 else arr
        return arr.astype(jnp.float32 if name in keep_float32 else dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def load_tokenizer(spec, directory: Path | None = None):
    """A transformers tokenizer from an object, a path or hub id, or the checkpoint directory."""
    if spec is not None and not isinstance(spec, (str, Path)):
        return spec
    from transformers import AutoTokenizer

    source = spec if spec is not None else directory
    if source is None:
        return None
    if spec is None and not any((Path(directory) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as err:
        raise ValueError(f"could not load a tokenizer from {source}: {err}") from None
