"""Streams and sections (issue #21): memory of `encode_stream` against the length, and the cost of
`encode_sections` against one `encode` of the whole document.

    python benchmarks/stream_sections.py [--config configs/models/bench-memory-4l-256.yaml] [--threads 2]
        [--lengths 64k,1M] [--doc-tokens 32k --sections 64]

1. memory: each length in a fresh process (`--point N`): `Embedder.encode_stream` over a generator of
   text pieces (stdlib sources, repeated) of about N tokens; the process's peak RSS (VmHWM) and tokens/s.
   Ratio: the longest against the shortest (the acceptance: <= 1.10 from 64k to 1M).
2. cost: a random document of --doc-tokens ids cut into --sections equal sections: `encode_id_sections`
   (every section's contextual embedding, sections streamed) and the jitted `embed_sections` (boundaries
   an array) against `encode_ids` of the whole document + EOS, the same V, min of 3 timed calls after a
   warm-up (compilation excluded). The acceptance: <= 1.15x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, cpu_model, parse_int_list, pin_threads


def _embedder(config_path: Path):
    import jax

    from jaxembed import models
    from jaxembed.config import load_config
    from jaxembed.embedder import Embedder
    from jaxembed.testing import make_tokenizer

    cfg = load_config(config_path)
    tokenizer = make_tokenizer(min(4096, cfg.vocab_size))
    params = models.family(cfg).init_params(cfg, jax.random.key(0))
    return Embedder(params, cfg, tokenizer=tokenizer)


def _text_pieces(tokenizer, tokens: int):
    """Lines of this machine's stdlib sources, cycled, at least `tokens` tokens in all (the ratio of
    characters to tokens is measured on the first 40 files, with 10% to spare)."""
    from jaxembed.train.corpus import stdlib_dir

    files = sorted(stdlib_dir().glob("*.py"))
    sample = "".join(f.read_text(encoding="utf-8", errors="replace") for f in files[:40])
    chars_per_token = len(sample) / len(tokenizer(sample)["input_ids"])
    budget = int(1.1 * tokens * chars_per_token)
    while True:
        for path in files:
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
                if budget <= 0:
                    return
                yield line[:budget]
                budget -= len(line)


def point(config: Path, tokens: int) -> dict:
    import time

    from jaxembed.bench.measure import hwm_rss_mib

    model = _embedder(config)
    start = time.perf_counter()
    model.encode_stream(_text_pieces(model.tokenizer, tokens), show_progress_bar=False)
    seconds = time.perf_counter() - start
    return {"tokens": model.last_stats["tokens"], "seconds": seconds, "peak_rss_mib": hwm_rss_mib()}


def cost(config: Path, doc_tokens: int, n_sections: int) -> dict:
    import jax
    import numpy as np

    from jaxembed.bench.measure import time_run
    from jaxembed.stream import embed_sections

    model = _embedder(config)
    ids = np.random.default_rng(0).integers(1, model.vocab_size, doc_tokens).tolist()
    size = doc_tokens // n_sections
    sections = [ids[i * size: (i + 1) * size] for i in range(n_sections)]
    V = model.resolve_vertical_chunk_size("auto", 1)
    whole = time_run(lambda: model.encode_ids([ids + [model.eos_token_id]], vertical_chunk_size=V), repeats=3)
    contextual = time_run(lambda: model.encode_id_sections(sections, vertical_chunk_size=V), repeats=3)
    ends = np.arange(1, n_sections + 1, dtype=np.int32) * size
    doc = np.asarray(ids, np.int32)
    jitted = time_run(lambda: jax.block_until_ready(embed_sections(model.params, model.config, doc, ends,
                                                                   eos=model.eos_token_id, vertical_chunk_size=V)),
                      repeats=3)
    return {"V": V, "whole_s": whole.min_s, "sections_s": contextual.min_s, "jit_s": jitted.min_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/models/bench-memory-4l-256.yaml")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=parse_int_list, default="64k,1M")
    parser.add_argument("--doc-tokens", type=parse_int_list, default="32k")
    parser.add_argument("--sections", type=int, default=64)
    parser.add_argument("--point", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    pinned = pin_threads(args.threads)
    if args.point is not None:
        print(json.dumps(point(args.config, args.point)))
        return 0

    points = {}
    for n in args.lengths:
        out = subprocess.run([sys.executable, __file__, "--config", str(args.config), "--threads", str(args.threads),
                              "--point", str(n)], capture_output=True, text=True, check=True)
        points[n] = json.loads(out.stdout.strip().splitlines()[-1])
    costs = cost(args.config, args.doc_tokens[0], args.sections)

    import jax

    print(f"# streams and sections ({args.config.name}, {pinned['threads']} threads, {cpu_model()}, "
          f"jax {jax.__version__}, {jax.devices()[0].platform})\n")
    print("| encode_stream | tokens | peak RSS (MiB) | tokens/s |")
    print("|---|---|---|---|")
    for p in points.values():
        print(f"| fresh process | {p['tokens']:,} | {p['peak_rss_mib']:.0f} | {p['tokens'] / p['seconds']:,.0f} |")
    rss = [p["peak_rss_mib"] for p in points.values()]
    print(f"\npeak RSS, longest / shortest: **{rss[-1] / rss[0]:.3f}**\n")
    print(f"| {args.doc_tokens[0]:,}-token document, V = {costs['V']} | seconds | / whole |")
    print("|---|---|---|")
    print(f"| encode_ids of the whole document (1 embedding) | {costs['whole_s']:.3f} | 1.00 |")
    print(f"| encode_id_sections, {args.sections} sections ({args.sections} embeddings) | {costs['sections_s']:.3f} | "
          f"**{costs['sections_s'] / costs['whole_s']:.3f}** |")
    print(f"| embed_sections, one jitted program, boundaries an array | {costs['jit_s']:.3f} | "
          f"**{costs['jit_s'] / costs['whole_s']:.3f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
