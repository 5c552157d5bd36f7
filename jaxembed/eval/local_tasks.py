"""Offline mteb tasks of every task type the paper reports, built from real local text: the
Python standard library's functions and docstrings (`jaxembed.train.corpus`), no hub access.

    tasks = stdlib_tasks(rows)             # rows: triples from `jaxembed corpus stdlib` (held-out split)
    mteb.evaluate(MtebEncoder(model), tasks, cache=None)

Rows (one JSON object per line of the `--local-tasks` file): "query" (a text, e.g. a docstring
summary) and "positive" (the text it belongs to) are required, as in the trainer's data;
"negatives" (texts it does not belong to), "module" (a class label) and "name" are optional. A blank
query, positive or negative is an error naming its row (the trainer drops such rows; an evaluation that
scored or dropped them quietly would not be the one asked for).
Without "negatives", another row's positive stands in; without "module", the tasks that need
class labels (classification, multilabel classification, clustering) are left out, with a
warning that names them.

Each task states what it asks in its description. They are for checking the evaluation path end to
end (and a quick smoke run of a checkpoint), not for comparing models with the paper.
"""

from __future__ import annotations

import warnings
from collections import Counter

from datasets import Dataset, DatasetDict
from mteb.abstasks.classification import AbsTaskClassification
from mteb.abstasks.clustering_legacy import AbsTaskClusteringLegacy
from mteb.abstasks.multilabel_classification import AbsTaskMultilabelClassification
from mteb.abstasks.pair_classification import AbsTaskPairClassification
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.sts import AbsTaskSTS
from mteb.abstasks.task_metadata import TaskMetadata
from mteb.abstasks.text.bitext_mining import AbsTaskBitextMining
from mteb.abstasks.text.summarization import AbsTaskSummarization

from jaxembed.text import same_text_key

INSTRUCTION = "Given a docstring summary, retrieve the Python function that implements it"


def _metadata(name: str, task_type: str, main_score: str, description: str, splits=("test",)) -> TaskMetadata:
    return TaskMetadata(
        name=name, type=task_type, main_score=main_score, description=description,
        reference="https://docs.python.org/3/library/", dataset={"path": "local/jaxembed-stdlib", "revision": "1"},
        category="t2t", eval_splits=list(splits), eval_langs=["eng-Latn"], date=("2026-01-01", "2026-01-01"),
        dialect=[], domains=["Programming"], task_subtypes=[], license="not specified", annotations_creators="derived",
        modalities=["text"], sample_creation="found", bibtex_citation="",
    )


def _retrieval_split(rows, *, top_ranked: bool, instruction: str | None = None) -> RetrievalSplitData:
    docs = sorted({r["positive"] for r in rows} | {n for r in rows for n in r["negatives"]})
    doc_id = {d: f"d{i}" for i, d in enumerate(docs)}
    queries = [{"id": f"q{i}", "text": r["query"], **({"instruction": instruction} if instruction else {})}
               for i, r in enumerate(rows)]
    return RetrievalSplitData(
        corpus=Dataset.from_list([{"id": doc_id[d], "text": d, "title": ""} for d in docs]),
        queries=Dataset.from_list(queries),
        relevant_docs={f"q{i}": {doc_id[r["positive"]]: 1} for i, r in enumerate(rows)},
        top_ranked=({f"q{i}": [doc_id[r["positive"]], *(doc_id[n] for n in r["negatives"])] for i, r in enumerate(rows)}
                    if top_ranked else None),
    )


def _retrieval_task(metadata: TaskMetadata, split: RetrievalSplitData):
    """An mteb retrieval-family task (retrieval, reranking, instruction reranking) over one test split."""

    class Task(AbsTaskRetrieval):
        def load_data(self, **kwargs):
            self.dataset = {"default": {"test": split}}
            self.data_loaded = True

    Task.metadata = metadata
    return Task


def _modules(rows, n_modules: int):
    """Rows of the n most frequent top-level modules (ties by name), and their label index."""
    counts = Counter(r["module"] for r in rows)
    top = sorted(counts, key=lambda m: (-counts[m], m))[:n_modules]
    label = {m: i for i, m in enumerate(sorted(top))}
    return [r for r in rows if r["module"] in label], label


def normalise_rows(rows: list[dict], lines: list[int] | None = None) -> tuple[list[dict], bool]:
    """(rows with every field, whether they carry module labels). Rows need "query" and "positive"
    strings; "negatives", "module" and "name" are filled in when absent (see the module docstring).
    lines: each row's line in its file, to name it in errors (else rows are counted from 1)."""
    for i, r in enumerate(rows):
        where = f"line {lines[i]}" if lines is not None else f"row {i + 1}"
        if not isinstance(r, dict):
            raise ValueError(f"{where}: expected a JSON object with 'query' and 'positive', got {r!r:.60}")
        missing = [k for k in ("query", "positive") if not isinstance(r.get(k), str)]
        if missing:
            raise ValueError(f"{where}: needs string fields 'query' and 'positive' (missing or not a string: "
                             f"{missing}); optional: 'negatives', 'module', 'name'")
        negatives = r.get("negatives")
        if negatives is not None and not (isinstance(negatives, list) and all(isinstance(n, str) for n in negatives)):
            raise ValueError(f"{where}: 'negatives' must be a list of strings, got {negatives!r:.60}")
        blank = [k for k in ("query", "positive") if not r[k].strip()] + (
            ["negatives"] if negatives and not all(n.strip() for n in negatives) else [])
        if blank:
            raise ValueError(f"{where}: blank {' and '.join(map(repr, blank))}: a blank text has nothing to "
                             "evaluate (remove the row or fill it in)")
        if negatives and any(_same_text(negative, r["positive"]) for negative in negatives):
            raise ValueError(f"{where}: a negative is the row's own positive (up to whitespace and case)")
    for field in ("positive", "query"):
        if len({same_text_key(r[field]) for r in rows}) < 2:
            raise ValueError(f"every row has the same {field}: there is nothing to contrast it with")
    has_modules = all(isinstance(r.get("module"), str) for r in rows)
    out = []
    for i, r in enumerate(rows):
        negatives = r.get("negatives") or [other_row(rows, i, "positive")["positive"]]
        out.append({**r, "negatives": list(negatives), "module": r.get("module") if has_modules else "",
                    "name": str(r.get("name", f"{i:08d}"))})
    return out, has_modules


def _same_text(a: str, b: str) -> bool:
    return same_text_key(a) == same_text_key(b)


def other_row(rows: list[dict], i: int, field: str) -> dict:
    """The row half the list away from row i (cyclically), or the next after it, whose `field` is not row i's
    (up to whitespace and case): trainer data may repeat a positive under several queries, and a stand-in
    equal to the row's own text scored every model 100 (reranking) or 50 (pair classification)."""
    n = len(rows)
    for step in range(n):
        other = rows[(i + n // 2 + step) % n]
        if not _same_text(other[field], rows[i][field]):
            return other
    raise ValueError(f"every row has the same {field}")


def stdlib_tasks(rows: list[dict], *, prefix: str = "Stdlib", lines: list[int] | None = None) -> list:
    """One task per task type of the paper (Table 4), from corpus triples (query, positive,
    negatives, module). Deterministic given the rows. lines: each row's line in its file (for errors)."""
    if len(rows) < 40:
        raise ValueError(f"stdlib_tasks needs at least 40 triples, got {len(rows)}")
    rows, has_modules = normalise_rows(rows, lines)
    rows = sorted(rows, key=lambda r: (r["module"], r["name"]))
    pairs = rows[::2]  # a smaller, still mixed subset for the pairwise tasks
    cls_rows, label = _modules(rows, 4)
    train, test = cls_rows[::2], cls_rows[1::2]

    Retrieval = _retrieval_task(_metadata(f"{prefix}CodeRetrieval", "Retrieval", "ndcg_at_10",
                                          "Docstring summary -> the function's source (without the docstring)."),
                                _retrieval_split(rows, top_ranked=False))
    Reranking = _retrieval_task(_metadata(f"{prefix}CodeReranking", "Reranking", "map_at_1000",
                                          "Rank a docstring's function above other functions of its module."),
                                _retrieval_split(rows, top_ranked=True))
    InstructionReranking = _retrieval_task(
        _metadata(f"{prefix}CodeInstructionReranking", "InstructionReranking", "ndcg_at_10",
                  "Reranking with a per-query instruction in the data."),
        _retrieval_split(rows, top_ranked=True, instruction=INSTRUCTION))

    class STS(AbsTaskSTS):
        metadata = _metadata(f"{prefix}DocCodeSTS", "STS", "cosine_spearman",
                             "Docstring vs function: 1 its own, 0.5 same module, 0 another module.")
        min_score, max_score = 0, 1

        def load_data(self, **kwargs):
            # each docstring against its own function, a function of the same module, and one of another
            s1, s2, score = [], [], []
            for i, r in enumerate(pairs):
                other = other_row(pairs, i, "positive")
                grades = ((r["positive"], 1.0), (r["negatives"][0], 0.5), (other["positive"], 0.0))
                for text, value in grades if has_modules else (grades[0], grades[2]):
                    if has_modules and value == 0.0 and other["module"] == r["module"]:
                        continue
                    s1.append(r["query"]), s2.append(text), score.append(value)
            self.dataset = DatasetDict({"test": Dataset.from_dict({"sentence1": s1, "sentence2": s2, "score": score})})
            self.data_loaded = True

    class PairClassification(AbsTaskPairClassification):
        metadata = _metadata(f"{prefix}DocCodePairs", "PairClassification", "max_ap",
                             "Does this function implement this docstring? (negatives: same module)")

        def load_data(self, **kwargs):
            s1 = [r["query"] for r in pairs] * 2
            s2 = [r["positive"] for r in pairs] + [r["negatives"][0] for r in pairs]
            labels = [1] * len(pairs) + [0] * len(pairs)
            self.dataset = DatasetDict({"test": Dataset.from_list(
                [{"sentence1": s1, "sentence2": s2, "labels": labels}])})
            self.data_loaded = True

    class Classification(AbsTaskClassification):
        metadata = _metadata(f"{prefix}ModuleClassification", "Classification", "accuracy",
                             "Which of four stdlib modules a function comes from.")

        def load_data(self, **kwargs):
            self.dataset = DatasetDict({
                split: Dataset.from_dict({"text": [r["positive"] for r in part],
                                          "label": [label[r["module"]] for r in part]})
                for split, part in (("train", train), ("test", test))})
            self.data_loaded = True

    class MultilabelClassification(AbsTaskMultilabelClassification):
        metadata = _metadata(f"{prefix}ModuleMethodMultilabel", "MultilabelClassification", "accuracy",
                             "Labels: the function's module, and whether it is a method (takes self).")

        def load_data(self, **kwargs):
            def labels(r):
                return [label[r["module"]]] + ([len(label)] if "(self" in r["positive"].split("\n", 1)[0] else [])

            self.dataset = DatasetDict({
                split: Dataset.from_dict({"text": [r["positive"] for r in part], "label": [labels(r) for r in part]})
                for split, part in (("train", train), ("test", test))})
            self.data_loaded = True

    class Clustering(AbsTaskClusteringLegacy):
        metadata = _metadata(f"{prefix}ModuleClustering", "Clustering", "v_measure", "Cluster functions by module.")

        def load_data(self, **kwargs):
            self.dataset = DatasetDict({"test": Dataset.from_dict(
                {"sentences": [[r["positive"] for r in cls_rows]],
                 "labels": [[label[r["module"]] for r in cls_rows]]})})
            self.data_loaded = True

    class Summarization(AbsTaskSummarization):
        metadata = _metadata(f"{prefix}DocstringSummarization", "Summarization", "cosine_spearman",
                             "Against a function's docstring summary (the human summary), the function's own "
                             "first line (its signature) must rate above another function's docstring summary.")
        min_score, max_score = 0, 1

        def load_data(self, **kwargs):
            # no machine summary equals the human one: a model scores only by what its embeddings relate
            self.dataset = DatasetDict({"test": Dataset.from_dict({
                "text": [r["positive"] for r in pairs],
                "human_summaries": [[r["query"]] for r in pairs],
                "machine_summaries": [[r["positive"].strip().split("\n", 1)[0], other_row(pairs, i, "query")["query"]]
                                      for i, r in enumerate(pairs)],
                "relevance": [[1, 0] for _ in pairs],
            })})
            self.data_loaded = True

    class BitextMining(AbsTaskBitextMining):
        metadata = _metadata(f"{prefix}DocCodeBitext", "BitextMining", "f1", "Align each docstring with its function.")

        def load_data(self, **kwargs):
            self.dataset = DatasetDict({"test": Dataset.from_dict(
                {"sentence1": [r["query"] for r in pairs], "sentence2": [r["positive"] for r in pairs]})})
            self.data_loaded = True

    kinds = [Retrieval, Reranking, InstructionReranking, STS, PairClassification, Classification,
             MultilabelClassification, Clustering, Summarization, BitextMining]
    if not has_modules:
        labelled = (Classification, MultilabelClassification, Clustering)
        warnings.warn("the local-task rows have no 'module' labels: left out "
                      + ", ".join(k.metadata.name for k in labelled), stacklevel=2)
        kinds = [k for k in kinds if k not in labelled]
    return [cls() for cls in kinds]


def long_document_task(queries: list[str], documents: list[str], name: str = "LocalLongDocRetrieval"):
    """A LongEmbed-style retrieval task: query i's relevant document is documents[i]."""
    if len(queries) != len(documents) or not queries:
        raise ValueError(f"need one document per query, got {len(queries)} queries and {len(documents)} documents")

    split = RetrievalSplitData(
        corpus=Dataset.from_list([{"id": f"d{i}", "text": d, "title": ""} for i, d in enumerate(documents)]),
        queries=Dataset.from_list([{"id": f"q{i}", "text": q} for i, q in enumerate(queries)]),
        relevant_docs={f"q{i}": {f"d{i}": 1} for i in range(len(queries))}, top_ranked=None)
    metadata = _metadata(name, "Retrieval", "ndcg_at_10", "Long-document retrieval from local text.")
    return _retrieval_task(metadata, split)()
