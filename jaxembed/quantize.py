"""Output options as sentence-transformers has them: `truncate_dim` (Matryoshka truncation) and
`precision` (scalar int8/uint8 and binary quantisation), for `Embedder.encode`, the CLI and the server.

`quantize_embeddings` has the semantics of `sentence_transformers.util.quantization.quantize_embeddings`
(same buckets, same bit packing, same dtypes; tests/test_quantize.py compares them), with clear errors
for the inputs it would misread (mis-shaped ranges that numpy would broadcast, non-finite values whose
integer cast is undefined). sentence-transformers is not imported here: it is a test-only reference.
"""

from __future__ import annotations

import numbers
import warnings

import numpy as np

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")

# sentence-transformers warns below this many embeddings when int8/uint8 ranges come from the batch itself
MIN_CALIBRATION_ROWS = 100


def check_precision(precision) -> str:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    return precision


def check_truncate_dim(dim, embedding_dim: int, *, optional: bool = False) -> None:
    """dim must be an int in 1..embedding_dim (None too where `optional`)."""
    if dim is None and optional:
        return
    if not isinstance(dim, numbers.Integral) or isinstance(dim, bool) or not 1 <= dim <= embedding_dim:
        raise ValueError(f"truncate_dim must be an int from 1 to the embedding dimension {embedding_dim}"
                         f"{' or None' if optional else ''}, got {dim!r}")


def _checked_ranges(ranges, dim: int) -> np.ndarray:
    """int8/uint8 calibration ranges as a float array [2, dim] of finite minima and maxima."""
    ranges = _float_array("ranges", ranges, ndims=(2,))
    if ranges.shape != (2, dim):
        raise ValueError(f"ranges must have shape (2, {dim}) (per-dimension minima and maxima of the "
                         f"{dim}-dimensional output embeddings), got {ranges.shape}")
    if not np.isfinite(ranges).all():
        raise ValueError("ranges have non-finite values (NaN or inf)")
    reversed_dims = np.flatnonzero(ranges[0] > ranges[1])
    if reversed_dims.size:  # rows swapped ([maxima; minima]): every code would be clipped or inverted
        raise ValueError(f"ranges: row 0 must hold the minima and row 1 the maxima, but the minimum is above the "
                         f"maximum in {reversed_dims.size} of {dim} dimensions (e.g. dimension {reversed_dims[0]})")
    return ranges


def check_output_options(embedding_dim: int, *, precision: str = "float32", truncate_dim: int | None = None,
                         ranges=None, calibration_embeddings=None, rows: int | None = None) -> None:
    """Check encode's output options before any embedding is computed: precision, truncate_dim, and ranges /
    calibration_embeddings of the (truncated) dimension, given only with int8/uint8; `rows`, the number of
    embeddings to come, must be more than one when int8/uint8 ranges would come from them."""
    check_precision(precision)
    check_truncate_dim(truncate_dim, embedding_dim, optional=True)
    dim = embedding_dim if truncate_dim is None else int(truncate_dim)
    if precision not in ("int8", "uint8"):
        if ranges is not None or calibration_embeddings is not None:
            raise ValueError(f"ranges / calibration_embeddings are for int8 and uint8 precision, not {precision}")
        return
    if ranges is not None:
        _checked_ranges(ranges, dim)
    elif calibration_embeddings is not None:
        calibration = _float_array("calibration_embeddings", calibration_embeddings, ndims=(2,))
        if calibration.shape[1] != dim:
            raise ValueError(f"calibration_embeddings have {calibration.shape[1]} dimensions, the output embeddings "
                             f"{dim}")
    elif rows == 1:
        raise ValueError(f"cannot compute {precision} quantization ranges from a single embedding: pass ranges= "
                         "or calibration_embeddings= from a representative set of embeddings")


def output_dim(precision: str, dim: int) -> int:
    """The last dimension of `quantize_embeddings`' output for `dim`-dimensional embeddings (binary: 8 per byte)."""
    return -(-dim // 8) if check_precision(precision).endswith("binary") else dim


def truncate_embeddings(embeddings, dim: int, *, normalize: bool) -> np.ndarray:
    """The first `dim` dimensions of each embedding ([..., d] -> [..., dim]), L2-normalised again when
    `normalize`. sentence-transformers truncates first and then normalises (`SentenceTransformer.encode`
    with truncate_dim and normalize_embeddings=True: `truncate_embeddings`, then
    `torch.nn.functional.normalize(x, p=2, dim=1)`, which is x / max(|x|, 1e-12)); so does this. Embeddings that
    were normalised before truncation give the same result: normalising is invariant to a positive scale."""
    embeddings = _float_array("embeddings", embeddings, ndims=(1, 2))
    check_truncate_dim(dim, embeddings.shape[-1])
    out = embeddings[..., : int(dim)]
    if normalize:
        norm = np.linalg.norm(out, axis=-1, keepdims=True)
        out = out / np.maximum(norm, np.asarray(1e-12, out.dtype))
    return np.ascontiguousarray(out)


def quantize_embeddings(embeddings, precision: str, *, ranges=None, calibration_embeddings=None) -> np.ndarray:
    """Float embeddings [n, d] (or [d]) at a lower precision, as sentence-transformers does it:

    - "float32": the embeddings as float32.
    - "int8" / "uint8": per dimension, 256 equal buckets between a minimum and a maximum:
      floor((x - min) / ((max - min) / 255)), clipped to 0..255 (a dimension with max == min has step 1);
      uint8 stores the bucket, int8 the bucket - 128. The minima and maxima are `ranges` ([2, d]: row 0 the
      minima, row 1 the maxima) if given, else those of `calibration_embeddings` ([m, d]), else those of
      `embeddings` themselves: then the result depends on the batch (a warning says so below 100 embeddings,
      and a single embedding is an error). Use ranges from a representative set for anything you store.
    - "binary" / "ubinary": one bit per dimension, 1 where x > 0, packed 8 to a byte (big-endian, the last
      byte zero-padded): [n, ceil(d / 8)]; ubinary as uint8, binary as int8 (the byte - 128).
    """
    check_precision(precision)
    embeddings = _float_array("embeddings", embeddings, ndims=(1, 2))
    if embeddings.ndim == 2 and embeddings.shape[0] == 0:
        dim = embeddings.shape[1]
        if precision == "float32":
            return embeddings.astype(np.float32)
        return np.zeros((0, output_dim(precision, dim)), np.int8 if precision in ("int8", "binary") else np.uint8)
    if precision == "float32":
        return embeddings.astype(np.float32)
    if precision.endswith("binary"):
        packed = np.packbits(embeddings > 0, axis=-1)
        return (packed - 128).astype(np.int8) if precision == "binary" else packed
    # int8 / uint8
    if not np.isfinite(embeddings).all():
        raise ValueError(f"embeddings have non-finite values (NaN or inf): {precision} buckets are undefined")
    dim = embeddings.shape[-1]
    if ranges is None:
        ranges = calibration_ranges(embeddings if calibration_embeddings is None else calibration_embeddings,
                                    dim=dim, precision=precision, calibration=calibration_embeddings is not None,
                                    stacklevel=3)
    else:
        ranges = _checked_ranges(ranges, dim)
    ranges = ranges.astype(np.float32, copy=False)
    starts = ranges[0, :]
    steps = (ranges[1, :] - starts) / 255
    steps = np.where(steps == 0, 1, steps)
    buckets = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
    return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)


def calibration_ranges(embeddings, *, dim: int | None = None, precision: str = "int8", calibration: bool = True,
                       stacklevel: int = 2) -> np.ndarray:
    """[2, d]: the per-dimension minima and maxima of float embeddings [m, d], the `ranges` for int8/uint8.
    `calibration=False` means the embeddings to quantise stand in for a calibration set (sentence-transformers'
    default): one embedding is then an error, and fewer than 100 a warning."""
    name = "calibration_embeddings" if calibration else "embeddings"
    embeddings = _float_array(name, embeddings, ndims=(1, 2) if not calibration else (2,))
    if not calibration and (embeddings.ndim == 1 or embeddings.shape[0] == 1):
        raise ValueError(f"cannot compute {precision} quantization ranges from a single embedding: pass ranges= "
                         "or calibration_embeddings= from a representative set of embeddings")
    if dim is not None and embeddings.shape[1] != dim:
        raise ValueError(f"{name} have {embeddings.shape[1]} dimensions, the embeddings to quantize {dim}")
    if embeddings.shape[0] == 0:
        raise ValueError(f"{name} is empty: no rows to compute {precision} ranges from")
    if embeddings.shape[0] == 1:  # min == max in every dimension: the buckets would mean nothing
        raise ValueError(f"{name} has one row: {precision} ranges need the spread of a representative set")
    if not np.isfinite(embeddings).all():
        raise ValueError(f"{name} have non-finite values (NaN or inf)")
    if not calibration and embeddings.shape[0] < MIN_CALIBRATION_ROWS:
        warnings.warn(f"computing {precision} quantization ranges from the {embeddings.shape[0]} embeddings being "
                      f"quantized: the result depends on the batch, and ranges are more stable from more embeddings; "
                      f"pass ranges= or calibration_embeddings= from a representative set", stacklevel=stacklevel)
    return np.vstack((np.min(embeddings, axis=0), np.max(embeddings, axis=0)))


def _float_array(name: str, value, *, ndims: tuple[int, ...]) -> np.ndarray:
    try:
        array = np.asarray(value)
    except ValueError as err:  # ragged nested lists
        raise ValueError(f"{name} is not an array of numbers ({err})") from None
    if array.dtype.kind != "f":
        hint = " (already quantized? quantize float embeddings)" if array.dtype in (np.int8, np.uint8) else ""
        raise ValueError(f"{name} must be floating point, got dtype {array.dtype}{hint}")
    if array.ndim not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {array.shape}")
    if array.shape[-1] == 0:
        raise ValueError(f"{name} have no dimensions (shape {array.shape})")
    return array
