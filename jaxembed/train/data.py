"""Training triples (query, positive, hard negatives) read through Hugging Face `datasets`, and the batch plan.

One record per line of a ``.jsonl``/``.json`` file (a JSON array of records in a ``.json`` file works too) or
one row of a ``.parquet`` file::

    {"query": str, "positive": str, "negatives": [str, ...] (optional: none), "instruction": str (optional),
     "source": str (optional)}

``source`` defaults to the file's stem and ``instruction`` to ``""`` (the trainer applies its per-source default
when empty). Other fields are ignored. `load_triples` returns one `datasets.Dataset` per source plus a
`DataReport` of what was dropped; `plan_batches` gives an epoch's batches, each drawn from a single source.

Malformed input raises `DataError` naming the file, the 1-based line (jsonl) or row (parquet) and what is wrong.
The fast path parses with `datasets` (pyarrow); when that fails or the columns have the wrong types, the file
is re-scanned record by record to name the first bad one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxembed.errors import DataError, check_positive_int
from jaxembed.text import lone_surrogate

if TYPE_CHECKING:  # `datasets` is imported lazily: plan_batches and the report do not need it
    import datasets

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ALLOWED_SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES
COLUMNS = ("query", "positive", "negatives", "instruction", "source")
_REQUIRED = ("query", "positive")  # negatives may be left out: none (in-batch negatives only, or `jaxembed mine`)
_OPTIONAL = ("instruction", "source")
_PLAN_ORDER_TAG = 0x6F726472  # "ordr": keeps the batch-order stream apart from every per-source stream


@dataclasses.dataclass
class DataReport:
    """What `load_triples` read, kept and dropped (per source where it matters)."""

    rows: int = 0
    kept: int = 0
    dropped_empty: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped_few_negatives: dict[str, int] = dataclasses.field(default_factory=dict)
    unused_negatives: int = 0
    negatives_per_query: int = 1
    kept_by_source: dict[str, int] = dataclasses.field(default_factory=dict)

    def summary(self, unused_because: str = "negatives_per_query is 0") -> str:
        def by_source(counts: dict[str, int]) -> str:
            return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))

        k = self.negatives_per_query
        parts = [f"read {self.rows} rows, kept {self.kept}"]
        if self.kept_by_source:
            parts[0] += f" ({by_source(self.kept_by_source)})"
        empty, few = sum(self.dropped_empty.values()), sum(self.dropped_few_negatives.values())
        if empty:
            parts.append(f"dropped {empty} with an empty query/positive/negative ({by_source(self.dropped_empty)})")
        if few:
            parts.append(f"dropped {few} with fewer than {k} negatives ({by_source(self.dropped_few_negatives)})")
        if self.unused_negatives:
            parts.append(f"{self.unused_negatives} rows had more than {k} negatives (the first {k} used)" if k else
                         f"{self.unused_negatives} rows had negatives, unused ({unused_because})")
        return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# load_triples


def load_triples(
    files: str | os.PathLike | Sequence[str | os.PathLike], *, negatives_per_query: int = 1
) -> tuple[dict[str, datasets.Dataset], DataReport]:
    """Read training triples from .jsonl/.json/.parquet files: one `datasets.Dataset` per source, and a report.

    Each dataset has the columns query, positive, negatives (exactly `negatives_per_query`, the first ones of
    the record), instruction and source, rows in file order (files in the order given) after dropping records
    whose query, positive or any of the first `negatives_per_query` negatives is empty after ``strip()`` and
    records with fewer than `negatives_per_query` negatives. The dict is sorted by source name; sources left
    with no row are absent.
    """
    import datasets

    if isinstance(negatives_per_query, bool) or not isinstance(negatives_per_query, int) or negatives_per_query < 0:
        raise DataError(f"negatives_per_query must be an int >= 0, got {negatives_per_query!r}")
    k = negatives_per_query
    paths = _as_paths(files)
    report = DataReport(negatives_per_query=k)
    columns: dict[str, dict[str, list]] = {}
    for path in paths:
        for rec in _read_records(path):
            source = rec["source"]
            report.rows += 1
            # only the negatives used count: a blank one past the first k (or any, with k = 0) drops nothing
            used = rec["negatives"][:k]
            if not rec["query"].strip() or not rec["positive"].strip() or any(not n.strip() for n in used):
                report.dropped_empty[source] = report.dropped_empty.get(source, 0) + 1
                continue
            if len(rec["negatives"]) < k:
                report.dropped_few_negatives[source] = report.dropped_few_negatives.get(source, 0) + 1
                continue
            if len(rec["negatives"]) > k:
                report.unused_negatives += 1
            rec["negatives"] = list(rec["negatives"][:k])
            cols = columns.setdefault(source, {c: [] for c in COLUMNS})
            for c in COLUMNS:
                cols[c].append(rec[c])
    report.kept = sum(len(cols["query"]) for cols in columns.values())
    report.kept_by_source = {s: len(columns[s]["query"]) for s in sorted(columns)}
    report.dropped_empty = dict(sorted(report.dropped_empty.items()))
    report.dropped_few_negatives = dict(sorted(report.dropped_few_negatives.items()))
    if not report.kept:
        raise DataError(f"no usable rows (query, positive and enough negatives) in {', '.join(map(str, paths))}: "
                        f"{report.summary()}")
    features = datasets.Features({
        "query": datasets.Value("string"),
        "positive": datasets.Value("string"),
        "negatives": datasets.List(datasets.Value("string")),
        "instruction": datasets.Value("string"),
        "source": datasets.Value("string"),
    })
    out = {s: datasets.Dataset.from_dict(columns[s], features=features) for s in sorted(columns)}
    return out, report


def _as_paths(files) -> list[Path]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    try:
        paths = [Path(f) for f in files]
    except TypeError as e:
        raise DataError(f"files must be a path or a list of paths, got {files!r}") from e
    if not paths:
        raise DataError("no training data files given")
    for p in paths:
        if p.suffix.lower() not in ALLOWED_SUFFIXES:
            raise DataError(
                f"{p}: unsupported file type {p.suffix or '(no suffix)'!r}; allowed: {', '.join(ALLOWED_SUFFIXES)}"
            )
        if not p.exists():
            raise DataError(f"{p}: no such file")
        if not p.is_file():
            raise DataError(f"{p}: not a file")
    return paths


def _read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Validated records of one file (only the known fields, defaults filled in), in file order."""
    records = _fast_records(path)
    if records is None:  # the fast path failed or found something wrong: find and name the first bad record
        records = _scan_records(path)
    return iter(records)


@contextlib.contextmanager
def quiet_datasets():
    """No progress bars or error logs from `datasets` while it parses (failures are reported as DataError)."""
    import datasets
    from datasets.utils import logging as ds_logging

    bars_were_disabled = datasets.are_progress_bars_disabled()
    verbosity = ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if not bars_were_disabled:
            datasets.enable_progress_bars()


def _fast_records(path: Path) -> list[dict[str, Any]] | None:
    """Parse with `datasets`; None when that fails or any record breaks the schema (then `_scan_records`)."""
    import datasets
    import pyarrow as pa

    suffix = path.suffix.lower()
    try:
        # A fresh cache dir per call and in-memory tables: nothing is served stale when a file changes.
        with quiet_datasets(), tempfile.TemporaryDirectory(prefix="jaxembed-data-") as cache_dir:
            if suffix in PARQUET_SUFFIXES:
                ds = datasets.Dataset.from_parquet(str(path), cache_dir=cache_dir, keep_in_memory=True)
            else:
                ds = datasets.Dataset.from_json(str(path), cache_dir=cache_dir, keep_in_memory=True)
            table = ds.data.table if hasattr(ds.data, "table") else ds.data
    except Exception:  # any parse failure is diagnosed by the record-by-record scan
        return None

    schema = table.schema
    names = set(schema.names)
    if any(c not in names for c in _REQUIRED):
        return None

    def is_str(t):
        return pa.types.is_string(t) or pa.types.is_large_string(t)

    def is_str_list(t):
        return (pa.types.is_list(t) or pa.types.is_large_list(t)) and (
            is_str(t.value_type) or pa.types.is_null(t.value_type)
        )

    if not (is_str(schema.field("query").type) and is_str(schema.field("positive").type)):
        return None
    if "negatives" in names and not is_str_list(schema.field("negatives").type):
        return None
    for c in _OPTIONAL:
        if c in names and not (is_str(schema.field(c).type) or pa.types.is_null(schema.field(c).type)):
            return None

    n = table.num_rows
    try:  # pyarrow keeps bytes that are not UTF-8 in a string column; they fail only here
        cols = {c: table.column(c).to_pylist() if c in names else [None] * n for c in COLUMNS}
    except UnicodeDecodeError:
        return None  # the record-by-record scan names the file and line
    if "negatives" not in names:
        cols["negatives"] = [[] for _ in range(n)]
    stem = path.stem
    records = []
    for q, p, negs, ins, src in zip(*(cols[c] for c in COLUMNS), strict=True):
        if q is None or p is None or negs is None or any(x is None for x in negs):
            return None
        records.append({"query": q, "positive": p, "negatives": negs,
                        "instruction": ins or "", "source": src or stem})
    return records


def read_raw_records(path: Path) -> tuple[list[dict], list[int] | None]:
    """(records, the line of each) of a triples file, with every field (`mine` and `eval --local-tasks` keep
    fields the trainer drops), after the trainer's checks: a DataError naming the file and the first bad line.
    The lines are None for a JSON array or parquet."""
    path = Path(path)
    _scan_records(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist(), None
    text = path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is not part of the first record
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        return json.loads(text), None
    numbered = [(number, line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    return [json.loads(line) for _, line in numbered], [number for number, _ in numbered]


def _scan_records(path: Path) -> list[dict[str, Any]]:
    """Read and validate record by record with `json` / pyarrow; DataError at the first bad one."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise DataError(f"{path}: cannot read as parquet: {type(e).__name__}: {e}") from None
        return [_validate(row, path, f"row {i}") for i, row in enumerate(rows, 1)]

    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is not part of the first record
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: not valid UTF-8 ({e.reason})") from None

    if suffix == ".json" and text.lstrip().startswith("["):  # a JSON array of records
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        return [_validate(row, path, f"record {i}") for i, row in enumerate(rows, 1)]

    records = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        records.append(_validate(row, path, f"line {lineno}"))
    return records


def _type_name(value) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__)


def _validate(row, path: Path, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{path}: {where}: expected a JSON object with query/positive (and negatives), got "
                        f"{_type_name(row)}")
    for c in _REQUIRED:
        if c not in row:
            raise DataError(f"{path}: {where}: missing field {c!r}")
    for c in ("query", "positive"):
        if not isinstance(row[c], str):
            raise DataError(f"{path}: {where}: field {c!r} must be a string, got {_type_name(row[c])}")
    negs = row.get("negatives", [])
    if not isinstance(negs, (list, tuple)):
        raise DataError(f"{path}: {where}: field 'negatives' must be a list of strings, got {_type_name(negs)}")
    for i, n in enumerate(negs):
        if not isinstance(n, str):
            raise DataError(f"{path}: {where}: negatives[{i}] must be a string, got {_type_name(n)}")
    for c in _OPTIONAL:
        if row.get(c) is not None and not isinstance(row[c], str):
            raise DataError(f"{path}: {where}: field {c!r} must be a string when given, got {_type_name(row[c])}")
    for name, text in [("query", row["query"]), ("positive", row["positive"]),
                       *((f"negatives[{i}]", n) for i, n in enumerate(negs)),
                       *((c, row[c]) for c in _OPTIONAL if row.get(c) is not None)]:
        problem = lone_surrogate(text)
        if problem:
            raise DataError(f"{path}: {where}: field {name!r} {problem}")
    return {"query": row["query"], "positive": row["positive"], "negatives": list(negs),
            "instruction": row.get("instruction") or "", "source": row.get("source") or path.stem}


# ---------------------------------------------------------------------------------------------------------
# plan_batches


def _check_plan_args(sizes: dict[str, int], batch_size: int) -> list[tuple[str, int]]:
    check_positive_int("batch_size", batch_size, error=DataError)
    if not sizes:
        raise DataError("no sources to plan batches from (sizes is empty)")
    items = []
    for name, n in sizes.items():
        if not isinstance(name, str):
            raise DataError(f"source names must be strings, got {name!r}")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise DataError(f"size of source {name!r} must be an int >= 0, got {n!r}")
        items.append((name, int(n)))
    return sorted(items)


def leftover(sizes: dict[str, int], batch_size: int) -> dict[str, int]:
    """Rows per source that `plan_batches` leaves out each epoch (the incomplete last batch; all of a source
    smaller than `batch_size`). Sorted by source name."""
    return {name: n % batch_size if n >= batch_size else n for name, n in _check_plan_args(sizes, batch_size)}


def plan_batches(sizes: dict[str, int], batch_size: int, *, seed: int, epoch: int = 0) -> list[tuple[str, np.ndarray]]:
    """The epoch's batches: ``[(source, row_indices[batch_size] int64), ...]``.

    Each source's rows are permuted with a generator seeded from (seed, epoch, crc32 of the source name) and
    cut into full batches (an incomplete last batch is left out; see `leftover`). The batches of all sources
    are then put in a seeded uniformly random order, so every full batch is used exactly once per epoch and
    each step draws from a source with probability proportional to its remaining batches. Sources are sorted
    by name first, so the plan depends only on (sizes, batch_size, seed, epoch), not on dict order, process or
    machine (numpy's PCG64 + SeedSequence).
    """
    items = _check_plan_args(sizes, batch_size)
    for name, value in (("seed", seed), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise DataError(f"{name} must be an int >= 0, got {value!r}")
    if all(n < batch_size for _, n in items):
        raise DataError(
            f"batch_size {batch_size} is larger than every source "
            f"({', '.join(f'{name}: {n} rows' for name, n in items)}); lower batch_size or add data"
        )
    batches: list[tuple[str, np.ndarray]] = []
    for name, n in items:
        n_batches = n // batch_size
        if not n_batches:
            continue
        rng = np.random.default_rng([int(seed), int(epoch), zlib.crc32(name.encode("utf-8"))])
        perm = rng.permutation(n).astype(np.int64)[: n_batches * batch_size].reshape(n_batches, batch_size)
        batches.extend((name, perm[i]) for i in range(n_batches))
    order = np.random.default_rng([int(seed), int(epoch), _PLAN_ORDER_TAG]).permutation(len(batches))
    return [batches[i] for i in order]


__all__ = ["ALLOWED_SUFFIXES", "DataError", "DataReport", "leftover", "load_triples", "plan_batches"]

