"""Token ids for training, computed once: every text of every source tokenized by `datasets.map` into a
cached Arrow file, then batches gathered from flat int32 arrays with numpy (no tokenizer in the loop).

The cache file's name is a hash of everything the ids depend on: the rows' texts, the tokenizer (its
full serialisation), EOS, `max_tokens`, the query template and the source's default instruction. A cache
file is therefore only ever read for exactly the data it was made from; `datasets` writes it to a
temporary file and renames it, so a killed run leaves no partial cache behind. A digest of its bytes is
written beside it (`.xxh3`): a file changed since (a flipped bit, a truncated copy) is tokenized again, not
read as ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from jaxembed.errors import DataError
from jaxembed.files import write_text_atomically
from jaxembed.text import bucket_length, cut_ids, tokenize_texts, tokenizer_identity

CACHE_FORMAT = 2  # bump when the cached columns change (2: special-token strings in text are text, `text_ids`)


@dataclasses.dataclass(frozen=True)
class TokenColumn:
    """One text role of a source: text i is ``values[starts[i] : starts[i] + lengths[i]]`` (EOS included)."""

    values: np.ndarray  # [total tokens] int32
    starts: np.ndarray  # [texts] int64
    lengths: np.ndarray  # [texts] int32

    def padded(self, rows: np.ndarray, length: int) -> np.ndarray:
        """[len(rows), length] int32, zero-padded on the right."""
        lengths = self.lengths[rows]
        cols = np.arange(length)
        real = cols < lengths[:, None]
        index = np.where(real, self.starts[rows][:, None] + cols, 0)
        return np.where(real, self.values[index], 0).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class TokenizedSource:
    """A source's token ids: queries and positives (one text per row), negatives (k per row, row-major)."""

    query: TokenColumn
    positive: TokenColumn
    negatives: TokenColumn
    truncated: np.ndarray  # [rows] int32: texts of the row cut to max_tokens
    negatives_per_query: int
    fingerprint: str
    # the key the same ids had when every source's key held all sources' instructions (before 2026-11-28):
    # a checkpoint recorded with it resumes
    legacy_fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.truncated)

    def text_lengths(self, rows) -> np.ndarray:
        """The lengths of the rows' texts in the step's order: queries, positives, then negatives
        (query-major)."""
        rows = np.asarray(rows, np.int64)
        k = self.negatives_per_query
        neg_rows = (rows[:, None] * k + np.arange(k)).reshape(-1)
        return np.concatenate([self.query.lengths[rows], self.positive.lengths[rows], self.negatives.lengths[neg_rows]])

    def batch(self, rows, chunk_size: int, length: int = 0) -> tuple[dict[str, np.ndarray], int, int]:
        """(arrays for `BATCH_KEYS` padded to one length bucket, or to `length` if longer, real tokens,
        texts truncated) of `rows`."""
        rows = np.asarray(rows, np.int64)
        b, k = len(rows), self.negatives_per_query
        neg_rows = (rows[:, None] * k + np.arange(k)).reshape(-1)
        lengths = [self.query.lengths[rows], self.positive.lengths[rows], self.negatives.lengths[neg_rows]]
        longest = max(int(x.max()) for x in lengths if x.size)
        L = max(bucket_length(longest, chunk_size), length)
        arrays = {
            "query_ids": self.query.padded(rows, L), "query_len": lengths[0],
            "pos_ids": self.positive.padded(rows, L), "pos_len": lengths[1],
            "neg_ids": self.negatives.padded(neg_rows, L).reshape(b, k, L), "neg_len": lengths[2].reshape(b, k),
        }
        return arrays, int(sum(int(x.sum()) for x in lengths)), int(self.truncated[rows].sum())


def _rows_hash(ds) -> str:
    """Every text and negatives list with its length first: no two different sets of rows hash alike by
    moving a separator character between texts (texts may hold any character)."""
    h = xxhash.xxh3_128()

    def text(value: str) -> None:
        data = value.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    for batch in ds.iter(batch_size=4096):
        for column in ("query", "positive", "instruction"):
            for value in batch[column]:
                text(value)
        for negatives in batch["negatives"]:
            h.update(len(negatives).to_bytes(8, "little"))
            for negative in negatives:
                text(negative)
    return h.hexdigest()


def tokenize_sources(
    sources: dict,
    *,
    tokenizer,
    eos: int,
    max_tokens: int,
    query_text: Callable[[str, str, str], str],
    settings: Callable[[str], dict],
    cache_dir: str | os.PathLike,
    negatives_per_query: int,
    show_progress: bool = True,
    legacy_settings: dict | None = None,
) -> dict[str, TokenizedSource]:
    """Tokenize every source once (``datasets.map(batched=True)``, cached in `cache_dir`).

    `query_text(instruction, query, source)` gives a query's full text; `settings(source)` is what that depends on
    besides the row (the template, the source's default instruction) and goes into the source's cache key, so
    changing one source's instruction re-tokenizes that source alone.
    """
    import datasets

    from jaxembed.train.data import quiet_datasets

    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tok_id = tokenizer_identity(tokenizer)[:32]
    features = datasets.Features({
        "query_ids": datasets.LargeList(datasets.Value("int32")),
        "positive_ids": datasets.LargeList(datasets.Value("int32")),
        "negatives_ids": datasets.LargeList(datasets.LargeList(datasets.Value("int32"))),
        "truncated": datasets.Value("int32"),
    })
    out = {}
    for source, ds in sources.items():
        rows_hash = _rows_hash(ds)

        def cache_key(what: dict, source=source, rows_hash=rows_hash) -> str:
            return hashlib.sha256(repr((CACHE_FORMAT, source, rows_hash, tok_id, eos, max_tokens,
                                        sorted(what.items()))).encode("utf-8")).hexdigest()[:32]

        key = cache_key(settings(source))

        cache_file = cache_dir / f"tokens-{key}.arrow"
        digest_file = cache_file.with_name(cache_file.name + ".xxh3")
        _drop_if_changed(cache_file, digest_file)

        def encode(batch, source=source):
            queries = [query_text(i, q, source) for q, i in zip(batch["query"], batch["instruction"], strict=True)]
            flat_negatives = [n for negs in batch["negatives"] for n in negs]
            full, _ = tokenize_texts(tokenizer, queries + batch["positive"] + flat_negatives, eos)
            pairs = [cut_ids(x, max_tokens, eos) for x in full]
            ids, cut = [x for x, _ in pairs], [c for _, c in pairs]
            b, k = len(queries), negatives_per_query
            per_row_cut = np.array(cut[:b], np.int32) + np.array(cut[b: 2 * b], np.int32)
            if k:
                per_row_cut += np.array(cut[2 * b:], np.int32).reshape(b, k).sum(axis=1)
            return {"query_ids": ids[:b], "positive_ids": ids[b: 2 * b],
                    "negatives_ids": [ids[2 * b + i * k: 2 * b + (i + 1) * k] for i in range(b)],
                    "truncated": per_row_cut.tolist()}

        try:
            with contextlib.nullcontext() if show_progress else quiet_datasets():
                mapped = ds.map(encode, batched=True, batch_size=1000, remove_columns=ds.column_names,
                                features=features, cache_file_name=str(cache_file), new_fingerprint=key,
                                desc=f"tokenizing {source}")
        except (OSError, ValueError) as err:  # Arrow's reading errors say nothing of which file
            if not cache_file.exists():
                raise
            raise DataError(f"{cache_file}: a token cache that cannot be read ({type(err).__name__}: "
                            f"{str(err)[:160]}); delete it to tokenize again") from None
        if len(mapped) != len(ds):  # the cache file is named by its content; a mismatch means it is damaged
            raise DataError(f"{cache_file}: {len(mapped)} rows for {len(ds)}; delete it to tokenize again")
        if not digest_file.exists():  # written once, from the file as datasets left it
            write_text_atomically(digest_file, _file_digest(cache_file) + "\n")
        out[source] = dataclasses.replace(
            _columns(mapped, negatives_per_query, key),
            legacy_fingerprint=None if legacy_settings is None else cache_key(legacy_settings))
    return out


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _drop_if_changed(cache_file: Path, digest_file: Path) -> None:
    """A cache file whose bytes differ from the digest written with it is removed (with its digest), so it is
    made again. One without a digest (an older jaxembed's, or one another process is finishing) is left."""
    if not (cache_file.exists() and digest_file.exists()):
        return
    if digest_file.read_text().strip() != _file_digest(cache_file):
        warnings.warn(f"{cache_file}: its bytes differ from the digest written with it (damaged); tokenizing "
                      "again", UserWarning, stacklevel=3)
        cache_file.unlink(missing_ok=True)
        digest_file.unlink(missing_ok=True)


def _list_column(array) -> TokenColumn:
    """A (large) list<int32> Arrow array as flat values + starts + lengths (zero-copy where Arrow allows)."""
    offsets = np.asarray(array.offsets, np.int64)
    return TokenColumn(np.asarray(array.values, np.int32), offsets[:-1], np.diff(offsets).astype(np.int32))


def _columns(mapped, k: int, fingerprint: str) -> TokenizedSource:
    table = mapped.with_format("arrow")[:]
    column = {name: table.column(name).combine_chunks() for name in table.column_names}
    negatives = column["negatives_ids"]
    # every row holds exactly k negatives, so the inner lists are the negatives in row-major order
    inner = negatives.values.slice(int(negatives.offsets[0].as_py()), len(mapped) * k)
    return TokenizedSource(_list_column(column["query_ids"]), _list_column(column["positive_ids"]),
                           _list_column(inner), np.asarray(column["truncated"], np.int32), k, fingerprint)


__all__ = ["TokenColumn", "TokenizedSource", "tokenize_sources"]
