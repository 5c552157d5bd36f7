"""Text in, token ids out: the query template, tokenizer loading, tokenizing with EOS appended,
checks of user input, and the length buckets that batch ids for `schedule.embed` (padding and
the number of compiled programs both bounded). Nothing here knows about models.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from pathlib import Path

import numpy as np

QUERY_TEMPLATE = "Instruction: {prompt}\nQuery: "  # Section 3.1; E5 models use "Instruct: {prompt}\nQuery: "


def check_query_template(template, *, name: str = "query_template", error=ValueError) -> str:
    """A query template is text with exactly one placeholder, {prompt} (the instruction), where it may
    appear more than once; literal braces are doubled. Anything else would fail at the first query."""
    if not isinstance(template, str):
        raise error(f"{name} must be a string with '{{prompt}}', got {type(template).__name__}")
    try:
        fields = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as err:
        raise error(f"{name} {template!r} is not a valid template ({err}); write a literal brace as {{{{ or }}}}") \
            from None
    if fields != {"prompt"}:
        other = ", ".join("{" + field + "}" for field in sorted(fields - {"prompt"}))
        raise error(f"{name} must contain '{{prompt}}' and no other placeholder, got {template!r}"
                    + (f" (other placeholders: {other}; write a literal brace as {{{{ or }}}})" if other else ""))
    return template


def same_text_key(text: str) -> str:
    """Texts equal up to whitespace and case are one text (mine's candidates, local tasks' stand-ins)."""
    return " ".join(text.split()).casefold()


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


def row_cap(padded_len: int, batch_size: int, budget: int | None) -> int:
    """Rows of a batch padded to padded_len: batch_size, and at most `budget` padded tokens (at least one row)."""
    return batch_size if budget is None else max(1, min(batch_size, budget // padded_len))


def cut_ids(ids: list[int], max_length: int | None, eos: int) -> tuple[list[int], bool]:
    """ids cut to max_length keeping the EOS at the end, and whether they were cut."""
    if max_length is None or len(ids) <= max_length:
        return ids, False
    return ids[: max_length - 1] + [eos], True


# How text becomes ids besides the tokenizer's own rules; part of every cache key and run identity whose
# contents depend on it, so ids made under an older rule are never reused ("special-as-text": `text_ids`)
TEXT_TOKENIZATION = "special-as-text"


def tokenizer_identity(tokenizer) -> str:
    """A hash of the tokenizer's full definition (vocabulary, merges, normalizer, pre-tokenizer, post-processor,
    special tokens) and the text rule (`TEXT_TOKENIZATION`): what every cache of ids, or of anything made from
    them, is keyed by."""
    import hashlib

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:  # a slow tokenizer: its vocabulary and class stand in for the definition
        text = repr((type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())))
    special = repr((tokenizer.eos_token_id, getattr(tokenizer, "bos_token_id", None), TEXT_TOKENIZATION))
    return hashlib.sha256((text + special).encode("utf-8")).hexdigest()


def text_ids(tokenizer, text, *, add_special_tokens: bool, **kwargs):
    """The tokenizer's encoding of user text, with special-token strings in it read as text
    (`split_special_tokens`): "</s>" in a page of HTML is Mistral's EOS string, and parsed as the token
    it would end the embedded sequence early, or take the place of the EOS that `tokenize_texts` appends.
    A text with a lone surrogate is a ValueError saying so (the tokenizer's own error names neither)."""
    for i, one in enumerate([text] if isinstance(text, str) else text):
        problem = lone_surrogate(one) if isinstance(one, str) else None
        if problem:
            raise ValueError(f"text {i} {problem}" if not isinstance(text, str) else f"the text {problem}")
    if type(tokenizer).__name__.startswith("MistralCommon"):  # mistral-common never reads them from text, and
        return tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)  # refuses the option
    return tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True, **kwargs)


def tokenize_texts(tokenizer, texts, eos: int, max_length: int | None = None) -> tuple[list[list[int]], int]:
    """(token ids with EOS appended, number of texts cut to max_length). A cut text keeps its EOS. EOS is
    appended unless the tokenizer's own special tokens already end the text with it (text itself
    cannot: `text_ids`)."""
    encoded = text_ids(tokenizer, list(texts), add_special_tokens=True)["input_ids"]
    out, truncated = [], 0
    for ids in encoded:
        ids = list(ids)
        if not ids or ids[-1] != eos:
            ids.append(eos)
        ids, cut = cut_ids(ids, max_length, eos)
        truncated += cut
        out.append(ids)
    return out, truncated


def make_batches(lengths, batch_size: int, budget: int | None, chunk_size: int) -> list[tuple[np.ndarray, int, int]]:
    """The device batches for sequences of these lengths: [(row indices, padded length, padded row count)].

    Rows are taken longest first. A batch is padded to its first row's `bucket_length` and holds at most
    `row_cap` rows; a further row joins it only if it is longer than half that padded length, or if the
    batch is at most Q long (padding a short row costs less than a device call). In a sorted corpus the
    neighbours of a row are about as long, so batches are full and one program serves each bucket; inputs
    of mixed lengths that arrive together (a server's merged requests) do not pad a short input to a long
    one's length. The row count is padded to a power of two (`batch_bucket`), so a partial batch adds at
    most one program per power of two.
    """
    lengths = np.asarray(lengths)
    order = np.argsort(-lengths, kind="stable")
    batches, i = [], 0
    while i < len(order):
        padded = bucket_length(int(lengths[order[i]]), chunk_size)
        cap = row_cap(padded, batch_size, budget)
        end = i + 1
        while end < len(order) and end - i < cap and (padded <= chunk_size or 2 * int(lengths[order[end]]) > padded):
            end += 1
        batches.append((order[i:end], padded, batch_bucket(end - i, cap)))
        i = end
    return batches


def batch_shapes(max_length: int, batch_size: int, budget: int | None, chunk_size: int, *,
                 partial_batches: bool = False) -> list[tuple[int, int]]:
    """Every [rows, padded length] that `make_batches` gives for sequences of up to max_length tokens: per
    length bucket, a full batch and, with partial_batches, the powers of two below it (a last or lone batch)."""
    shapes, n = [], 1
    while n <= max_length:
        padded = bucket_length(n, chunk_size)
        cap = row_cap(padded, batch_size, budget)
        rows = {cap} | ({1 << k for k in range(cap.bit_length()) if 1 << k < cap} if partial_batches else set())
        shapes += [(r, padded) for r in sorted(rows, reverse=True)]
        n = padded + 1
    return shapes


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a str holds them only unpaired (JSON escapes, surrogateescape)


def lone_surrogate(text: str) -> str | None:
    """Why `text` is not text, or None: a lone UTF-16 surrogate (e.g. JSON's "\\ud800"), which no tokenizer
    or UTF-8 encoder takes."""
    found = _LONE_SURROGATE.search(text)
    return None if found is None else (f"holds a lone surrogate (U+{ord(found[0]):04X} at character "
                                       f"{found.start()}), which is not text")


def check_texts(texts) -> list[str]:
    if isinstance(texts, (bytes, bytearray, Mapping)) or not hasattr(texts, "__iter__"):  # a dict would give its keys
        raise TypeError(f"texts must be a string or a sequence of strings, got {type(texts).__name__}")
    if isinstance(texts, (set, frozenset)):  # rows come back in input order: a set has none
        raise TypeError(f"texts must be ordered (rows come back in their order), got a {type(texts).__name__}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] is {type(t).__name__} ({t!r:.40}), not a string")
        problem = lone_surrogate(t)
        if problem:
            raise ValueError(f"texts[{i}] {problem}")
    return texts


def check_token_ids(ids, vocab_size: int) -> list[np.ndarray]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"ids must be a sequence of token-id sequences, got {type(ids).__name__}")
    seqs = []
    for i, seq in enumerate(ids):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
            raise TypeError(f"ids[{i}] must be a sequence of ints, got {type(seq).__name__}")
        if any(isinstance(x, (bool, np.bool_)) for x in seq) if isinstance(seq, (list, tuple)) else False:
            raise TypeError(f"ids[{i}] holds booleans, not token ids")
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
