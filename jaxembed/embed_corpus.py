"""Corpus-scale encoding: `jaxembed embed --corpus FILE --output-dir DIR` (docs/corpus-encoding.md).

The corpus (.txt one text per line, .jsonl records with a text field and an optional id field, .parquet) is
read through Hugging Face `datasets` as a stream of Arrow tables of `shard_size` rows: shard s holds rows
[s * shard_size, (s + 1) * shard_size). No more than a few shards are in memory at a time, as token arrays.

DIR holds, per shard, `shard-00000.npy` (the embeddings of its rows, in corpus order) and, with an id field,
`shard-00000.ids.json` (their ids); `process-00000.json`, one per process, lists the shards that process
finished; `manifest.json`, written once every shard is there, lists them all with row ranges and sha256
checksums, under an identity (model fingerprint, corpus size and sha256, every option that changes the
numbers). Every file is written atomically, and a shard is listed only after its files are complete, so a run
killed at any point and started again with the same arguments redoes only the shards not listed: no gap, no
duplicate, and the same bytes as an uninterrupted run. A listed shard whose files no longer match their checksums
is recomputed. A run whose identity differs from the one DIR records is refused, unless `overwrite`.

Data parallel: each batch is split over the process's local devices (a one-axis `Mesh`, one jit, the batch
axis sharded, params replicated). Under `jax.distributed`, process p of P takes the shards s with s % P == p
and writes only their files and its own `process-p.json`; after a barrier, process 0 checks every shard and
writes `manifest.json`. Tokenizing and padding run in background threads ahead of the device (bounded queues),
and batch k is read back only after batch k+1 is dispatched.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import io
import json
import os
import queue
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxembed.distributed import check_processes_agree
from jaxembed.errors import DataError, check_positive_int
from jaxembed.files import write_atomically, write_text_atomically
from jaxembed.text import check_token_ids, lone_surrogate, make_batches, tokenize_texts, tokenizer_identity
from jaxembed.train.data import quiet_datasets

FORMATS = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
DEFAULT_SHARD_SIZE = 10_000
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "jaxembed-corpus-embeddings"
PROCESS_FORMAT = "jaxembed-corpus-process"
VERSION = 1
KILL_AFTER_SHARDS_ENV = "JAXEMBED_CORPUS_KILL_AFTER_SHARDS"  # tests: SIGKILL after writing the k-th shard's files
_TOKENIZE_CHUNK = 1024  # texts per tokenizer call: token lists become int32 arrays chunk by chunk
_SHARD_RE = re.compile(r"^\.?shard-(\d+)\.(npy|ids\.json)(\.tmp-.*)?$")
_PROCESS_RE = re.compile(r"^\.?process-(\d+)\.json(\.tmp-.*)?$")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def process_manifest_name(index: int) -> str:
    return f"process-{index:05d}.json"


# ---------------------------------------------------------------------------------------------------------
# the corpus


@dataclass(frozen=True)
class Corpus:
    """A checked corpus file: every record has a string text (and, with id_field, an int or string id)."""

    path: Path
    format: str  # "text", "jsonl" or "parquet"
    text_field: str
    id_field: str | None
    rows: int
    size: int
    sha256: str
    id_type: str | None = None  # "int" or "str"

    def identity(self) -> dict:
        """What makes the embeddings this corpus's (the path is recorded, not compared: a moved file is the same)."""
        return {"format": self.format, "size": self.size, "sha256": self.sha256, "rows": self.rows,
                "text_field": self.text_field, "id_field": self.id_field}

    def tables(self, rows_per_table: int) -> Iterator:
        """The corpus as pyarrow Tables of `rows_per_table` rows (the last may be shorter), columns "text" and,
        with an id field, "id", checked as they are read, through a streamed `datasets.IterableDataset`."""
        done = 0
        for table in _read_tables(self, rows_per_table):
            done += table.num_rows
            yield table
        if done != self.rows:
            raise DataError(f"{self.path}: read {done} records, expected {self.rows}: the file changed while it was "
                            "being embedded")


def open_corpus(path, *, text_field: str = "text", id_field: str | None = None) -> Corpus:
    """Check a corpus file through and count its records: a DataError names the first bad one by row (0-based,
    the numbering of the manifest's row ranges; jsonl errors give the line too)."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unsupported corpus file type {path.suffix or '(no suffix)'!r}; "
                        f"use {', '.join(FORMATS)}")
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    if not isinstance(text_field, str) or not text_field:
        raise DataError(f"text field must be a non-empty string, got {text_field!r}")
    if fmt == "text":
        if id_field is not None or text_field != "text":
            raise DataError(f"{path}: a .txt corpus has no fields (its records are its lines, numbered from 0): "
                            "--text-field / --id-field are for .jsonl and .parquet")
    if id_field is not None and (not isinstance(id_field, str) or not id_field or id_field == text_field):
        raise DataError(f"id field must be a non-empty string other than the text field, got {id_field!r}")
    size, digest = _hash_file(path, utf8=fmt != "parquet")
    corpus = Corpus(path.resolve(), fmt, text_field, id_field, rows=0, size=size, sha256=digest)
    if fmt == "parquet":
        _check_parquet_columns(corpus)
    rows, id_type, ids = 0, None, _IdTally()
    if fmt == "jsonl":  # the reader checks every record; the Arrow tables would need the id type first
        for record in _jsonl_records(corpus):
            rows += 1
            id_type = id_type or (_id_type(record["id"]) if id_field else None)
            if id_field:
                ids.add([record["id"]], rows - 1)
    else:
        for table in _read_tables(corpus, 8192):
            if id_field and id_type is None:
                id_type = "int" if _is_integer_type(table.column("id").type) else "str"
            if id_field:
                ids.add(table.column("id").to_pylist(), rows)
            rows += table.num_rows
    if rows == 0:
        raise DataError(f"{path}: no records to embed")
    ids.warn(path)
    return Corpus(corpus.path, fmt, text_field, id_field, rows=rows, size=size, sha256=digest, id_type=id_type)


class _IdTally:
    """Ids are kept as given, one per row; repeated ones would make an index built on them ambiguous: said."""

    def __init__(self):
        self.seen, self.repeated, self.first = set(), 0, None

    def add(self, ids: list, start: int) -> None:
        for row, rid in enumerate(ids, start):
            if rid in self.seen:
                self.repeated += 1
                self.first = self.first or (rid, row)
            self.seen.add(rid)

    def warn(self, path: Path) -> None:
        if self.repeated:
            rid, row = self.first
            warnings.warn(f"{path}: {self.repeated} row(s) repeat an earlier id (first: {rid!r} again at row "
                          f"{row}); every row is embedded and kept with its id", UserWarning, stacklevel=3)


def _is_integer_type(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(arrow_type)


def _read_tables(corpus: Corpus, rows_per_table: int) -> Iterator:
    dataset = _dataset(corpus)
    done = 0
    try:
        for table in dataset.with_format("arrow").iter(batch_size=rows_per_table):
            if corpus.format == "parquet":  # by name: datasets keeps the file's column order, not the one asked for
                table = table.select([corpus.text_field] + ([corpus.id_field] if corpus.id_field else []))
            table = table.rename_columns(["text", "id"][: table.num_columns])
            if done == 0 and corpus.format == "text":
                table = _without_byte_order_mark(table)
            _check_table(corpus, table, done)
            done += table.num_rows
            yield table
    except (DataError, KeyboardInterrupt):
        raise
    except Exception as err:  # a parse error the checks could not name, or a file that changed under us
        if done == 0 and corpus.format == "parquet" and _parquet_rows(corpus.path) == 0:
            raise DataError(f"{corpus.path}: no records to embed") from None
        raise DataError(f"{corpus.path}: cannot read record {done} onwards: {type(err).__name__}: {err}") from None


def _parquet_rows(path: Path) -> int | None:
    """The row count in a parquet file's footer (None if unreadable): datasets fails on an empty file."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:
        return None


def _without_byte_order_mark(table):
    """A .txt corpus's first table with a leading UTF-8 byte-order mark taken off its first line (datasets'
    text reader keeps it; a .jsonl corpus's json.loads never sees one)."""
    first = table.column("text")[0].as_py() if table.num_rows else None
    if not first or not first.startswith("\ufeff"):
        return table
    import pyarrow as pa

    texts = table.column("text").to_pylist()
    texts[0] = first[1:]
    return table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts, table.column("text").type))


def _hash_file(path: Path, *, utf8: bool) -> tuple[int, str]:
    """(size, sha256) of the file's bytes; for text formats, an error naming the line if it is not UTF-8."""
    digest, size = hashlib.sha256(), 0
    decoder = codecs.getincrementaldecoder("utf-8")() if utf8 else None
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            size += len(block)
            if decoder is not None:
                try:
                    decoder.decode(block)
                except UnicodeDecodeError:
                    _raise_utf8_error(path)
    if decoder is not None:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            _raise_utf8_error(path)
    return size, digest.hexdigest()


def _raise_utf8_error(path: Path):
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {lineno}: not valid UTF-8 (byte 0x{line[e.start]:02x} at column "
                                f"{e.start + 1})") from None
    raise DataError(f"{path}: ends inside a UTF-8 character")


def _json_type(value) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean",
                                         int: "number", float: "number"}.get(type(value), type(value).__name__)


def _id_type(value) -> str:
    return "str" if isinstance(value, str) else "int"


def _jsonl_records(corpus: Corpus) -> Iterator[dict]:
    """{"text", "id"} per record, checked; blank lines are skipped (as `datasets` does)."""
    id_type, row = corpus.id_type, 0
    with open(corpus.path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{corpus.path}, line {lineno} (row {row})"
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                raise DataError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {_json_type(record)}")
            if corpus.text_field not in record:
                raise DataError(f"{where}: no field {corpus.text_field!r} (fields: {', '.join(map(repr, record))})")
            text = record[corpus.text_field]
            if not isinstance(text, str):
                raise DataError(f"{where}: field {corpus.text_field!r} is {_json_type(text)} ({text!r:.40}), "
                                "not a string")
            if problem := lone_surrogate(text):
                raise DataError(f"{where}: field {corpus.text_field!r} {problem}")
            out = {"text": text}
            if corpus.id_field is not None:
                if corpus.id_field not in record:
                    raise DataError(f"{where}: no id field {corpus.id_field!r}")
                rid = record[corpus.id_field]
                if not isinstance(rid, (str, int)) or isinstance(rid, bool):
                    raise DataError(f"{where}: id field {corpus.id_field!r} is {_json_type(rid)} ({rid!r:.40}); "
                                    "ids must be strings or integers")
                if isinstance(rid, int) and not -2**63 <= rid < 2**63:
                    raise DataError(f"{where}: id {rid} does not fit int64 (ids are stored as int64; write large "
                                    "ids as strings)")
                if isinstance(rid, str) and (problem := lone_surrogate(rid)):
                    raise DataError(f"{where}: id {problem}")
                if id_type is None:
                    id_type = _id_type(rid)
                elif _id_type(rid) != id_type:
                    raise DataError(f"{where}: id {rid!r} is a{'n integer' if id_type == 'str' else ' string'}, but "
                                    f"the first record's id is a{' string' if id_type == 'str' else 'n integer'}: "
                                    "use one type")
                out["id"] = rid
            row += 1
            yield out


def _check_parquet_columns(corpus: Corpus) -> None:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(corpus.path).names
    except Exception as err:
        raise DataError(f"{corpus.path}: cannot read as parquet: {err}") from None
    for kind, name in (("text", corpus.text_field), ("id", corpus.id_field)):
        if name is not None and name not in names:
            raise DataError(f"{corpus.path}: no {kind} column {name!r} (columns: {', '.join(map(repr, names))})")


def _dataset(corpus: Corpus):
    """A streamed `datasets.IterableDataset` of the corpus, columns (text[, id]) in that order.

    jsonl goes through `IterableDataset.from_generator` over `json.loads` of each line, not the `json` builder:
    that builder casts each 10 MB block to the first block's types (a number where text is expected would
    become the string "5") and, on a parse error, re-reads the whole file with pandas."""
    import datasets

    with quiet_datasets():
        if corpus.format == "jsonl":
            id_feature = {"id": datasets.Value("string" if corpus.id_type == "str" else "int64")} \
                if corpus.id_field else {}
            features = datasets.Features({"text": datasets.Value("string"), **id_feature})
            return datasets.IterableDataset.from_generator(_jsonl_generator, features=features,
                                                           gen_kwargs={"corpus": corpus})
        kwargs = {}
        if corpus.format == "parquet":
            kwargs["columns"] = [corpus.text_field] + ([corpus.id_field] if corpus.id_field else [])
        return datasets.load_dataset(corpus.format, data_files=[str(corpus.path)], split="train", streaming=True,
                                     **kwargs)


def _jsonl_generator(corpus: Corpus):
    yield from _jsonl_records(corpus)


def _check_table(corpus: Corpus, table, start: int) -> None:
    """Texts are strings and ids ints or strings, none null (parquet; jsonl records are checked as read)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if corpus.format == "jsonl":
        return
    checks = [("text", corpus.text_field, (pa.types.is_string, pa.types.is_large_string), "a string")]
    if corpus.id_field is not None:
        checks.append(("id", corpus.id_field, (pa.types.is_integer, pa.types.is_string, pa.types.is_large_string),
                       "an integer or a string"))
    for column, name, types, wanted in checks:
        values = table.column(column)
        if not any(t(values.type) for t in types):
            valid = pc.drop_null(values)
            first = int(pc.index(pc.is_valid(values), True).as_py()) if len(valid) else 0
            value = valid[0].as_py() if len(valid) else None
            raise DataError(f"{corpus.path}, row {start + first}: field {name!r} is {values.type} ({value!r:.40}), "
                            f"not {wanted}")
        if values.null_count:
            first = int(pc.index(pc.is_null(values), True).as_py())
            raise DataError(f"{corpus.path}, row {start + first}: field {name!r} is null")
        limit = 2**63 - 1  # as in jsonl, ids are int64 or strings: a uint64 column may hold more
        if column == "id" and pa.types.is_uint64(values.type) and len(values) and pc.max(values).as_py() > limit:
            first, value = next((i, v) for i, v in enumerate(values.to_pylist()) if v > limit)
            raise DataError(f"{corpus.path}, row {start + first}: id {value} does not fit int64")
    if corpus.id_field is not None and corpus.id_type is not None:
        kind = "int" if pa.types.is_integer(table.column("id").type) else "str"
        if kind != corpus.id_type:
            raise DataError(f"{corpus.path}, row {start}: ids change type from {corpus.id_type} to {kind}")


# ---------------------------------------------------------------------------------------------------------
# the output directory


def run_identity(model, corpus: Corpus, *, prompt, normalize, max_length, batch_size, max_tokens_per_batch,
                 vertical_chunk_size, shard_size, precision, truncate_dim, ranges) -> dict:
    """Everything that decides the bytes of the shards: a directory holding another identity is never reused."""
    import jax

    options = {"prompt": prompt, **_model_free_options(normalize, max_length, batch_size, shard_size, precision,
                                                      truncate_dim, ranges),
               "max_tokens_per_batch": max_tokens_per_batch, "vertical_chunk_size": vertical_chunk_size}
    model_identity = {
        "fingerprint": model.fingerprint, "architecture": model.config.architecture,
        "chunk_size": model.chunk_size, "kernels": model.kernels,
        "param_dtypes": sorted({str(leaf.dtype) for leaf in jax.tree.leaves(model.params)}),
        "eos_token_id": model.eos_token_id,
        "tokenizer_sha256": tokenizer_identity(model.tokenizer),  # its rules, and how text is read
    }
    return json.loads(json.dumps({"model": model_identity, "corpus": corpus.identity(), "options": options}))


def _model_free_options(normalize, max_length, batch_size, shard_size, precision, truncate_dim, ranges) -> dict:
    """The options of the identity known before the model is loaded."""
    return {"normalize": bool(normalize), "max_length": max_length, "batch_size": batch_size, "shard_size": shard_size,
            "precision": precision, "truncate_dim": truncate_dim,
            "ranges_sha256": None if ranges is None else hashlib.sha256(
                np.ascontiguousarray(ranges, np.float32).tobytes()).hexdigest()}


def _differences(old, new, prefix="", *, partial=False) -> list[str]:
    """'key.path (there: old, now: new)' for each difference (partial: only the keys of `new`)."""
    if isinstance(new, dict) and (isinstance(old, dict) or partial):
        old = old if isinstance(old, dict) else {}
        out = []
        for key in (new if partial else sorted(set(old) | set(new), key=str)):
            out += _differences(old.get(key), new.get(key), f"{prefix}{key}.", partial=partial)
        return out
    return [] if old == new else [f"{prefix[:-1]} (there: {_short(old)}, now: {_short(new)})"]


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 24 else text[:21] + "..."


def _ours(name: str) -> bool:
    return bool(_SHARD_RE.match(name) or _PROCESS_RE.match(name)) or name.lstrip(".").startswith(MANIFEST)


def _read_manifests(out: Path) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(out.iterdir()):
        if path.name == MANIFEST or (_PROCESS_RE.match(path.name) and not path.name.startswith(".")):
            try:
                manifest = json.loads(path.read_text(encoding="utf-8"))
                if manifest.get("format") not in (MANIFEST_FORMAT, PROCESS_FORMAT):
                    raise ValueError(f"format {manifest.get('format')!r}")
            except (ValueError, AttributeError) as err:
                raise DataError(f"{path}: not a jaxembed corpus manifest ({err}); remove it, or pass --overwrite"
                                ) from None
            found.append((path.name, manifest))
    return found


def check_directory(out: Path, identity: dict, *, partial: bool = False) -> dict[int, list[dict]]:
    """Refuse a DIR that holds another run's embeddings (or files that are not ours); the shards already finished
    there, by index: each one's distinct entries in the manifests (a shard recomputed after damage is listed
    anew while an older manifest keeps its old entry). partial: compare only the parts of the identity given
    (before the model is loaded)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"--output-dir {out} is a file; name a directory")
    if not out.exists():
        return {}
    manifests = _read_manifests(out)
    if not manifests:
        foreign = sorted(p.name for p in out.iterdir() if not _ours(p.name))
        if foreign:
            names = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise DataError(f"--output-dir {out} is not empty ({names}) and holds no corpus embeddings: choose a new "
                            "or empty directory, or pass --overwrite")
    done: dict[int, list[dict]] = {}
    for name, manifest in manifests:
        diffs = _differences(manifest.get("identity"), identity, partial=partial)
        if diffs:
            raise DataError(f"--output-dir {out} holds the embeddings of another run ({name}): "
                            f"{'; '.join(diffs[:6])}{'; ...' if len(diffs) > 6 else ''}. Use a new directory, or "
                            "pass --overwrite to replace them")
        for entry in manifest.get("shards", []):
            candidates = done.setdefault(int(entry["index"]), [])
            if entry not in candidates:
                candidates.append(entry)
    return done


def _shard_files(entry: dict) -> list[tuple[str, str]]:
    """(file name, recorded sha256) of each file of a shard entry."""
    return [(entry[key], entry.get(digest_key)) for key, digest_key in (("ids", "ids_sha256"),
                                                                        ("embeddings", "sha256")) if key in entry]


def _shard_problem(out: Path, entry: dict, known: dict[str, str]) -> str | None:
    """Why the shard's files do not match its entry (missing, or another checksum), or None. known: digests this
    process has already computed (file name -> sha256), so no file is hashed twice in one run."""
    for name, digest in _shard_files(entry):
        now = known[name] if name in known else _file_sha256(out / name)
        if now != digest:
            changed = "has changed since it was written (checksum differs)"
            return f"{out / name} {'is missing' if now is None else changed}"
    return None


def _usable_entry(out: Path, candidates: list[dict], known: dict[str, str]) -> tuple[dict | None, str | None]:
    """The first entry whose files are intact (and record their digests in known), else (None, the problem)."""
    problem = None
    for entry in candidates:
        problem = _shard_problem(out, entry, known)
        if problem is None:
            known.update(_shard_files(entry))
            return entry, None
    return None, problem


def _prepare_directory(out: Path, identity: dict, process: int, processes: int,
                       overwrite: bool) -> dict[int, list[dict]]:
    """Check (or, with overwrite, clear) DIR for this run; the shards already finished (`check_directory`)."""
    done = {} if overwrite else check_directory(out, identity)
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise DataError(f"--output-dir {out} is not writable")
    for path in out.iterdir():  # what this process owns: its shards, its manifest; process 0 also the merged one
        shard, proc = _SHARD_RE.match(path.name), _PROCESS_RE.match(path.name)
        mine = ((shard and int(shard.group(1)) % processes == process)
                or (proc and (int(proc.group(1)) == process or (process == 0 and int(proc.group(1)) >= processes)))
                or (process == 0 and path.name.lstrip(".").startswith(MANIFEST)))
        temporary = ".tmp-" in path.name  # left by a kill in the middle of write_atomically
        if mine and (temporary or overwrite):
            path.unlink(missing_ok=True)
    return done


def _write_process_manifest(out: Path, identity: dict, process: int, processes: int, shards: dict[int, dict],
                            *, rows: int, n_shards: int, complete: bool, devices: list) -> None:
    import jax

    manifest = {"format": PROCESS_FORMAT, "version": VERSION, "identity": identity, "process_index": process,
                "process_count": processes, "rows": rows, "shard_count": n_shards, "complete": complete,
                "last_run": {"devices": len(devices), "platform": devices[0].platform, "jax": jax.__version__},
                "shards": [shards[s] for s in sorted(shards)]}
    write_text_atomically(out / process_manifest_name(process), json.dumps(manifest, indent=1) + "\n")


def _merge(out: Path, identity: dict, corpus: Corpus, shard_size: int, known: dict[str, str]) -> dict:
    """Every shard exactly once, with the rows and the checksums it was written with: then manifest.json."""
    n_shards = -(-corpus.rows // shard_size)
    listed: dict[int, list[dict]] = {}
    for name, manifest in _read_manifests(out):
        if _differences(manifest.get("identity"), identity):
            raise DataError(f"{out / name}: written by another run while this one ran; pass --overwrite")
        for entry in manifest.get("shards", []):
            candidates = listed.setdefault(int(entry["index"]), [])
            if entry not in candidates:
                candidates.append(entry)
    missing = [s for s in range(n_shards) if s not in listed]
    if missing:
        raise DataError(f"{out}: {len(missing)} of {n_shards} shards are missing (first: {missing[:8]}). With several "
                        "processes on several hosts, --output-dir must be on a filesystem they share; run the same "
                        "command again to finish")
    extra = sorted(set(listed) - set(range(n_shards)))
    if extra:
        raise DataError(f"{out}: shards {extra[:8]} are beyond the corpus's {n_shards} shards")
    entries: dict[int, dict] = {}
    for s in range(n_shards):
        entry, problem = _usable_entry(out, listed[s], known)
        if entry is None:
            raise DataError(f"{problem}; run the same command again to recompute that shard")
        expected = [s * shard_size, min((s + 1) * shard_size, corpus.rows)]
        if entry["rows"] != expected:
            raise DataError(f"{out}: shard {s} covers rows {entry['rows']}, expected {expected}")
        entries[s] = entry
    first = entries[0]
    manifest = {
        "format": MANIFEST_FORMAT, "version": VERSION, "identity": identity, "corpus_path": str(corpus.path),
        "rows": corpus.rows, "embedding_shape": [corpus.rows, first["shape"][1]], "embedding_dtype": first["dtype"],
        "ids": corpus.id_field is not None, "shard_size": shard_size, "shard_count": n_shards,
        "shards": [entries[s] for s in range(n_shards)],
    }
    write_text_atomically(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def _file_sha256(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
        return None


def load_corpus_embeddings(output_dir, *, verify: bool = True) -> tuple[np.ndarray, list | None]:
    """(embeddings [rows, dim] in corpus order, ids or None) from a finished output directory; with verify,
    every file is checked against the manifest's sha256 first."""
    out = Path(output_dir)
    path = out / MANIFEST
    if not path.is_file():
        raise DataError(f"{out}: no {MANIFEST} (the run has not finished: run the same command again)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        arrays, ids = [], [] if manifest.get("ids") else None
        for entry in manifest["shards"]:
            data = (out / entry["embeddings"]).read_bytes()
            if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise DataError(f"{out / entry['embeddings']}: checksum differs from the manifest's")
            arrays.append(np.load(io.BytesIO(data), allow_pickle=False))
            if ids is not None:
                raw = (out / entry["ids"]).read_bytes()
                if verify and hashlib.sha256(raw).hexdigest() != entry["ids_sha256"]:
                    raise DataError(f"{out / entry['ids']}: checksum differs from the manifest's")
                ids.extend(json.loads(raw))
    except DataError:
        raise
    except FileNotFoundError as err:  # a listed file removed: named, as the checksums' failures are
        raise DataError(f"{err.filename}: listed in {path} but missing") from None
    except (ValueError, KeyError, TypeError) as err:  # a manifest cut short or edited (JSONDecodeError: ValueError)
        raise DataError(f"{path}: not a readable manifest of a finished run ({type(err).__name__}: {err})") from None
    return np.concatenate(arrays), ids


# ---------------------------------------------------------------------------------------------------------
# the encode pipeline


@dataclass(eq=False)
class _Shard:
    index: int
    start: int
    ids: list | None
    seqs: list | None
    lengths: np.ndarray
    truncated: int
    out: np.ndarray | None = None
    pending: int = 0  # batches not read back yet

    @property
    def rows(self) -> int:
        return len(self.lengths)


@dataclass(eq=False)
class _Batch:
    shard: _Shard
    rows: np.ndarray  # positions in the shard
    ids: np.ndarray  # [n, t] int32, right-padded
    lengths: np.ndarray  # [n] int32


class _Background:
    """An iterator run in a daemon thread, its items handed over through a bounded queue (errors re-raised in the
    consumer); `close` stops it at its next item."""

    def __init__(self, iterator, maxsize: int, name: str):
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iterator,), name=name, daemon=True)
        self._thread.start()

    def _run(self, iterator):
        try:
            for item in iterator:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as err:  # handed to the consumer
            self._put(("error", err))

    def _put(self, message) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        while True:
            try:
                kind, value = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value

    def close(self):
        self._stop.set()


@functools.lru_cache(maxsize=None)
def _sharded_embed(mesh, config, vertical_chunk_size, chunk_size, normalize, kernels):
    """One jit per mesh and settings: the batch axis split over the mesh's devices, the params replicated."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxembed.schedule import embed

    def run(params, ids, lengths):
        return embed(params, config, ids, lengths, vertical_chunk_size=vertical_chunk_size, chunk_size=chunk_size,
                     normalize=normalize, kernels=kernels)

    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jax.jit(run, in_shardings=(replicated, rows, rows), out_shardings=rows)


def initialize_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """jax.distributed before any other JAX call: "auto" detects the cluster (SLURM, Open MPI, ...), else all three."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices (tests) talk over gloo
    if coordinator == "auto":
        jax.distributed.initialize()
        return
    if num_processes is None or process_id is None:
        raise ValueError("--coordinator needs --num-processes and --process-id (or --coordinator auto)")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def embed_corpus(model, corpus, output_dir, *, text_field: str = "text", id_field: str | None = None,
                 prompt: str | None = None, normalize_embeddings: bool = True, max_length: int | None = None,
                 batch_size: int = 32, max_tokens_per_batch: int | None = None,
                 vertical_chunk_size: int | None | str = "auto", shard_size: int = DEFAULT_SHARD_SIZE,
                 precision: str = "float32", truncate_dim: int | None = None, ranges=None, overwrite: bool = False,
                 show_progress_bar: bool | None = None, devices=None) -> dict:
    """Embed every record of `corpus` (a path, or a `Corpus` from `open_corpus`) into shards in `output_dir`,
    continuing a run of the same identity found there (see the module docstring). Returns this process's
    statistics; `manifest.json` is written by process 0 once all shards are there.

    prompt: a literal prefix for every text (e.g. `model.query_prompt(instruction)`). batch_size and
    max_tokens_per_batch are per step, over all local devices (a batch is padded to a multiple of the device
    count). precision / truncate_dim as in `Embedder.encode`; int8 / uint8 need `ranges` ([2, dim]), never taken
    from a shard's own embeddings (shards would then disagree). devices: the local devices to split batches over
    (default: all)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if not isinstance(corpus, Corpus):
        corpus = open_corpus(corpus, text_field=text_field, id_field=id_field)
    check_positive_int("batch_size", batch_size)
    check_positive_int("shard_size", shard_size)
    check_positive_int("max_length", max_length, optional=True)
    check_positive_int("max_tokens_per_batch", max_tokens_per_batch, optional=True)
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    if model.tokenizer is None:
        raise ValueError("this embedder has no tokenizer: pass tokenizer=... to jaxembed.load (--tokenizer)")
    if precision != "float32" or truncate_dim is not None or ranges is not None:
        from jaxembed.quantize import check_output_options

        _check_ranges_given(precision, ranges)
        check_output_options(model.embedding_dim, precision=precision, truncate_dim=truncate_dim, ranges=ranges)
        ranges = None if ranges is None else np.asarray(ranges, np.float32)
    budget = max_tokens_per_batch if max_tokens_per_batch is not None else model.max_tokens_per_batch
    V = model.resolve_vertical_chunk_size(vertical_chunk_size, batch_size)
    identity = run_identity(model, corpus, prompt=prompt, normalize=normalize_embeddings, max_length=max_length,
                            batch_size=batch_size, max_tokens_per_batch=budget, vertical_chunk_size=V,
                            shard_size=shard_size, precision=precision, truncate_dim=truncate_dim, ranges=ranges)
    out = Path(output_dir)
    process, processes = jax.process_index(), jax.process_count()
    if processes > 1:  # a process with other options would write shards unlike the others' (found at the merge)
        check_processes_agree(_leaves(identity), error=DataError,
                              advice="give every process the same model, corpus and options")
    done = _prepare_directory(out, identity, process, processes, overwrite)
    if processes > 1:  # each reads every manifest before any rewrites its own (run earlier with other process counts,
        from jax.experimental import multihost_utils  # a manifest lists shards that other processes now own)

        multihost_utils.sync_global_devices("jaxembed embed --corpus: every process has read the manifests")
    n_shards = -(-corpus.rows // shard_size)
    known: dict[str, str] = {}  # file name -> sha256 computed in this run (checked at the start, or written)
    mine = {}
    for s in sorted(done):
        if s % processes == process:
            entry, problem = _usable_entry(out, done[s], known)
            if entry is None:  # damaged or removed since it was written: computed again, not trusted
                warnings.warn(f"{problem}: recomputing shard {s}", UserWarning, stacklevel=2)
            else:
                mine[s] = entry
    todo = [s for s in range(n_shards) if s % processes == process and s not in mine]
    devices = list(devices) if devices is not None else jax.local_devices()
    record = functools.partial(_write_process_manifest, out, identity, process, processes, mine, rows=corpus.rows,
                               n_shards=n_shards, devices=devices)
    record(complete=not todo)
    mesh = Mesh(np.array(devices), ("data",))
    fn = _sharded_embed(mesh, model.config, V, model.chunk_size, bool(normalize_embeddings), model.kernels)
    params = jax.device_put(model.params, NamedSharding(mesh, P()))
    split = NamedSharding(mesh, P("data"))  # placed explicitly: jax.distributed refuses numpy inputs to a sharded jit
    stats = {"rows": 0, "tokens": 0, "truncated": 0, "shards_written": 0, "batches": 0, "input_wait_seconds": 0.0}
    kill_after = int(os.environ.get(KILL_AFTER_SHARDS_ENV) or 0)
    post = functools.partial(_postprocess, normalize=bool(normalize_embeddings), precision=precision,
                             truncate_dim=truncate_dim, ranges=ranges)

    def finish(shard: _Shard):
        _check_finite(shard, corpus)
        entry = _write_shard(out, shard, post(shard.out))
        known.update(_shard_files(entry))
        stats["shards_written"] += 1
        if kill_after and stats["shards_written"] == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # tests: the files are written, the manifest does not list them yet
        mine[shard.index] = entry
        record(complete=len(mine) == len(range(process, n_shards, processes)))
        shard.out = None

    def collect(batch: _Batch, result):
        shard = batch.shard
        shard.out[batch.rows] = np.asarray(result)[: len(batch.rows)]
        shard.pending -= 1
        bar.update(len(batch.rows))
        if shard.pending == 0:
            finish(shard)

    rows_todo = sum(min(shard_size, corpus.rows - s * shard_size) for s in todo)
    show = (None if show_progress_bar is None else not show_progress_bar)
    tokenized = _Background(_tokenized_shards(corpus, model, todo, shard_size, prompt, max_length, stats), 1,
                            "jaxembed-tokenize")
    batches = _Background(_padded_batches(tokenized, model, batch_size, budget, len(devices)), 4, "jaxembed-pad")
    start = time.perf_counter()
    from tqdm import tqdm

    with tqdm(total=rows_todo, unit="text", desc="embedding corpus" + (f" [{process}]" if processes > 1 else ""),
              disable=show, position=process if processes > 1 else None) as bar:
        try:
            pending = None
            items = iter(batches)
            while True:
                wait = time.perf_counter()
                batch = next(items, None)
                stats["input_wait_seconds"] += time.perf_counter() - wait
                if batch is None:
                    break
                ids, lengths = jax.device_put((batch.ids, batch.lengths), split)
                result = fn(params, ids, lengths)  # dispatched: it runs while the previous batch is read back
                stats["batches"] += 1
                if pending is not None:
                    collect(*pending)
                pending = (batch, result)
            if pending is not None:
                collect(*pending)
        finally:
            batches.close()
            tokenized.close()
    stats["seconds"] = time.perf_counter() - start
    stats["tokens_per_second"] = stats["tokens"] / max(stats["seconds"], 1e-9)
    record(complete=True)
    if processes > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxembed embed --corpus: every process has written its shards")
    if process == 0:
        _, now = _hash_file(corpus.path, utf8=False)
        if now != corpus.sha256:
            raise DataError(f"{corpus.path} changed while it was being embedded (sha256 differs): pass --overwrite "
                            "to start again")
        manifest = _merge(out, identity, corpus, shard_size, known)
        stats["manifest"] = str(out / MANIFEST)
        stats["shard_count"] = manifest["shard_count"]
    stats.update(process_index=process, process_count=processes, devices=len(devices), corpus_rows=corpus.rows)
    return stats


def _leaves(tree, prefix="") -> dict[str, str]:
    if isinstance(tree, dict):
        return {k: v for key in sorted(tree, key=str) for k, v in _leaves(tree[key], f"{prefix}{key}.").items()}
    return {prefix[:-1]: json.dumps(tree, sort_keys=True)}


def _check_ranges_given(precision, ranges) -> None:
    if precision in ("int8", "uint8") and ranges is None:
        raise ValueError(f"precision {precision} over a corpus needs ranges (--ranges or --calibration): ranges taken "
                         "from each shard's own embeddings would differ from shard to shard")


def _tokenized_shards(corpus: Corpus, model, todo: list[int], shard_size: int, prompt, max_length, stats):
    """The shards in `todo`, read and tokenized (EOS appended, cut to max_length) as int32 arrays."""
    wanted = set(todo)
    if not wanted:
        return
    last = max(wanted)
    tables = corpus.tables(shard_size)
    for index, table in enumerate(tables):
        if index in wanted:
            texts = table.column("text").to_pylist()
            ids = table.column("id").to_pylist() if corpus.id_field else None
            if prompt:
                texts = [prompt + t for t in texts]
            start, seqs, truncated = index * shard_size, [], 0
            for i in range(0, len(texts), _TOKENIZE_CHUNK):
                chunk, cut = tokenize_texts(model.tokenizer, texts[i: i + _TOKENIZE_CHUNK], model.eos_token_id,
                                            max_length)
                try:
                    seqs.extend(check_token_ids(chunk, model.vocab_size))
                except ValueError as err:
                    raise DataError(f"{corpus.path}, rows {start + i}..: the tokenizer's ids do not fit the model: "
                                    f"{err}") from None
                truncated += cut
            lengths = np.array([len(s) for s in seqs], np.int64)
            stats["tokens"] += int(lengths.sum())
            stats["truncated"] += truncated
            stats["rows"] += len(seqs)
            yield _Shard(index, start, ids, seqs, lengths, truncated)
        if index == last:
            tables.close()  # the rest of the corpus belongs to other processes, or is done
            return


def _padded_batches(shards, model, batch_size: int, budget, n_devices: int):
    """Each shard's rows cut into padded batches (`make_batches`, as `encode_ids` does), the row count then
    padded to a multiple of the device count."""
    for shard in shards:
        plan = make_batches(shard.lengths, batch_size, budget, model.chunk_size)
        shard.out = np.empty((shard.rows, model.embedding_dim), np.float32)
        shard.pending = len(plan)
        for rows, padded_len, n_rows in plan:
            n_rows = -(-n_rows // n_devices) * n_devices
            ids = np.zeros((n_rows, padded_len), np.int32)
            lengths = np.ones(n_rows, np.int32)
            for j, i in enumerate(rows):
                ids[j, : shard.lengths[i]] = shard.seqs[i]
                lengths[j] = shard.lengths[i]
            yield _Batch(shard, rows, ids, lengths)
        shard.seqs = None


def _check_finite(shard: _Shard, corpus: Corpus) -> None:
    """A NaN or inf embedding would poison an index silently: stop and name the records."""
    bad = np.flatnonzero(~np.isfinite(shard.out).all(axis=1))
    if bad.size:
        rows = (shard.start + bad[:8]).tolist()
        raise FloatingPointError(
            f"the embeddings of {bad.size} records of {corpus.path} are not finite (rows {rows}): check the weights "
            "(NaN or inf parameters) and the dtype (bfloat16 overflow); on the CPU see jaxembed/xla_cpu.py")


def _postprocess(embeddings, *, normalize, precision, truncate_dim, ranges) -> np.ndarray:
    """truncate_dim and precision as `Embedder.encode` applies them (jaxembed.quantize)."""
    if truncate_dim is None and precision == "float32":
        return embeddings
    from jaxembed.quantize import quantize_embeddings, truncate_embeddings

    if truncate_dim is not None:
        embeddings = truncate_embeddings(embeddings, truncate_dim, normalize=normalize)
    return quantize_embeddings(embeddings, precision, ranges=ranges)


def _write_shard(out: Path, shard: _Shard, embeddings: np.ndarray) -> dict:
    """The shard's files, each atomically (ids first: the embeddings file completes the shard), and its entry."""
    name = shard_name(shard.index)
    entry = {"index": shard.index, "rows": [shard.start, shard.start + shard.rows],
             "shape": list(embeddings.shape), "dtype": str(embeddings.dtype),
             "tokens": int(shard.lengths.sum()), "truncated": int(shard.truncated)}
    if shard.ids is not None:
        data = json.dumps(shard.ids).encode("utf-8")
        write_atomically(out / f"{name}.ids.json", lambda f: f.write(data))
        entry["ids"], entry["ids_sha256"] = f"{name}.ids.json", hashlib.sha256(data).hexdigest()
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(embeddings), allow_pickle=False)
    data = buffer.getvalue()
    write_atomically(out / f"{name}.npy", lambda f: f.write(data))
    entry["embeddings"], entry["sha256"] = f"{name}.npy", hashlib.sha256(data).hexdigest()
    return entry


# ---------------------------------------------------------------------------------------------------------
# the command line (`jaxembed embed --corpus ...`)


def add_arguments(p) -> None:
    """The corpus flags of `jaxembed embed` (the model, batching and output flags are the command's own)."""
    g = p.add_argument_group("corpus encoding (docs/corpus-encoding.md)")
    g.add_argument("--corpus", type=Path, default=None, metavar="FILE",
                   help="embed a corpus (.txt one text per line, .jsonl, .parquet) into sharded files in --output-dir; "
                        "a killed run started again with the same arguments continues")
    g.add_argument("--output-dir", type=Path, default=None, metavar="DIR",
                   help="--corpus: shard-*.npy (+ shard-*.ids.json), process-*.json and manifest.json")
    g.add_argument("--text-field", default="text", help="--corpus .jsonl / .parquet: the text field (default: text)")
    g.add_argument("--id-field", default=None, help="--corpus .jsonl / .parquet: an id field, kept beside the "
                                                    "embeddings (default: none; rows are numbered from 0)")
    g.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="--corpus: records per shard file")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="--corpus under jax.distributed: the coordinator (process 0's address), or 'auto'")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


def cmd_embed_corpus(args) -> int:
    if args.corpus is None or args.output_dir is None:
        raise ValueError("--corpus FILE and --output-dir DIR go together")
    given = [flag for flag, value in (("input files", args.inputs), ("--output", args.output),
                                      ("--stream", args.stream), ("--sections", args.sections)) if value]
    if given:
        raise ValueError(f"--corpus writes into --output-dir: do not pass {', '.join(given)}")
    check_positive_int("--shard-size", args.shard_size)
    if args.coordinator is not None:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    elif args.num_processes is not None or args.process_id is not None:
        raise ValueError("--num-processes / --process-id go with --coordinator HOST:PORT")
    corpus = open_corpus(args.corpus, text_field=args.text_field, id_field=args.id_field)  # before loading the model

    import jaxembed

    precision, truncate_dim = getattr(args, "precision", "float32"), getattr(args, "truncate_dim", None)
    ranges = _ranges(args)
    _check_ranges_given(precision, ranges)
    if not args.overwrite:  # refuse another run's directory before the model is loaded (all of it is checked later)
        check_directory(args.output_dir, json.loads(json.dumps({"corpus": corpus.identity(), "options": (
            _model_free_options(not args.no_normalize, args.max_length, args.batch_size, args.shard_size, precision,
                                truncate_dim, None if ranges is None else np.asarray(ranges, np.float32)))})),
                        partial=True)
    model = jaxembed.load(args.model, dtype=args.dtype, tokenizer=args.tokenizer)
    prompt = (model.query_prompt(args.instruction) or None) if args.query else None
    stats = embed_corpus(model, corpus, args.output_dir, prompt=prompt, normalize_embeddings=not args.no_normalize,
                         max_length=args.max_length, batch_size=args.batch_size,
                         max_tokens_per_batch=args.max_tokens_per_batch, vertical_chunk_size=args.vertical_chunk_size,
                         shard_size=args.shard_size, precision=precision, truncate_dim=truncate_dim, ranges=ranges,
                         overwrite=args.overwrite, show_progress_bar=not args.quiet)
    who = f"process {stats['process_index']} of {stats['process_count']}: " if stats["process_count"] > 1 else ""
    if not stats["shards_written"]:
        print(f"{who}no shard left to embed: {args.output_dir} has them all", file=sys.stderr)
    else:
        print(f"{who}embedded {stats['rows']} texts ({stats['shards_written']} shards), {stats['tokens']} tokens in "
              f"{stats['seconds']:.2f} s ({stats['tokens_per_second']:.0f} tokens/s on {stats['devices']} device(s), "
              f"{stats['input_wait_seconds']:.2f} s waiting for input)", file=sys.stderr)
    if stats["truncated"]:
        print(f"max_length={args.max_length}: truncated {stats['truncated']} texts", file=sys.stderr)
    if "manifest" in stats:
        print(f"{stats['corpus_rows']} records in {stats['shard_count']} shards: {stats['manifest']}", file=sys.stderr)
    return 0


def _ranges(args):
    """--ranges FILE.npy, or the ranges of --calibration FILE.npy (int8 / uint8 precision)."""
    ranges_path, calibration_path = getattr(args, "ranges", None), getattr(args, "calibration", None)
    if ranges_path is not None and calibration_path is not None:
        raise ValueError("--ranges and --calibration are two ways to set the int8/uint8 buckets: give one")
    path = ranges_path or calibration_path
    if path is None:
        return None
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise ValueError(f"{path}: not a .npy array ({err})") from None
    if calibration_path is not None:
        from jaxembed.quantize import calibration_ranges

        return calibration_ranges(array)
    return array
