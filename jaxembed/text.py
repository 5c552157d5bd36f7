"""Text in, token ids out: the query template, tokenizer loading, tokenizing with EOS appended,
checks of user input, and the length buckets that batch ids for `schedule.embed` (padding and
the number of compiled programs both bounded). Nothing here knows about models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

QUERY_TEMPLATE = "Instruction: {prompt}\nQuery: "  # Section 3.1; E5 models use "Instruct: {prompt}\nQuery: "
MIN_BUCKET = 16
# bucket lengths above Q are Q times one of these: few programs, bounded padding
_MULTIPLIERS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def bucket_length(n: int, chunk_size: int) -> int:
    """The padded length for a batch whose longest sequence has n tokens.

    Powers of two up to Q, then Q times 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, ...: a
    corpus of mixed lengths compiles O(log(max length / Q)) programs, and a batch is padded by
    at most 2x, 1.5x beyond 2Q and 1.25x beyond 32Q (the chunked SSD computes in whole chunks
    of Q anyway). Vertical inference runs the t % V tail as a shorter chunk, so no bucket is
    rounded up to a multiple of V.
    """
    if n <= chunk_size:
        return min(chunk_size, max(MIN_BUCKET, 1 << max(0, n - 1).bit_length()))
    units = -(-n // chunk_size)
    for m in _MULTIPLIERS:
        if m >= units:
            return m * chunk_size
    step = 1 << max(0, (units // 4).bit_length() - 1)  # beyond the table: multiples of 2^k, waste < 25%
    return -(-units // step) * step * chunk_size


def batch_bucket(n: int, max_rows: int) -> int:
    """Pad the batch dimension to a power of two (at most max_rows): few programs, < 2x waste."""
    return min(max_rows, 1 << max(0, n - 1).bit_length())


def cut_ids(ids: list[int], max_length: int | None, eos: int) -> tuple[list[int], bool]:
    """ids cut to max_length keeping the EOS at the end, and whether they were cut."""
    if max_length is None or len(ids) <= max_length:
        return ids, False
    return ids[: max_length - 1] + [eos], True


def tokenize_texts(tokenizer, texts, eos: int, max_length: int | None = None) -> tuple[list[list[int]], int]:
    """(token ids with EOS appended, number of texts cut to max_length). A cut text keeps its EOS."""
    encoded = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    out, truncated = [], 0
    for ids in encoded:
        ids = list(ids)
        if not ids or ids[-1] != eos:
            ids.append(eos)
        ids, cut = cut_ids(ids, max_length, eos)
        truncated += cut
        out.append(ids)
    return out, truncated


def make_batches(order, lengths, batch_size, budget, bucket):
    """Consecutive runs of the length-sorted order: at most batch_size rows and, with a budget,
    at most `budget` padded tokens (a longer single sequence still gets a batch of its own)."""
    batches, i = [], 0
    while i < len(order):
        padded = bucket(int(lengths[order[i]]))  # sorted descending: the first row is the longest
        n = batch_size
        if budget is not None:
            n = max(1, min(batch_size, budget // padded))
        rows = order[i : i + n]
        batches.append((rows, padded, n))
        i += n
    return batches


def check_texts(texts) -> list[str]:
    if isinstance(texts, (bytes, bytearray)) or not hasattr(texts, "__iter__"):
        raise TypeError(f"texts must be a string or a sequence of strings, got {type(texts).__name__}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] is {type(t).__name__} ({t!r:.40}), not a string")
    return texts


def check_token_ids(ids, vocab_size: int) -> list[np.ndarray]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"ids must be a sequence of token-id sequences, got {type(ids).__name__}")
    seqs = []
    for i, seq in enumerate(ids):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
            raise TypeError(f"ids[{i}] must be a sequence of ints, got {type(seq).__name__}")
        arr = np.asarray(seq)
        if arr.ndim != 1:
            raise ValueError(f"ids[{i}] must be one-dimensional, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"ids[{i}] is empty; every sequence needs at least one token (texts get EOS)")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"ids[{i}] must hold ints, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"ids[{i}][{j}] = {int(arr[j])} is out of the vocabulary range [0, {vocab_size})")
        seqs.append(arr.astype(np.int32))
    return seqs


def load_tokenizer(spec, directory: Path | None = None):
    """A transformers tokenizer from an object, a path or hub id, or the checkpoint directory."""
    if spec is not None and not isinstance(spec, (str, Path)):
        return spec
    from transformers import AutoTokenizer

    source = spec if spec is not None else directory
    if source is None:
        return None
    if spec is None and not any((Path(directory) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(source))
    except Exception as err:
        raise ValueError(f"could not load a tokenizer from {source}: {err}") from None
