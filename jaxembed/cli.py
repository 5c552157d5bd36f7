"""Command line: `jaxembed convert SRC DST`, `jaxembed embed --model PATH [FILES]`, `jaxembed train CONFIG.yaml`,
`jaxembed corpus stdlib|packages OUT_DIR`, `jaxembed tokenizer TRAIN.jsonl OUT_DIR --vocab-size N`,
`jaxembed mine IN.jsonl OUT.jsonl --negatives K` (hard negatives by BM25
or a model), `jaxembed eval --model PATH --benchmark NAME | --tasks A,B`,
`jaxembed bench NAME` (chunk-size, vertical-chunk-size, model-comparison), `jaxembed serve --model PATH`
(an OpenAI-compatible embeddings server) and `jaxembed export MODEL DST` (back to the source layout)."""

from __future__ import annotations

import argparse
import codecs
import io
import json
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np

from jaxembed.files import write_atomically
from jaxembed.quantize import PRECISIONS, check_output_options, quantize_embeddings, truncate_embeddings


def _vertical(value: str):
    if value == "auto":
        return "auto"
    if value.lower() in ("none", "horizontal"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or an int, got {value!r}") from None


def _read_texts(inputs: list[str]) -> list[str]:
    """One text per line from each file ('-' or nothing: stdin). Blank lines are texts too (EOS alone).
    Input that is not UTF-8 is an error naming the file, the line and the byte."""
    texts = []
    for name in inputs or ["-"]:
        if name == "-":
            if sys.stdin is None:  # started with stdin closed (`<&-`)
                raise ValueError("stdin is closed; name the input files")
            stdin = getattr(sys.stdin, "buffer", None)  # a text stream without bytes (tests): decoded already
            texts.extend(_decode_lines(stdin, "<stdin>") if stdin is not None else
                         [line.rstrip("\n") for line in sys.stdin])
            continue
        path = _readable(Path(name))
        with open(path, "rb") as f:
            texts.extend(_decode_lines(f, name))
    return texts


def _readable(path: Path) -> Path:
    """An input path that can be read as a stream of text: a file, a named pipe, `/dev/stdin`, a shell's
    `<(...)` (only a missing path and a directory are refused)."""
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    if path.is_dir():
        raise ValueError(f"{path} is a directory; name a text file in it")
    return path


def _decode_lines(stream, name: str) -> list[str]:
    """Lines as text mode splits them (\\n, \\r\\n or \\r), decoded as UTF-8."""
    data = stream.read()
    if data.startswith(codecs.BOM_UTF8):  # a byte-order mark is not part of the first text
        data = data[len(codecs.BOM_UTF8):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = data[: err.start].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        line_start, line = before.rfind(b"\n") + 1, before.count(b"\n") + 1
        raise ValueError(f"{name}, line {line}: not valid UTF-8 (byte 0x{data[err.start]:02x} at "
                         f"column {len(before) - line_start + 1})") from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def check_output_path(path: Path, suffixes: tuple[str, ...], *, overwrite: bool) -> None:
    """Refuse, before any work, an output that cannot or should not be written."""
    if path.suffix not in suffixes:
        raise ValueError(f"--output must end in {' or '.join(suffixes)}, got {path}")
    if path.is_dir():
        raise ValueError(f"--output {path} is a directory; name a file in it")
    where, parent = str(path), path.parent
    if path.is_symlink():  # written through (files.write_atomically): the target's directory is the one written
        target = Path(os.path.realpath(path))
        where, parent = f"{path} (a link to {target})", target.parent
    if not parent.is_dir():
        raise ValueError(f"--output {where}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--output {where}: directory {parent} is not writable")
    if path.exists() and not overwrite:
        raise ValueError(f"--output {path} exists; pass --overwrite to replace it")


def cmd_convert(args) -> int:
    from jaxembed.convert import convert

    out = convert(
        args.src, args.dst, dtype=args.dtype, verify=args.verify, tokenizer=args.tokenizer,
        query_template=args.query_template, default_instruction=args.default_instruction, overwrite=args.overwrite,
        revision=args.revision,
    )
    print(f"converted {args.src} -> {out}")
    return 0


def _file_blocks(path: Path, block_chars: int = 1 << 20):
    """A UTF-8 file as text blocks (memory bounded; newlines as written; a leading byte-order mark dropped),
    errors naming the byte."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    done = 0
    with open(path, "rb") as f:
        while block := f.read(block_chars):
            try:
                yield decoder.decode(block)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 at byte {done + e.start}") from None
            done += len(block)
        try:
            yield decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{path}: ends inside a UTF-8 character") from None


def _separated_sections(path: Path, separator: str):
    """The file's sections: the lines between lines equal to `separator` (newlines kept, trailing one dropped).
    A separator on the file's last line ends the last section; it does not start an empty one."""
    lines: list[str] = []
    ended = False  # the last line read was a separator
    with open(path, encoding="utf-8-sig", newline="") as f:  # a leading byte-order mark is not text
        for line in f:
            ended = line.rstrip("\r\n") == separator
            if ended:
                yield _without_last_newline("".join(lines))
                lines = []
            else:
                lines.append(line)
    if lines or not ended:
        yield _without_last_newline("".join(lines))


def _without_last_newline(text: str) -> str:
    """One line ending dropped, the one before the separator (a section's own blank lines are its text)."""
    for ending in ("\r\n", "\n", "\r"):
        if text.endswith(ending):
            return text[: -len(ending)]
    return text


def _cmd_embed_long(args, model) -> int:
    """--stream FILE (one embedding of the whole file) or --sections FILE (one per section, in context)."""
    from jaxembed.stream import special_ids
    from jaxembed.text import text_ids

    path = _readable(Path(args.stream or args.sections))
    options = dict(normalize_embeddings=not args.no_normalize, vertical_chunk_size=args.vertical_chunk_size,
                   show_progress_bar=not args.quiet)
    output = _output_options(args)
    check_output_options(model.embedding_dim, rows=1 if args.stream else None, **output)  # before the work
    prompt = model.query_prompt(args.instruction) or None if args.query else None
    if args.stream:
        emb = model.encode_stream(_file_blocks(path), prompt=prompt, **options)[None]
        rows = [{"file": str(path), "tokens": model.last_stats["tokens"]}]
    elif args.section_tokens is not None:
        with open(path, encoding="utf-8-sig", newline="") as f:  # the file's own line endings, as --stream reads it
            ids = text_ids(model.tokenizer, f.read(), add_special_tokens=False)["input_ids"]
        n = args.section_tokens
        sections = [list(ids[i: i + n]) for i in range(0, len(ids), n)]
        if sections:  # as encode_sections: the tokenizer's leading special ids (BOS) and the prompt's before section 0
            prefix, _ = special_ids(model.tokenizer)
            prompt_ids = text_ids(model.tokenizer, prompt, add_special_tokens=False)["input_ids"] if prompt else []
            sections[0] = list(prefix) + list(prompt_ids) + sections[0]
        emb = model.encode_id_sections(sections, normalize_embeddings=options["normalize_embeddings"],
                                       vertical_chunk_size=options["vertical_chunk_size"])
        rows = [{"file": str(path), "section": i, "tokens": [i * n, min(len(ids), (i + 1) * n)]}
                for i in range(len(emb))]
    else:
        emb = model.encode_sections(_separated_sections(path, args.separator), prompt=prompt, **options)
        rows = [{"file": str(path), "section": i} for i in range(len(emb))]
    if output["truncate_dim"] is not None:
        emb = truncate_embeddings(emb, output["truncate_dim"], normalize=not args.no_normalize)
    emb = quantize_embeddings(emb, output["precision"], ranges=output.get("ranges"),
                              calibration_embeddings=output.get("calibration_embeddings"))
    _write_embeddings(args.output, [{**r, "embedding": _json_vector(v)} for r, v in zip(rows, emb, strict=True)], emb)
    print(f"embedded {path} into {len(emb)} embedding(s)", file=sys.stderr)
    return 0


def _output_options(args) -> dict:
    """--precision, --truncate-dim, --ranges / --calibration as encode's keyword arguments."""
    if args.ranges is not None and args.calibration is not None:
        raise ValueError("--ranges and --calibration are two ways to set the int8/uint8 buckets: give one")
    arrays = {}
    for name, path in (("ranges", args.ranges), ("calibration_embeddings", args.calibration)):
        if path is not None:
            if not path.is_file():
                raise ValueError(f"--{name.split('_')[0]} {path}: no such file")
            try:
                arrays[name] = np.load(path, allow_pickle=False)
            except (ValueError, OSError) as err:
                raise ValueError(f"--{name.split('_')[0]} {path}: not a .npy array ({err})") from None
    return dict(precision=args.precision, truncate_dim=args.truncate_dim, **arrays)


def _json_vector(vec) -> list:
    """Quantised embeddings as their integers, float ones exactly: a float32 is a double, and JSON writes doubles
    so that they read back to the same value (7 decimals were up to 4e-4 off relative, for small components)."""
    return vec.tolist() if vec.dtype.kind in "iu" else vec.astype(np.float64).tolist()


def _write_embeddings(output: Path | None, records: list[dict], emb) -> None:
    """jsonl records on stdout or into output (.jsonl), or the array into output (.npy); atomically."""
    if output is None:
        for r in records:
            sys.stdout.write(json.dumps(r) + "\n")
    elif output.suffix == ".jsonl":
        write_atomically(output, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode("utf-8")))
    else:
        write_atomically(output, lambda f: np.save(f, emb))


def cmd_embed(args) -> int:
    if args.instruction is not None and not args.query:
        raise ValueError("--instruction is the query instruction: add --query (documents get none)")
    if args.corpus is not None or args.output_dir is not None:  # corpus-scale: sharded, resumable, data parallel
        from jaxembed.embed_corpus import cmd_embed_corpus

        return cmd_embed_corpus(args)
    import jaxembed

    if args.output is not None:
        check_output_path(args.output, (".npy", ".jsonl"), overwrite=args.overwrite)
    if args.stream or args.sections:
        if args.max_length is not None:
            raise ValueError("--max-length cuts each text of a list; --stream / --sections embed all of FILE "
                             "(cut the file first to embed less of it)")
        if args.max_tokens_per_batch is not None:
            raise ValueError("--max-tokens-per-batch sizes batches of texts; --stream / --sections run one "
                             "sequence (--vertical-chunk-size sets its memory)")
        if args.inputs:
            raise ValueError("--stream / --sections take one FILE; do not pass other inputs")
        if args.section_tokens is not None and args.separator is not None:
            raise ValueError("--separator and --section-tokens are two ways to cut sections: give one")
        if args.section_tokens is not None and args.section_tokens < 1:
            raise ValueError(f"--section-tokens must be a positive int, got {args.section_tokens}")
        if args.sections and args.section_tokens is None and args.separator is None:
            raise ValueError("--sections needs --separator LINE or --section-tokens N")
        return _cmd_embed_long(args, jaxembed.load(args.model, dtype=args.dtype, tokenizer=args.tokenizer))
    if args.separator is not None or args.section_tokens is not None:
        raise ValueError("--separator / --section-tokens go with --sections FILE")
    texts = _read_texts(args.inputs)
    if not texts:
        raise ValueError("no input texts")
    output = _output_options(args)
    model = jaxembed.load(args.model, dtype=args.dtype, tokenizer=args.tokenizer)
    kwargs = dict(
        batch_size=args.batch_size, normalize_embeddings=not args.no_normalize, max_length=args.max_length,
        vertical_chunk_size=args.vertical_chunk_size, show_progress_bar=not args.quiet,
        max_tokens_per_batch=args.max_tokens_per_batch, **output,
    )
    if args.query:
        emb = model.encode_query(texts, instruction=args.instruction, **kwargs)
    else:
        emb = model.encode_document(texts, **kwargs)
    def write_jsonl(stream):
        for text, vec in zip(texts, emb, strict=True):
            stream.write(json.dumps({"text": text, "embedding": _json_vector(vec)}) + "\n")

    if args.output is None:
        write_jsonl(sys.stdout)
    elif args.output.suffix == ".jsonl":
        def write_jsonl_bytes(f):
            text = io.TextIOWrapper(f, encoding="utf-8")
            write_jsonl(text)
            text.flush()
            text.detach()  # leave f open for write_atomically's fsync

        write_atomically(args.output, write_jsonl_bytes)
    else:
        write_atomically(args.output, lambda f: np.save(f, emb))
    s = model.last_stats
    print(f"embedded {s['texts']} texts, {s['tokens']} tokens in {s['seconds']:.2f} s "
          f"({s['tokens_per_second']:.0f} tokens/s, including the first-call JIT compilation)", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    from jaxembed.train.config import load_train_config
    from jaxembed.train.trainer import Trainer, initialize_distributed

    cfg = load_train_config(args.config)
    overrides = {k: v for k, v in (("max_steps", args.max_steps),) if v is not None}
    if overrides:
        import dataclasses

        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **overrides))
    initialize_distributed(cfg)
    trainer = Trainer(cfg, show_progress=not args.quiet)
    print(f"data: {trainer.data_summary()}", file=sys.stderr)
    rows = trainer.run()
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    for r in evals:
        print("eval " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
              file=sys.stderr)
    if cfg.output and not args.no_export:
        out = trainer.export()
        if out is not None:
            print(f"exported the merged model to {out}", file=sys.stderr)
    return 0


def cmd_corpus(args) -> int:
    from jaxembed.train.corpus import build_packages_corpus, build_stdlib_corpus

    build = build_packages_corpus if args.kind == "packages" else build_stdlib_corpus
    counts = build(args.out_dir, heldout_fraction=args.heldout_fraction, seed=args.seed)
    print(json.dumps(counts))
    return 0


def escaped(value: str) -> str:
    """A template or instruction from the command line: \\n, \\t and \\\\ as the characters they stand for (a
    shell's quotes keep a backslash, and a literal "\\n" in a template would change every query silently)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], value)


class Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line too (its default prints the whole usage block first); its subcommands'
    parsers are of this class as well (`add_subparsers` takes the parent's class)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the arguments)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jaxembed", description=__doc__,
                    epilog="jaxembed --debug COMMAND ...: show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a Hugging Face / mamba_ssm / Codestral checkpoint")
    p.add_argument("src", help="checkpoint directory or hub id")
    p.add_argument("dst", help="output directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="cast weights (default: as stored)")
    p.add_argument("--verify", action="store_true", help="compare with the PyTorch model on a few sequences")
    p.add_argument("--tokenizer", default=None, help="tokenizer path or hub id to store with the model")
    p.add_argument("--query-template", type=escaped, default=None,
                   help='query template, default "Instruction: {prompt}\\nQuery: " (\\n, \\t, \\\\ read as escapes)')
    p.add_argument("--default-instruction", type=escaped, default=None,
                   help="instruction used by encode_query when none is given (\\n, \\t, \\\\ read as escapes)")
    p.add_argument("--overwrite", action="store_true", help="replace a jaxembed checkpoint already at DST (atomically)")
    p.add_argument("--revision", default=None, help="hub ids: the branch, tag or commit to download (default: main)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("embed", help="embed texts, one per line, from files or stdin")
    p.add_argument("inputs", nargs="*", help="text files or pipes, one text per line ('-' or none: stdin)")
    p.add_argument("--model", required=True, help="converted or Hugging Face directory")
    p.add_argument("--output", "-o", type=Path, default=None, help=".npy or .jsonl (default: jsonl on stdout)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output file (atomically), or another run's --output-dir embeddings")
    p.add_argument("--query", action="store_true", help="texts are queries: apply the instruction template")
    p.add_argument("--instruction", type=escaped, default=None,
                   help="instruction for --query (\\n, \\t and \\\\ are read as escapes)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=None, help="truncate longer texts (with a warning)")
    p.add_argument("--max-tokens-per-batch", type=int, default=None)
    p.add_argument("--vertical-chunk-size", type=_vertical, default="auto", help="'auto', 'none' or V")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--no-normalize", action="store_true", help="skip L2 normalisation")
    p.add_argument("--truncate-dim", type=int, default=None,
                   help="keep the first N dimensions (Matryoshka), re-normalised unless --no-normalize")
    p.add_argument("--precision", choices=PRECISIONS, default="float32",
                   help="quantised output as sentence-transformers makes it (.npy keeps the dtype, jsonl integers)")
    p.add_argument("--ranges", type=Path, default=None, metavar="FILE.npy",
                   help="int8/uint8: per-dimension minima and maxima [2, d] (default: from the embedded texts)")
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE.npy",
                   help="int8/uint8: float embeddings [m, d] of a representative sample to take the ranges from "
                        "(e.g. `jaxembed embed SAMPLE -o FILE.npy` with the same --truncate-dim)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    long = p.add_mutually_exclusive_group()
    long.add_argument("--stream", metavar="FILE", default=None,
                      help="one embedding of the whole FILE, read and run V tokens at a time (constant memory)")
    long.add_argument("--sections", metavar="FILE", default=None,
                      help="one embedding per section of FILE, each with all the sections before it as context "
                           "(one pass); cut by --separator LINE or --section-tokens N")
    p.add_argument("--separator", default=None, help="--sections: lines equal to this separate the sections")
    p.add_argument("--section-tokens", type=int, default=None, help="--sections: N tokens per section")
    from jaxembed.embed_corpus import add_arguments as add_corpus_arguments

    add_corpus_arguments(p)  # --corpus FILE --output-dir DIR ...
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("train", help="train with InfoNCE: LoRA/QLoRA adapters, full fine-tuning or from scratch "
                                     "(configs/train/*.yaml)")
    p.add_argument("config", type=Path, help="training config yaml")
    p.add_argument("--max-steps", type=int, default=None, help="override train.max_steps")
    p.add_argument("--no-export", action="store_true", help="skip writing the merged model to `output`")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("corpus", help="build a code-search corpus (train/heldout jsonl) from this machine's Python "
                                      "sources: stdlib (~3k pairs) or packages (stdlib + installed packages, ~59k)")
    p.add_argument("kind", choices=["stdlib", "packages"])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--heldout-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_corpus)

    from jaxembed.train.mine import add_parser as add_mine_parser

    add_mine_parser(sub)
    from jaxembed.train.tokenizer import add_parser as add_tokenizer_parser

    add_tokenizer_parser(sub)
    from jaxembed.serve import add_parser as add_serve_parser

    add_serve_parser(sub)

    from jaxembed.convert.export import add_parser as add_export_parser

    add_export_parser(sub)

    p = sub.add_parser("eval", help="MTEB / LongEmbed through mteb, with the paper's instructions and summary table")
    p.add_argument("--model", required=True, help="converted or Hugging Face directory")
    p.add_argument("--benchmark", default=None,
                   help='e.g. "MTEB(eng, v2)", "MTEB(Multilingual, v2)", "MTEB(eng, v1)", LongEmbed')
    p.add_argument("--tasks", default=None, help="comma-separated mteb task names")
    p.add_argument("--local-tasks", default=None,
                   help="offline tasks from a jsonl of {query, positive[, negatives, module, name]} rows "
                        "(`jaxembed corpus stdlib` writes them; the trainer's {query, positive} data works too)")
    p.add_argument("--output", default="results",
                   help="mteb result cache folder (OUTPUT/results/<org>__<model>/<revision>/<Task>.json)")
    p.add_argument("--name", default=None, help="model name in the results, 'org/model' (default: jaxembed/<dir name>)")
    p.add_argument("--revision", default=None,
                   help="model revision in the results (default: fp-<hash of the model's tensors and the eval "
                        "settings>, so results are reused only for the same model and settings)")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per text (default: 512; LongEmbed: 32768; 0: no limit)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--instructions", choices=["paper", "paper-only", "none"], default="paper",
                   help="paper: Appendix H, then the task's own mteb prompt; paper-only; none")
    p.add_argument("--template", type=escaped, default=None,
                   help="'paper', 'e5' or a string with {prompt} (default: the model's; \\n, \\t, \\\\: escapes)")
    p.add_argument("--overwrite", choices=["always", "never", "only-missing", "only-cache"], default="only-missing",
                   help="mteb's strategy for results already under --output: only-missing (default) runs the "
                        "missing splits, always reruns everything, never skips a task whose results are there, "
                        "only-cache runs nothing")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--skip-data-check", action="store_true", help="do not load every dataset before encoding")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("bench", help="the paper's runtime / memory sweeps: chunk-size, vertical-chunk-size, "
                                     "model-comparison (CSV, figures, tables)")
    p.add_argument("sweep", nargs="?", help="a named sweep (configs/bench/NAME.yaml) or a spec .yaml")
    p.add_argument("--list", action="store_true", help="list the named sweeps")
    p.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto",
                   help="which shapes of the spec to run (auto: gpu when jax sees one)")
    p.add_argument("--output", default=None, help="output folder (default: bench-results/NAME-PLATFORM)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's results in the output folder")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per point (default: the spec's, 3)")
    p.add_argument("--batch", default=None, help="only these batch sizes of the spec, e.g. 1")
    p.add_argument("--lengths", default=None, help="replace the spec's lengths, e.g. 512,2k,8k")
    p.add_argument("--series", default=None, help="only these series (labels, comma-separated)")
    p.add_argument("--timeout", type=float, default=900.0, help="per-point wall-clock limit, s (default 900)")
    p.add_argument("--memory-limit-mib", type=float, default=None,
                   help="kill a point whose host RSS exceeds this (default: CPU 60%% of available memory, at most "
                        "16 GiB; GPU 90%% of available memory, the device's own memory deciding)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per point (default: all available)")
    p.add_argument("--quiet", action="store_true", help="no per-point lines")
    p.set_defaults(func=_cmd_bench)
    return parser


def _cmd_bench(args) -> int:
    from jaxembed.bench import cmd_bench

    return cmd_bench(args)


def _cmd_eval(args) -> int:
    from jaxembed.eval.run import cmd_eval

    return cmd_eval(args)


def main(argv=None) -> int:
    """Every error ends as one line on stderr, `jaxembed COMMAND: error: what (where)`, and exit 2;
    `--debug` (before the command) shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv[:1]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv[1:] if debug else argv)
    if unknown:  # named by the command's parser, so the pointer is to its --help
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(args.command, warnings.showwarning)
            return args.func(args)
    except KeyboardInterrupt:
        print(f"jaxembed {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped (`| head`): quiet, as other command-line tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except Exception as err:
        if debug:
            raise
        print(f"jaxembed {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2


def _one_line_warnings(command: str, show_others):
    """jaxembed's own warnings as `jaxembed COMMAND: warning: what`, not Python's file:line and source line
    (other libraries' as they show them)."""
    package = Path(__file__).resolve().parent

    def show(message, category, filename, lineno, file=None, line=None):
        if package in Path(filename).resolve().parents:
            print(f"jaxembed {command}: warning: {message}", file=file or sys.stderr)
        else:
            show_others(message, category, filename, lineno, file, line)

    return show


def one_line(err: BaseException) -> str:
    """An exception as one line: our own errors (ValueError and friends) by their message, anything
    else with its type, and a pointer to --debug for the traceback."""
    from jaxembed import errors

    first = (str(err).strip().splitlines() or [""])[0][:400]
    ours = (errors.ConfigError, errors.ConversionError, errors.DataError, errors.SpecError, errors.MissingDataError,
            errors.TrainingDivergedError, errors.CheckpointError)
    if isinstance(err, ours):
        return str(err).strip()  # our messages may list several problems, one per line
    if isinstance(err, (ValueError, TypeError, FloatingPointError)):
        return first
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or first}"
    extra = EXTRAS.get((getattr(err, "name", None) or "").split(".")[0]) if isinstance(err, ImportError) else None
    if extra:
        return f"{first}: pip install 'jaxembed[{extra}]'"
    return f"{type(err).__name__}: {first} (run `jaxembed --debug ...` for the traceback)"


# the optional dependencies, by the extra that installs them (pyproject.toml)
EXTRAS = {"mteb": "eval", "matplotlib": "bench", "mamba2_jax": "bench", "torch": "torch", "tensorboardX": "tensorboard",
          **dict.fromkeys(("starlette", "uvicorn", "prometheus_client", "orjson"), "serve")}


if __name__ == "__main__":
    sys.exit(main())
