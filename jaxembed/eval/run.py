"""`jaxembed eval`: a benchmark or named tasks through mteb, results in mteb's cache layout, and the
paper's summary table (mean over tasks, mean over task types) beside the published rows.

    jaxembed eval --model runs/model --benchmark "MTEB(eng, v2)" --output results
    jaxembed eval --model runs/model --tasks SciFact,STS12
    jaxembed eval --model runs/model --local-tasks data/stdlib/heldout.jsonl   # offline, see local_tasks
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import re
import sys
import warnings
from pathlib import Path

from jaxembed.errors import DataError, MissingDataError
from jaxembed.eval.summary import aggregate, markdown_table
from jaxembed.files import write_text_atomically

LONGEMBED = "LongEmbed"
LONGEMBED_MAX_TOKENS = 32768  # the paper's LongEmbed setting (Mistral's context)
MTEB_MAX_TOKENS = 512  # the paper's MTEB setting, after E5


def resolve_tasks(benchmark: str | None, tasks: str | None, local_tasks: str | None):
    """(tasks, benchmark name or None). Exactly one source of tasks."""
    import mteb

    given = [x for x in (benchmark, tasks, local_tasks) if x]
    if len(given) != 1:
        raise ValueError("give exactly one of --benchmark, --tasks and --local-tasks")
    if benchmark:
        try:
            found = mteb.get_benchmark(benchmark)
        except (KeyError, ValueError) as err:
            raise ValueError(f"unknown benchmark {benchmark!r} ({err})") from None
        return list(found.tasks), found.name  # an alias ("MTEB(eng)") by its canonical name: the paper's rows
    if tasks:
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        if not names:
            raise ValueError(f"--tasks {tasks!r} names no task")
        out = []
        for name in names:
            try:
                out.append(mteb.get_task(name))
            except KeyError:
                raise ValueError(f"unknown mteb task {name!r}") from None
        return out, None
    from jaxembed.eval.local_tasks import stdlib_tasks

    path = Path(local_tasks)
    if not path.is_file():
        raise ValueError(f"--local-tasks: {path} is not a file (build one with `jaxembed corpus stdlib DIR`)")
    from jaxembed.errors import DataError
    from jaxembed.train.data import read_raw_records

    try:  # the trainer's reader and checks (its data is what this evaluates): errors name the file and line
        rows, lines = read_raw_records(path)
    except DataError as err:
        raise ValueError(f"--local-tasks: {err}") from None
    try:
        return stdlib_tasks(rows, lines=lines), None
    except ValueError as err:
        raise ValueError(f"--local-tasks {path}: {err}") from None


def tasks_identity(local_tasks: str | None) -> list:
    """What the tasks' data is beyond their names and dataset revisions (each cached result records its own
    dataset revision, checked by `check_cached_results`): for --local-tasks, every build of which has the same
    task names and revision, the file's sha256. The task list is left out, so runs of different task sets
    (MTEB v1 after v2, the rest of a benchmark after a crash) reuse the tasks they share."""
    return [("local-tasks", hashlib.sha256(Path(local_tasks).read_bytes()).hexdigest())] if local_tasks else []


def check_data(tasks) -> None:
    """Load every task's data first, so a missing dataset is named before hours of encoding.
    Aggregate tasks (MTEB(eng, v1)'s CQADupstackRetrieval) are checked subtask by subtask."""
    from mteb.abstasks.aggregated_task import AbsTaskAggregate

    leaves = [leaf for task in tasks
              for leaf in (task.metadata.tasks if isinstance(task, AbsTaskAggregate) else [task])]
    missing = []
    for task in leaves:
        try:
            task.load_data()
        except (ConnectionError, OSError) as err:  # OSError covers datasets' DatasetNotFoundError
            d = task.metadata.dataset or {}
            config = f", config {d['name']!r}" if d.get("name") else ""
            missing.append(f"  {task.metadata.name}: dataset {d.get('path')!r} "
                           f"at revision {d.get('revision')!r}{config} "
                           f"({type(err).__name__}: {str(err).splitlines()[0][:160]})")
    if missing:
        raise MissingDataError(
            f"{len(missing)} of {len(leaves)} tasks have no data here (not in the Hugging Face cache, and the hub is "
            "unreachable or HF_HUB_OFFLINE=1). Download them on a machine with hub access (the same HF_HOME), "
            "or run fewer tasks:\n" + "\n".join(missing))


def task_scores(result, tasks) -> dict[str, tuple[str, float]]:
    """mteb's ModelResult -> task name -> (task type, main score) over the task's own splits and subsets only: a
    result mteb reuses from its cache may hold more (MassiveIntentClassification's 51 languages from a multilingual
    run, read by an English benchmark's), which its plain `get_score` would average in."""
    by_name = {t.metadata.name: t for t in tasks}
    return {tr.task_name: (by_name[tr.task_name].metadata.type,
                           float(tr.validate_and_filter_scores(by_name[tr.task_name]).get_score()))
            for tr in result.task_results}


def task_calls(scores, encoder, records: Path) -> tuple[list[dict], list[str]]:
    """Every scored task's encode calls (prefix, cuts): this run's, written to `records` (one file a task, next
    to mteb's results of the same revision), or, for a task whose result came from mteb's cache, the record its
    run wrote. Returns (calls, tasks with no record: a result cached before records were kept, or by a run
    killed between mteb's write and this one)."""
    calls, unrecorded = [], []
    for task in scores:
        mine = [c.__dict__ for c in encoder.calls if c.task == task]
        path = records / f"{task}.json"
        if mine:
            records.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, json.dumps(mine, indent=2))
        elif path.is_file():
            mine = [{**c, "cached": True} for c in json.loads(path.read_text())]
        else:
            unrecorded.append(task)
        calls += mine
    return calls, unrecorded


def run_label(benchmark: str | None, tasks, local_tasks: str | None) -> str:
    """A file name for one run's summary: the benchmark's name, `local-tasks`, or the tasks' names (hashed
    when long), so a run of other tasks under the same revision does not replace it."""
    if benchmark:
        label = benchmark
    elif local_tasks:
        label = "local-tasks"
    else:
        names = "_".join(sorted(t.metadata.name for t in tasks))
        label = f"tasks-{names}" if len(names) <= 80 else f"tasks-{hashlib.sha256(names.encode()).hexdigest()[:12]}"
    return re.sub(r"[^A-Za-z0-9.-]+", "_", label).strip("_")


def write_summary(model_name: str, scores, benchmark: str | None, output: Path, calls: list[dict],
                  unrecorded: list[str]) -> str:
    """OUTPUT.md (the table) and OUTPUT.json (the numbers, truncation and instruction use)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    table = markdown_table(model_name, scores, benchmark)
    title = f"# {model_name}: {benchmark or 'selected tasks'}"
    write_text_atomically(output.with_name(output.name + ".md"), f"{title}\n\n{table}")
    write_text_atomically(output.with_name(output.name + ".json"), json.dumps(
        {"model": model_name, "benchmark": benchmark,
         "scores": {k: {"type": t, "main_score": s} for k, (t, s) in scores.items()},
         **aggregate(scores), "encode_calls": calls, "tasks_without_encode_record": unrecorded}, indent=2))
    return table


def check_cached_results(directory: Path, tasks) -> None:
    """mteb writes its result files in place: one cut short by a kill would stop every later run with a bare
    JSON error. Named here, with the fix. And mteb reuses a complete cached result of a task whatever dataset
    revision it was computed on: one from other data (the task's revision moved with an mteb upgrade) is named
    too, never scored as this run's."""
    from mteb.abstasks.aggregated_task import AbsTaskAggregate

    revisions = {leaf.metadata.name: leaf.metadata.revision for task in tasks
                 for leaf in [task, *(task.metadata.tasks if isinstance(task, AbsTaskAggregate) else [])]}
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            cached = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise DataError(f"{path}: a cached result that cannot be read ({err}); an interrupted write leaves "
                            "one: delete the file to compute that task again") from None
        wanted = revisions.get(path.stem)
        if not isinstance(cached, dict) or wanted is None or cached.get("dataset_revision") in (None, wanted):
            continue
        raise DataError(f"{path}: a cached result of dataset revision {cached.get('dataset_revision')!r}, where "
                        f"{path.stem} now uses {wanted!r}; delete the file to compute that task again on this data")


def check_scores(scores, summary: Path) -> None:
    """A task whose main score is not a number (every text cut to the same prefix, a collapsed model) is an
    error naming it, after the summary is written for a look: a mean with NaN in it is no result."""
    bad = {name: score for name, (_, score) in scores.items() if not math.isfinite(score)}
    if bad:
        numbers = summary.with_name(summary.name + ".json")
        raise DataError(f"{len(bad)} task(s) scored no number: "
                        + ", ".join(f"{name} {score}" for name, score in sorted(bad.items()))
                        + f"; the means are not results (see {numbers}: identical embeddings give nan, e.g. when "
                        "every text is cut to the same instruction prefix)")


def default_max_length(benchmark: str | None, tasks) -> int:
    """LongEmbed's length when every task is one of LongEmbed's, MTEB's otherwise."""
    import mteb

    longembed = {t.metadata.name for t in mteb.get_benchmark(LONGEMBED).tasks}
    if benchmark == LONGEMBED or {t.metadata.name for t in tasks} <= longembed:
        return LONGEMBED_MAX_TOKENS
    return MTEB_MAX_TOKENS


def evaluation_identity(model, args, max_length, data) -> str:
    """The mteb cache revision of a run: the model's fingerprint (its config and every tensor), the
    tokenizer's full definition, the settings that change its embeddings and `data` (what the tasks'
    data is: `tasks_identity`), hashed. Two different models, one model under other settings or one
    task name over other data never share cached results; the same model, settings and data reuse
    them."""
    import xxhash

    from jaxembed.text import tokenizer_identity

    what = {"model": model.fingerprint, "dtype": str(args.dtype), "template": args.template,
            "instructions": args.instructions, "max_length": max_length, "query_template": model.query_template,
            "tokenizer": None if model.tokenizer is None else tokenizer_identity(model.tokenizer), "data": data}
    return "fp-" + xxhash.xxh3_64_hexdigest(json.dumps(what, sort_keys=True).encode())


@contextlib.contextmanager
def _quiet(quiet: bool):
    """--quiet: also none of the progress bars mteb's evaluators and `datasets` draw whatever show_progress_bar
    says, and no scikit-learn metric warnings (metrics mteb reports beside the main score, ill-defined on small
    tasks). tqdm's own recipe for a global off switch: `disable=True` as the default of every bar, for this call."""
    if not quiet:
        yield
        return
    from sklearn.exceptions import UndefinedMetricWarning
    from tqdm import std

    from jaxembed.train.data import quiet_datasets

    init = std.tqdm.__init__
    std.tqdm.__init__ = functools.partialmethod(init, disable=True)
    try:
        with quiet_datasets(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UndefinedMetricWarning)
            yield
    finally:
        std.tqdm.__init__ = init


def cmd_eval(args) -> int:
    import mteb

    import jaxembed
    from jaxembed.eval.encoder import MtebEncoder

    tasks, benchmark = resolve_tasks(args.benchmark, args.tasks, args.local_tasks)
    if not args.skip_data_check:
        check_data(tasks)
    max_length = args.max_length
    if max_length is None:
        max_length = default_max_length(benchmark, tasks)
    model = jaxembed.load(args.model, dtype=args.dtype, tokenizer=args.tokenizer)
    name = args.name or f"jaxembed/{Path(args.model).resolve().name}"
    revision = args.revision or evaluation_identity(model, args, max_length, tasks_identity(args.local_tasks))
    encoder = MtebEncoder(model, name=name, revision=revision, max_length=max_length or None,
                          batch_size=args.batch_size, instructions=args.instructions, template=args.template,
                          show_progress_bar=not args.quiet)
    encoder.check_prefixes(tasks)
    output = Path(args.output)
    check_cached_results(output / "results" / name.replace("/", "__") / revision, tasks)
    with _quiet(args.quiet):
        result = mteb.evaluate(encoder, tasks, cache=mteb.ResultCache(output), overwrite_strategy=args.overwrite,
                               show_progress_bar=not args.quiet)
    scores = task_scores(result, tasks)
    calls, unrecorded = task_calls(scores, encoder, output / "encode_calls" / name.replace("/", "__") / revision)
    summary = output / "summary" / name.replace("/", "__") / revision / run_label(benchmark, tasks, args.local_tasks)
    table = write_summary(name, scores, benchmark, summary, calls, unrecorded)
    print(table)
    print(f"summary: {summary.with_name(summary.name + '.md')}", file=sys.stderr)
    truncated = sum(c["truncated"] for c in calls)
    if truncated:
        print(f"{truncated} texts were cut to {max_length} tokens (per call: the summary .json)", file=sys.stderr)
    if unrecorded:
        print(f"no record of the encode calls (prefixes, cuts) of {len(unrecorded)} cached task(s): "
              f"{', '.join(unrecorded)}; rerun with --overwrite always to make one", file=sys.stderr)
    check_scores(scores, summary)
    return 0
