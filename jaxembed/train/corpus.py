"""Real code-search corpora from the Python sources on this machine.

Every function or method with a docstring becomes one record: the query is the docstring's summary (its
first paragraph, whitespace-normalised) and the positive is the function's source with its docstring, and
those of the functions and classes defined inside it, removed. Records are deduplicated before the split
(positives compared after collapsing whitespace, queries also after lower-casing and dropping markup quotes
and end punctuation), so no near-copy of a training record is held out. Hard negatives are other functions
of the same module, never one that contains the record's function or is contained in it. The split is by
top-level module (a package), so no held-out package is seen in training; both files are built and checked
before either is written.

- ``stdlib``: the CPython standard library (about 3k records on Python 3.11).
- ``packages``: the standard library and every regular package (a directory with ``__init__.py``, or a
  module file) on ``sys.path`` (about 59k records with this project's dev install); a top-level name found
  in two places is taken from the first, as imports do. Namespace packages (no ``__init__.py``, e.g.
  ``google``, ``orbax``) are not read; their names are counted and listed in the result.

The output depends only on the sources and the arguments, and is byte-identical across runs::

    python -m jaxembed.train.corpus OUT_DIR [--kind stdlib|packages] [--heldout-fraction F] [--seed S]
        [--negatives K] [--max-per-module N]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import sysconfig
import time
import tokenize
import warnings
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from jaxembed.files import write_text_atomically

SOURCE = "stdlib-code"
PACKAGES_SOURCE = "python-code"
INSTRUCTION = "Given a docstring summary, retrieve the Python function that implements it"
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages",
                       "__pycache__"})
MIN_SUMMARY_WORDS = 4
MIN_BODY_STATEMENTS = 2  # stdlib; the packages corpus takes one-statement bodies too (still >= MIN_BODY_CHARS)
MIN_BODY_CHARS = 40
# A first paragraph that is docstring markup, not a summary: a field list, a section header, a doctest (which
# names the function), a numpydoc underline.
MARKUP_SUMMARY = re.compile(r"^(?:[:@](?:param|type|arg|rtype|returns?|raises?)\b|(?:Args|Arguments|Parameters|Returns|"
                            r"Yields|Raises|Examples?|Notes?)\s*[:\-]|>>>|\w+ -{3,})")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def package_roots() -> list[Path]:
    """The standard library, then every other directory of sys.path that holds packages, in import order."""
    roots = [stdlib_dir().resolve()]
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if path.is_dir() and path not in roots and path.name in ("site-packages", "dist-packages"):
            roots.append(path)
    return roots


def _module_files(root: Path, modules: Iterable[str] | None,
                  namespace_packages: set[str] | None = None) -> list[tuple[str, Path]]:
    """(top-level module name, file) for every .py file of the regular packages and modules under `root`,
    sorted. The names of namespace packages (identifier directories holding .py files but no __init__.py)
    are added to `namespace_packages`, which are not read."""
    wanted = None if modules is None else set(modules)
    out: list[tuple[str, Path]] = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.is_file() and entry.suffix == ".py" and entry.stem.isidentifier():
            if wanted is None or entry.stem in wanted:
                out.append((entry.stem, entry))
        elif (entry.is_dir() and entry.name.isidentifier() and entry.name not in SKIP_DIRS
              and (wanted is None or entry.name in wanted)):
            if not (entry / "__init__.py").is_file():
                if namespace_packages is not None and next(entry.rglob("*.py"), None) is not None:
                    namespace_packages.add(entry.name)
                continue
            for dirpath, dirnames, filenames in os.walk(entry):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and d.isidentifier())
                out.extend((entry.name, Path(dirpath) / f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(out, key=lambda mf: (mf[0], mf[1].relative_to(root).as_posix()))


def _summary(doc: str) -> str:
    """The docstring's first paragraph, whitespace-normalised."""
    lines: list[str] = []
    for line in doc.strip().splitlines():
        if not line.strip():
            break
        lines.append(line)
    return " ".join(" ".join(lines).split())


def _split_lines(data: bytes) -> list[bytes]:
    """Lines with their ends, split only at \\r\\n, \\n and \\r as the tokenizer does (bytes.splitlines also
    splits at form feeds and other separators, which would shift the line numbers)."""
    return re.findall(rb"[^\r\n]*(?:\r\n|\n|\r|$)", data)[:-1] if data else []


def _line_text(lines: list[bytes], lineno: int) -> bytes:
    return lines[lineno - 1].rstrip(b"\r\n")


def _docstring_statement(node: ast.AST) -> ast.Expr | None:
    body = getattr(node, "body", None)
    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
            and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        return body[0]
    return None


def _on_own_lines(blines: list[bytes], stmt: ast.stmt, next_lineno: int | None) -> bool:
    """Whether a statement has its lines to itself (nothing before it on its first line, nothing after it on
    its last, the next statement on a later line), so removing those lines removes exactly it."""
    first, last = _line_text(blines, stmt.lineno), _line_text(blines, stmt.end_lineno)
    return not (first[: stmt.col_offset].strip() or last[stmt.end_col_offset:].strip()
                or (next_lineno is not None and next_lineno <= stmt.end_lineno))


def _is_stub(stmt: ast.stmt) -> bool:
    """`pass`, `...` or `raise NotImplementedError...`: no implementation to retrieve."""
    if isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                                      and stmt.value.value is Ellipsis):
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _inner_docstrings(node: ast.AST, blines: list[bytes]) -> list[ast.Expr] | None:
    """The docstrings of the functions and classes defined inside `node` that have a statement after it (a
    docstring-only body stays: cutting it would leave no body, and such a def is no record), or None when one
    does not have its lines to itself (then it cannot be cut out exactly)."""
    out = []
    for inner in ast.walk(node):
        doc = _docstring_statement(inner) if inner is not node else None
        if doc is None or len(inner.body) == 1:
            continue
        if doc.lineno <= inner.lineno or not _on_own_lines(blines, doc, inner.body[1].lineno):
            return None
        out.append(doc)
    return out


def _function_records(source: str, tree: ast.AST, module: str, relpath: str,
                      min_body_statements: int = MIN_BODY_STATEMENTS) -> list[dict]:
    """(query, positive, ...) for every documented, non-trivial function of one parsed file, in source order."""
    blines = _split_lines(source.encode("utf-8"))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc:
            continue
        query = _summary(doc)
        if len(query.split()) < MIN_SUMMARY_WORDS or MARKUP_SUMMARY.match(query):
            continue
        body = node.body[1:]
        if len(body) < min_body_statements or all(map(_is_stub, body)):
            continue
        doc_stmt = node.body[0]
        # The docstring must sit on lines of its own (not `def f(): "doc"; ...`), so removing its lines is exact.
        if doc_stmt.lineno <= node.lineno or not _on_own_lines(blines, doc_stmt, body[0].lineno):
            continue
        if blines[node.lineno - 1][: node.col_offset].strip():
            continue
        # The docstrings of functions and classes defined inside go too: a nested function's summary (another
        # record's query) left in this positive would make it that record's answer, not a negative.
        inner = _inner_docstrings(node, blines)
        if inner is None:
            continue
        docstrings = [doc_stmt, *inner]
        # The function's lines, the last one cut where the function ends (a trailing comment goes): the text of
        # ast.get_source_segment(padded=True), which re-splits the whole file on every call (quadratic).
        seg_lines = [b.rstrip(b"\r\n").decode("utf-8") for b in blines[node.lineno - 1: node.end_lineno]]
        seg_lines[-1] = _line_text(blines, node.end_lineno)[: node.end_col_offset].decode("utf-8")
        dropped = {line - node.lineno for d in docstrings for line in range(d.lineno, d.end_lineno + 1)}
        kept = [line for i, line in enumerate(seg_lines) if i not in dropped]
        # Dedented by the def line's own indentation: textwrap.dedent keeps every line's indentation when a
        # multi-line string in the body starts a line at column 0.
        indent = blines[node.lineno - 1][: node.col_offset].decode("utf-8")
        positive = "\n".join(line[len(indent):] if line.startswith(indent) else line.strip() and line
                              for line in kept).strip("\n")
        body_text = "".join(line for i, line in enumerate(seg_lines)
                            if i >= body[0].lineno - node.lineno and i not in dropped)
        if len("".join(body_text.split())) < MIN_BODY_CHARS:
            continue
        if query in " ".join(positive.split()):
            continue  # the summary also appears in the code (e.g. a comment, or a string)
        out.append({"query": query, "positive": positive, "module": module,
                    "name": f"{relpath}:{node.lineno}:{node.name}", "span": (relpath, node.lineno, node.end_lineno)})
    out.sort(key=lambda r: int(r["name"].split(":")[1]))
    return out


def _file_records(job: tuple[str, str, str, int]) -> list[dict] | None:
    """The records of one file (module, path, path relative to its root, min body statements), or None when it
    does not parse."""
    module, path, relpath, min_body_statements = job
    try:
        with tokenize.open(path) as f:
            source = f.read()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning (invalid escapes) in old code
            tree = ast.parse(source, filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None
    return _function_records(source, tree, module, relpath, min_body_statements)


def collect_functions(root: Path | Sequence[Path] | None = None, modules: Iterable[str] | None = None,
                      *, workers: int | None = None, min_body_statements: int = MIN_BODY_STATEMENTS
                      ) -> tuple[list[dict], dict]:
    """All usable functions under `root` (one directory or several; default: the stdlib), or of `modules`
    only, sorted by (module, file, line), deduplicated by query and by positive (the first occurrence is
    kept; queries compared by `_query_key`, positives with whitespace collapsed). A top-level module found
    under two roots is taken from the first. Files are parsed on `workers` processes (default: one per
    core); the result does not depend on it. Also returns file counts and the
    namespace packages not read."""
    roots = [stdlib_dir()] if root is None else [Path(root)] if isinstance(root, (str, os.PathLike)) else [
        Path(r) for r in root]
    jobs: list[tuple[str, str, str, int]] = []
    owner: dict[str, Path] = {}
    namespace_packages: set[str] = set()
    for r in roots:
        for module, path in _module_files(r, modules, namespace_packages):
            if owner.setdefault(module, r) == r:
                jobs.append((module, str(path), path.relative_to(r).as_posix(), min_body_statements))
    workers = workers or os.cpu_count() or 1
    if workers > 1 and len(jobs) > 64:
        with ProcessPoolExecutor(workers) as pool:
            per_file = list(pool.map(_file_records, jobs, chunksize=64))
    else:
        per_file = [_file_records(job) for job in jobs]
    records = [r for recs in per_file if recs is not None for r in recs]
    n_skipped = sum(recs is None for recs in per_file)
    seen_q: set[str] = set()
    seen_p: set[str] = set()
    unique = []
    for r in records:
        q, p = _query_key(r["query"]), " ".join(r["positive"].split())
        if q in seen_q or p in seen_p:
            continue
        seen_q.add(q)
        seen_p.add(p)
        unique.append(r)
    return unique, {"files": len(jobs) - n_skipped, "skipped_files": n_skipped,
                    "namespace_packages": sorted(namespace_packages - set(owner))}


def _query_key(query: str) -> str:
    """A query as compared for duplicates: lower case, whitespace collapsed, without markup quotes (backticks,
    quotes, asterisks) or punctuation at its ends. Operators stay: "Return a < b" is not "Return a > b"."""
    return " ".join(re.sub(r"[`'\"*]", "", query.lower()).split()).strip(" .,;:!?")


def _split_modules(counts: dict[str, int], heldout_fraction: float, seed: int) -> set[str]:
    """Held-out modules: walk the modules in the order of crc32(seed:module) and take each one that brings the
    held-out row count closer to heldout_fraction of all rows."""
    target = heldout_fraction * sum(counts.values())
    order = sorted(counts, key=lambda m: (zlib.crc32(f"{seed}:{m}".encode()), m))
    heldout: set[str] = set()
    rows = 0
    for m in order:
        if abs(rows + counts[m] - target) < abs(rows - target):
            heldout.add(m)
            rows += counts[m]
    return heldout


def _nested(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    """Whether one function's span (file, first line, last line) holds the other's."""
    return a[0] == b[0] and (a[1] <= b[1] <= b[2] <= a[2] or b[1] <= a[1] <= a[2] <= b[2])


def _add_negatives(rows: list[dict], k: int, seed: int, split: str) -> None:
    """`k` negatives per row: other functions of the same module, then (small modules) of other modules; never a
    function that contains the row's or is contained in it (its code is part of the answer)."""
    if not k:
        for r in rows:
            r["negatives"] = []
        return
    if len(rows) <= k:
        raise ValueError(f"the {split} split has {len(rows)} functions: too few for {k} distinct negatives each")
    by_module: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_module.setdefault(r["module"], []).append(i)
    for module in sorted(by_module):
        idx = by_module[module]
        rng = np.random.default_rng([seed, zlib.crc32(f"{split}:{module}".encode())])
        others_everywhere = None
        for i in idx:
            same = [j for j in idx if j != i and not _nested(rows[i]["span"], rows[j]["span"])]
            picked = [same[j] for j in rng.permutation(len(same))[:k]] if same else []
            if len(picked) < k:
                if others_everywhere is None:
                    others_everywhere = [j for j in range(len(rows)) if rows[j]["module"] != module]
                extra = rng.choice(len(others_everywhere), size=k - len(picked), replace=False)
                picked += [others_everywhere[j] for j in sorted(extra)]
            rows[i]["negatives"] = [rows[j]["positive"] for j in picked]


def build_stdlib_corpus(out_dir: str | os.PathLike, *, stdlib: str | os.PathLike | None = None, **kwargs) -> dict:
    """The standard-library corpus (`build_code_corpus` over the stdlib directory, or `stdlib`)."""
    return build_code_corpus(out_dir, roots=[Path(stdlib) if stdlib is not None else stdlib_dir()], source=SOURCE,
                             **kwargs)


def build_packages_corpus(out_dir: str | os.PathLike, **kwargs) -> dict:
    """The corpus of the standard library and every installed package (`package_roots`)."""
    return build_code_corpus(out_dir, roots=package_roots(), source=PACKAGES_SOURCE, min_body_statements=1, **kwargs)


def build_code_corpus(
    out_dir: str | os.PathLike,
    *,
    roots: Sequence[str | os.PathLike],
    source: str,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    max_per_module: int | None = None,
    negatives: int = 1,
    modules: Iterable[str] | None = None,
    workers: int | None = None,
    min_body_statements: int = MIN_BODY_STATEMENTS,
) -> dict:
    """Write ``train.jsonl`` and ``heldout.jsonl`` (the `jaxembed.train.data` schema plus ``module`` and ``name``)
    into `out_dir`, both built and checked before either is written, each atomically; return the counts.

    `max_per_module` keeps at most that many functions per top-level module (a seeded choice, kept in source
    order); `modules` restricts the corpus to those top-level modules. Texts are never truncated.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    if seed < 0 or negatives < 0 or (max_per_module is not None and max_per_module < 1):
        raise ValueError(
            f"need seed >= 0, negatives >= 0, max_per_module >= 1; got {seed}, {negatives}, {max_per_module}"
        )
    modules = None if modules is None else sorted(set(modules))
    roots = [Path(r) for r in roots]
    records, files = collect_functions(roots, modules, workers=workers, min_body_statements=min_body_statements)
    if not records:
        raise ValueError(f"no usable functions found under {', '.join(map(str, roots))}"
                         + (f" for modules {modules}" if modules else ""))

    by_module: dict[str, list[dict]] = {}
    for r in records:
        by_module.setdefault(r["module"], []).append(r)
    if max_per_module is not None:
        for m, rs in by_module.items():
            if len(rs) > max_per_module:
                rng = np.random.default_rng([seed, zlib.crc32(m.encode())])
                by_module[m] = [rs[i] for i in sorted(rng.choice(len(rs), size=max_per_module, replace=False))]
    heldout_modules = _split_modules({m: len(rs) for m, rs in by_module.items()}, heldout_fraction, seed)

    # Both splits are built and checked before either file is written: a failed run leaves the directory as
    # it was, never a new train.jsonl beside an old heldout.jsonl (whose modules could then be in both).
    texts, counts = {}, {}
    for split in ("train", "heldout"):
        in_split = [m for m in sorted(by_module) if (m in heldout_modules) == (split == "heldout")]
        rows = [dict(r) for m in in_split for r in by_module[m]]
        if not rows and (split == "train" or heldout_fraction > 0):
            raise ValueError(f"the {split} split is empty: heldout_fraction {heldout_fraction} of {len(records)} "
                             f"functions in {len(by_module)} modules leaves it no module"
                             + ("" if split == "train" else " (use 0 for no held-out split)"))
        if rows:
            _add_negatives(rows, negatives, seed, split)
        texts[split] = "".join(
            json.dumps({"query": r["query"], "positive": r["positive"], "negatives": r["negatives"],
                        "instruction": INSTRUCTION, "source": source, "module": r["module"], "name": r["name"]},
                       ensure_ascii=False) + "\n" for r in rows)
        counts[f"{split}_rows"] = len(rows)
        counts[f"{split}_modules"] = len({r["module"] for r in rows})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Each file is replaced atomically; the old pair goes first, so a run stopped between the two writes
    # leaves a split missing (an error when training), not one split of each run.
    for split in ("train", "heldout"):
        (out_dir / f"{split}.jsonl").unlink(missing_ok=True)
    for split in ("heldout", "train"):
        write_text_atomically(out_dir / f"{split}.jsonl", texts[split])
    counts.update(files)
    counts["python"] = ".".join(map(str, sys.version_info[:3]))
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxembed.train.corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--kind", choices=["stdlib", "packages"], default="stdlib")
    parser.add_argument("--heldout-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--negatives", type=int, default=1)
    parser.add_argument("--max-per-module", type=int, default=None)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        build = build_packages_corpus if args.kind == "packages" else build_stdlib_corpus
        counts = build(args.out_dir, heldout_fraction=args.heldout_fraction, seed=args.seed,
                       negatives=args.negatives, max_per_module=args.max_per_module)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    namespace = counts.get("namespace_packages") or []
    print(f"wrote {args.out_dir}/train.jsonl: {counts['train_rows']} rows from {counts['train_modules']} modules; "
          f"{args.out_dir}/heldout.jsonl: {counts['heldout_rows']} rows from {counts['heldout_modules']} modules "
          f"(Python {counts['python']} {args.kind}, {counts['files']} files, {counts['skipped_files']} skipped"
          + (f"; {len(namespace)} namespace packages not read: {', '.join(namespace)}" if namespace else "")
          + f"; {time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
