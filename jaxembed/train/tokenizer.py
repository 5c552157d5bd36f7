"""Byte-level BPE tokenizers trained on local text: `jaxembed tokenizer TRAIN OUT_DIR --vocab-size N`.

The built-in ``stdlib-bpe:N`` is trained on 200k characters of standard-library docstrings, so Python
code falls into small pieces (``def`` is two tokens, `` self`` three). This trains the same kind of
tokenizer (byte-level BPE, ``<eos>`` = id 0, ``<pad>`` = id 1) on the queries and positives of a training
file: the training split only, so no held-out text shapes the vocabulary. Larger is not always better for
a model trained from scratch: each token then has fewer training examples (docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from jaxembed.errors import DataError

SPECIAL_TOKENS = ("<eos>", "<pad>")  # ids 0 and 1, the ids the stdlib BPE and the model configs use
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte, then the special tokens


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` with up to `vocab_size` tokens learnt from `texts` (never
    fewer than the 256 bytes and the special tokens; fewer than `vocab_size` if the texts run out of merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1])


def training_texts(paths: Sequence[Path]) -> list[str]:
    """Every query and positive of the training files, read and checked as the trainer reads them.
    Negatives are left out: in mined or in-module files they are other records' positives."""
    from jaxembed.train.data import _as_paths, _read_records

    texts = []
    for path in _as_paths(paths):
        for rec in _read_records(path):
            texts += [rec["query"], rec["positive"]]
    return texts


def write_tokenizer(tokenizer, out_dir: Path, *, overwrite: bool = False) -> None:
    """save_pretrained into a temporary sibling, then swapped into `out_dir`: a reader sees no half-written
    tokenizer. An existing `out_dir` is replaced only with `overwrite` and only if it holds tokenizer files alone."""
    from jaxembed import checkpoint

    out_dir = Path(out_dir).expanduser().resolve()  # a symlink's target is what gets replaced, not the link
    _check_out_dir(out_dir, overwrite=overwrite)
    checkpoint._clear_stale_temporaries(out_dir)
    tmp = checkpoint.temporary_sibling(out_dir)
    try:
        tokenizer.save_pretrained(tmp)
        checkpoint._fsync_tree(tmp)
        checkpoint._swap_into_place(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _check_out_dir(out_dir: Path, *, overwrite: bool) -> None:
    """Refuse, before training, an OUT_DIR that must not be replaced: a file, or a directory with anything in it
    besides tokenizer files (the swap replaces the whole directory)."""
    from jaxembed.checkpoint import TOKENIZER_FILES

    out_dir = Path(out_dir).expanduser().resolve()
    if not out_dir.parent.is_dir():
        raise DataError(f"{out_dir}: directory {out_dir.parent} does not exist")
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a directory; name a new or empty directory")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()
                     if not (p.is_file() and p.name in TOKENIZER_FILES))
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise DataError(f"{out_dir}: holds files a tokenizer does not write ({shown}); refusing to replace it "
                        "(choose a new or empty directory)")
    if not overwrite:
        raise DataError(f"{out_dir}: a tokenizer is already there; pass --overwrite to replace it")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `jaxembed tokenizer` on the CLI's subparsers."""
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on the queries and positives of "
                                         "training files (for models trained from scratch)")
    p.add_argument("train", type=Path, nargs="+", help="training triples: .jsonl, .json or .parquet")
    p.add_argument("out_dir", type=Path, help="directory to write (model.tokenizer in a training config)")
    p.add_argument("--vocab-size", type=int, required=True, help="tokens, the 256 bytes and <eos>, <pad> included")
    p.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    p.set_defaults(func=cmd_tokenizer)
    return p


def cmd_tokenizer(args) -> int:
    if args.vocab_size < MIN_VOCAB:
        raise DataError(f"--vocab-size must be >= {MIN_VOCAB} (256 bytes + <eos>, <pad>), got {args.vocab_size}")
    _check_out_dir(args.out_dir, overwrite=args.overwrite)  # before the work, not after it
    texts = training_texts(args.train)
    if not any(texts):
        raise DataError(f"{', '.join(map(str, args.train))}: no text to learn merges from (no records, or only empty "
                        "queries and positives)")
    tokenizer = train_bpe(texts, args.vocab_size)
    if len(tokenizer) < args.vocab_size:
        print(f"jaxembed tokenizer: the texts ran out of merges at {len(tokenizer)} tokens (--vocab-size "
              f"{args.vocab_size}); the model's vocab_size can be {len(tokenizer)}", file=sys.stderr)
    write_tokenizer(tokenizer, args.out_dir, overwrite=args.overwrite)
    print(json.dumps({"texts": len(texts), "vocab_size": len(tokenizer), "out_dir": str(args.out_dir)}))
    return 0
