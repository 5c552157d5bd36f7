"""Aggregation as in the paper's Tables 1 and 5-8, and the paper's published rows beside ours.

Mean over tasks: the plain mean of every task's main score. Mean over task types: the mean of the
per-type means (each type weighs the same however many tasks it has). Scores are reported x100.
LongEmbed has one type (retrieval) and its table reports the mean over tasks only.
"""

from __future__ import annotations

from collections import defaultdict

# mteb task type -> the paper's column abbreviation (Table 4)
TYPE_ABBREVIATIONS = {
    "BitextMining": "Bit.M.", "Classification": "Cls.", "Clustering": "Clust.", "InstructionReranking": "I.Rera.",
    "MultilabelClassification": "M.Cls.", "PairClassification": "P.Cls.", "Reranking": "Rera.", "Retrieval": "Retr.",
    "STS": "STS", "Summarization": "Sum.",
}
# LongEmbed columns (Table 7) -> mteb task names
LONGEMBED_TASKS = {
    "NQA": "LEMBNarrativeQARetrieval", "Needle": "LEMBNeedleRetrieval", "Passkey": "LEMBPasskeyRetrieval",
    "QMSum": "LEMBQMSumRetrieval", "SSFD": "LEMBSummScreenFDRetrieval", "WikimQA": "LEMBWikimQARetrieval",
}


def _row(columns, values):
    *per_column, task_mean, type_mean = values if len(values) == len(columns) + 2 else (*values, None)
    return {"columns": dict(zip(columns, per_column, strict=True)), "task_mean": task_mean, "type_mean": type_mean}


_MULTI = ("Bit.M.", "Cls.", "Clust.", "I.Rera.", "M.Cls.", "P.Cls.", "Rera.", "Retr.", "STS")
_ENG = ("Cls.", "Clust.", "P.Cls.", "Rera.", "Retr.", "STS", "Sum.")
# The paper's published rows (Tables 5, 6, 7, 8): per column, then mean over tasks and types
PAPER_RESULTS: dict[str, dict[str, dict]] = {
    "MTEB(Multilingual, v2)": {
        "E5-Mistral-7B (Wang et al.)": _row(_MULTI, (70.6, 60.3, 50.6, -0.6, 22.2, 81.1, 63.8, 55.8, 74.0, 60.2, 53.1)),
        "Qwen2 1.5B (paper)": _row(_MULTI, (61.8, 57.6, 46.9, -2.2, 20.0, 78.2, 53.7, 50.7, 71.4, 56.2, 48.7)),
        "Mistral 7B v0.1 (paper)": _row(_MULTI, (68.6, 60.2, 46.9, -4.7, 21.2, 79.9, 55.3, 54.4, 72.4, 58.6, 50.5)),
        "Mistral 7B v0.3 (paper)": _row(_MULTI, (68.7, 60.2, 48.0, -4.4, 21.7, 80.1, 55.5, 55.1, 72.7, 58.9, 50.8)),
        "Mamba2 1.3B (paper)": _row(_MULTI, (61.1, 55.7, 45.2, -5.6, 19.5, 77.6, 55.4, 50.9, 70.9, 55.2, 47.9)),
        "Codestral Mamba 7B (paper)": _row(_MULTI, (70.6, 60.0, 47.0, -3.2, 21.8, 81.0, 60.1, 56.3, 73.3, 59.4, 51.9)),
    },
    "MTEB(eng, v2)": {
        "E5-Mistral-7B (Wang et al.)": _row(_ENG, (79.9, 51.4, 88.4, 49.8, 57.6, 84.3, 36.6, 68.0, 64.0)),
        "Qwen2 1.5B (paper)": _row(_ENG, (78.1, 49.7, 85.2, 48.4, 54.1, 82.2, 38.3, 65.7, 62.3)),
        "Mistral 7B v0.1 (paper)": _row(_ENG, (80.7, 50.9, 87.2, 49.3, 56.8, 82.5, 35.8, 67.3, 63.3)),
        "Mistral 7B v0.3 (paper)": _row(_ENG, (79.9, 52.0, 87.1, 49.3, 56.4, 82.4, 37.1, 67.3, 63.5)),
        "Mamba2 1.3B (paper)": _row(_ENG, (76.8, 48.6, 85.0, 48.3, 50.7, 81.9, 35.0, 64.3, 60.9)),
        "Codestral Mamba 7B (paper)": _row(_ENG, (79.5, 50.5, 86.2, 49.3, 50.3, 81.7, 35.2, 65.2, 61.8)),
    },
    "LongEmbed": {
        "E5-Mistral-7B (Wang et al.)": _row(tuple(LONGEMBED_TASKS), (37.2, 31.5, 30.8, 28.6, 75.1, 58.7, 43.7)),
        "Qwen2 1.5B (paper)": _row(tuple(LONGEMBED_TASKS), (27.4, 30.5, 34.0, 30.8, 75.4, 48.2, 41.0)),
        "Mistral 7B v0.1 (paper)": _row(tuple(LONGEMBED_TASKS), (40.8, 28.5, 37.8, 31.9, 79.8, 49.6, 44.7)),
        "Mistral 7B v0.3 (paper)": _row(tuple(LONGEMBED_TASKS), (43.2, 27.8, 36.5, 32.0, 79.8, 49.7, 44.8)),
        "Mamba2 1.3B (paper)": _row(tuple(LONGEMBED_TASKS), (24.2, 32.2, 37.8, 29.9, 72.9, 47.9, 40.8)),
        "Codestral Mamba 7B (paper)": _row(tuple(LONGEMBED_TASKS), (35.7, 31.0, 38.8, 30.2, 75.0, 56.5, 44.5)),
    },
    "MTEB(eng, v1)": {
        "E5-Mistral-7B (Wang et al.)": _row(_ENG, (77.4, 50.3, 88.4, 60.2, 57.1, 84.7, 31.5, 66.5, 64.2)),
        "Qwen2 1.5B (Springer et al.)": _row(_ENG, (76.5, 47.2, 86.9, 55.0, 54.4, 79.3, 29.7, 63.3, 61.3)),
        "Mistral 7B v0.1 (Springer et al.)": _row(_ENG, (77.9, 49.1, 87.4, 57.6, 57.1, 82.9, 30.1, 65.5, 63.2)),
        "Mistral 7B v0.2 (Springer et al.)": _row(_ENG, (78.3, 50.5, 88.2, 60.0, 58.2, 85.7, 31.3, 66.9, 64.6)),
        "Qwen2 1.5B (paper)": _row(_ENG, (75.5, 46.9, 85.2, 58.2, 52.8, 82.7, 31.5, 63.6, 61.8)),
        "Mistral 7B v0.1 (paper)": _row(_ENG, (77.6, 49.5, 87.2, 59.9, 56.3, 82.9, 31.0, 65.7, 63.5)),
        "Mistral 7B v0.3 (paper)": _row(_ENG, (76.9, 49.4, 87.1, 60.0, 55.8, 83.0, 30.9, 65.5, 63.3)),
        "Mamba2 1.3B (paper)": _row(_ENG, (73.8, 46.2, 85.0, 58.0, 49.0, 82.4, 30.6, 61.9, 60.7)),
        "Codestral Mamba 7B (paper)": _row(_ENG, (76.9, 47.3, 86.2, 60.0, 49.5, 82.2, 29.8, 63.2, 61.7)),
    },
}


def aggregate(scores: dict[str, tuple[str, float]]) -> dict:
    """scores: task name -> (task type, main score in [0, 1] or any scale). Returns the per-type
    means, the mean over tasks and the mean over task types, all x100."""
    if not scores:
        raise ValueError("no task scores to aggregate")
    by_type = defaultdict(list)
    for _, (task_type, score) in scores.items():
        by_type[task_type].append(100.0 * float(score))
    type_means = {t: sum(v) / len(v) for t, v in sorted(by_type.items())}
    all_scores = [s for v in by_type.values() for s in v]
    return {
        "type_means": type_means,
        "type_counts": {t: len(v) for t, v in sorted(by_type.items())},
        "task_mean": sum(all_scores) / len(all_scores),
        "type_mean": sum(type_means.values()) / len(type_means),
        "tasks": len(all_scores),
    }


def _fmt(v):
    return "" if v is None else f"{v:.1f}"


def markdown_table(model_name: str, scores: dict[str, tuple[str, float]], benchmark: str | None = None) -> str:
    """Our row in the paper's layout, with the paper's published rows of the same benchmark below it."""
    agg = aggregate(scores)
    if benchmark == "LongEmbed":
        by_task = {name: 100.0 * s for name, (_, s) in scores.items()}
        columns = [c for c, task in LONGEMBED_TASKS.items() if task in by_task]
        ours = [by_task[LONGEMBED_TASKS[c]] for c in columns]
        header = ["Model", *columns, "Mean"]
        rows = [[f"**{model_name}**", *map(_fmt, ours), _fmt(agg["task_mean"])]]
        for name, row in PAPER_RESULTS["LongEmbed"].items():
            rows.append([name, *(_fmt(row["columns"].get(c)) for c in columns), _fmt(row["task_mean"])])
    else:
        types = list(agg["type_means"])
        columns = [TYPE_ABBREVIATIONS.get(t, t) for t in types]
        header = ["Model", *columns, "Mean (Task)", "Mean (Type)"]
        rows = [["# of datasets", *(str(agg["type_counts"][t]) for t in types), "", ""],
                [f"**{model_name}**", *(_fmt(agg["type_means"][t]) for t in types), _fmt(agg["task_mean"]),
                 _fmt(agg["type_mean"])]]
        for name, row in PAPER_RESULTS.get(benchmark, {}).items():
            rows.append([name, *(_fmt(row["columns"].get(c)) for c in columns), _fmt(row["task_mean"]),
                         _fmt(row["type_mean"])])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
