"""OpenAI's embeddings request and response, apart from the web framework: `parse_request` checks a body
completely (every problem a `RequestError` naming the field, and the input index where there is one) before
anything is queued, so one bad request never fails a merged batch; `request_ids` turns it into token ids
exactly as `Embedder.encode` / `encode_ids` would; `response_body` formats the rows.

Fields (OpenAI's): `input` (a string, a list of strings, a list of token ids, or a list of lists of token
ids), `model`, `encoding_format` ("float" or "base64": little-endian float32 bytes), `dimensions` (the first
`dimensions` values, L2-normalised again), `user` (accepted, ignored). jaxembed's own: `input_type` ("query" or
"document", default "document") and `instruction` (queries only): queries get the model's query template
(`Embedder.query_prompt(instruction)`, as `encode_query`), documents none, as in the paper.

Texts get EOS appended, as `Embedder.encode` does. Token ids are used exactly as given, as
`Embedder.encode_ids` does: no EOS is added, the embedding is the output at the last id, so send ids that
end in EOS (`Embedder.tokenize` gives them) to get a text's embedding.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
from dataclasses import dataclass

import numpy as np
import orjson

from jaxembed.text import lone_surrogate, tokenize_texts

FIELDS = ("input", "model", "encoding_format", "dimensions", "user", "input_type", "instruction")
ENCODING_FORMATS = ("float", "base64")
INPUT_TYPES = ("query", "document")


class RequestError(Exception):
    """A request the server refuses: HTTP status, a message naming the problem, the field (OpenAI's `param`)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(message: str, *, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class EmbeddingRequest:
    texts: list[str] | None  # text input, or
    ids: list[list[int]] | None  # token-id input
    model: str | None
    encoding_format: str
    dimensions: int | None
    input_type: str
    instruction: str | None

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.ids)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(body: bytes, *, embedding_dim: int, vocab_size: int, max_inputs: int) -> EmbeddingRequest:
    """The request in `body` (JSON), checked; a RequestError (400) names the first problem."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError as err:
        raise RequestError(400, f"the body is not UTF-8 JSON ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise RequestError(400, f"the body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
                           ) from None
    except (ValueError, RecursionError) as err:  # an integer past Python's digit limit, nesting past its depth
        raise RequestError(400, f"the body is JSON this server does not read: {str(err).splitlines()[0][:200]}"
                           if str(err) else "the body is JSON nested too deep to read") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body must be a JSON object, got {_json_type(data)}")
    unknown = [k for k in data if k not in FIELDS]
    if unknown:
        raise RequestError(400, f"unknown field{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(repr(k) for k in unknown)}; the fields are {', '.join(FIELDS)}",
                           param=repr(unknown[0])[1:-1], code="unknown_field")  # escaped: a lone surrogate
    texts, ids = _parse_input(data.get("input"), vocab_size, max_inputs)

    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, f"'model' must be a string, got {_json_type(model)}", param="model")
    encoding_format = data.get("encoding_format")
    encoding_format = "float" if encoding_format is None else encoding_format
    if encoding_format not in ENCODING_FORMATS:
        raise RequestError(400, f"'encoding_format' must be 'float' or 'base64', got {encoding_format!r}",
                           param="encoding_format")
    dimensions = data.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or not 1 <= dimensions <= embedding_dim):
        raise RequestError(400, f"'dimensions' must be an integer from 1 to {embedding_dim} (this model's embedding "
                                f"size), got {dimensions!r}", param="dimensions")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(400, f"'user' must be a string, got {_json_type(user)}", param="user")
    input_type = data.get("input_type")
    input_type = "document" if input_type is None else input_type
    if input_type not in INPUT_TYPES:
        raise RequestError(400, f"'input_type' must be 'query' or 'document', got {input_type!r}",
                           param="input_type")
    instruction = data.get("instruction")
    if instruction is not None:
        if not isinstance(instruction, str):
            raise RequestError(400, f"'instruction' must be a string, got {_json_type(instruction)}",
                               param="instruction")
        if input_type != "query":
            raise RequestError(400, "'instruction' applies to queries only: set 'input_type' to 'query' (documents "
                                    "are embedded without one)", param="instruction")
        if problem := lone_surrogate(instruction):
            raise RequestError(400, f"'instruction' {problem}", param="instruction")
    if input_type == "query" and ids is not None:
        raise RequestError(400, "'input_type' 'query' puts the query prompt before text; token ids are used as "
                                "given (include the prompt's ids yourself, or send text)", param="input_type")
    return EmbeddingRequest(texts, ids, model, encoding_format, dimensions, input_type, instruction)


def _parse_input(value, vocab_size: int, max_inputs: int):
    """(texts, None) or (None, id lists) from OpenAI's four input forms."""
    if value is None:
        raise RequestError(400, "'input' is required: a string, a list of strings, a list of token ids or a list "
                                "of lists of token ids", param="input")
    if isinstance(value, str):
        if not value:
            raise RequestError(400, "'input' is an empty string", param="input")
        _check_text(value, "input")
        return [value], None
    if not isinstance(value, list):
        raise RequestError(400, f"'input' must be a string, a list of strings, a list of token ids or a list of "
                                f"lists of token ids, got {_json_type(value)}", param="input")
    if not value:
        raise RequestError(400, "'input' is an empty list", param="input")
    first = value[0]
    if _is_int(first):  # one sequence of token ids: one input, its length limited by max_input_tokens
        return None, [_token_ids(value, "input", vocab_size)]
    if len(value) > max_inputs:
        raise RequestError(400, f"'input' has {len(value)} items, more than this server's limit of {max_inputs} "
                                f"per request", param="input")
    if isinstance(first, str):
        for i, text in enumerate(value):
            if not isinstance(text, str):
                raise RequestError(400, f"input[{i}] is {_json_type(text)}, not a string (input[0] is a string, "
                                        f"so every item must be one)", param="input")
            if not text:
                raise RequestError(400, f"input[{i}] is an empty string", param="input")
            _check_text(text, f"input[{i}]")
        return list(value), None
    if isinstance(first, list):
        ids = []
        for i, seq in enumerate(value):
            if not isinstance(seq, list):
                raise RequestError(400, f"input[{i}] is {_json_type(seq)}, not a list of token ids (input[0] is a "
                                        f"list, so every item must be one)", param="input")
            ids.append(_token_ids(seq, f"input[{i}]", vocab_size))
        return None, ids
    raise RequestError(400, f"input[0] is {_json_type(first)}: 'input' must be a string, a list of strings, a list "
                            f"of token ids or a list of lists of token ids", param="input")


def _check_text(text: str, name: str) -> None:
    if problem := lone_surrogate(text):
        raise RequestError(400, f"{name} {problem}", param="input")


def _token_ids(seq: list, name: str, vocab_size: int) -> list[int]:
    if not seq:
        raise RequestError(400, f"{name} is an empty list of token ids", param="input")
    for j, t in enumerate(seq):
        if not _is_int(t):
            raise RequestError(400, f"{name}[{j}] is {_json_type(t)}, not a token id (an integer)", param="input")
        if not 0 <= t < vocab_size:
            raise RequestError(400, f"{name}[{j}] = {t} is not a token id of this model (they are 0 to "
                                    f"{vocab_size - 1})", param="input")
    return seq


def request_ids(embedder, request: EmbeddingRequest, tokenizer=None,
                lock: threading.Lock | None = None) -> list[list[int]]:
    """The token ids `Embedder.encode_query` / `encode_document` (texts) or `encode_ids` (ids) would run;
    tokenizer: the embedder's own or a copy of it, used under `lock` (a transformers fast tokenizer is not
    safe to call from several threads at once)."""
    if request.ids is not None:
        return request.ids
    if embedder.tokenizer is None:
        raise RequestError(400, "this model has no tokenizer: send token ids", param="input")
    texts = request.texts
    if request.input_type == "query":
        prompt = embedder.query_prompt(request.instruction)
        if prompt:
            texts = [prompt + t for t in texts]
    with lock or contextlib.nullcontext():
        ids, _ = tokenize_texts(tokenizer or embedder.tokenizer, texts, embedder.eos_token_id)
    for i, seq in enumerate(ids):  # a tokenizer larger than the model's vocabulary: this request fails alone
        if (top := max(seq)) >= embedder.vocab_size:
            raise RequestError(500, f"input[{i}] tokenizes to id {top}, outside this model's vocabulary of "
                                    f"{embedder.vocab_size} (the served tokenizer does not belong to the model)",
                               kind="server_error", code="tokenizer_mismatch")
    return ids


def check_token_limits(ids: list[list[int]], *, max_input_tokens: int, max_request_tokens: int) -> int:
    """The request's token count; 413 naming the input and its count where a limit is passed (never cut)."""
    total = 0
    for i, seq in enumerate(ids):
        n = len(seq)
        if n > max_input_tokens:
            raise RequestError(413, f"input[{i}] has {n} tokens (EOS and any query prompt included), more than this "
                                    f"server's limit of {max_input_tokens} tokens per input; nothing is truncated: "
                                    f"split it or shorten it", param="input", code="too_many_tokens")
        total += n
    if total > max_request_tokens:
        raise RequestError(413, f"the request has {total} tokens in its {len(ids)} inputs, more than this server's "
                                f"limit of {max_request_tokens} tokens per request; send fewer inputs per request",
                           param="input", code="too_many_tokens")
    return total


def render(body: dict) -> bytes:
    """JSON bytes of a response body; float32 rows as the doubles they equal, as Python's json writes them
    (orjson: ~20x faster for large responses)."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def response_body(rows: np.ndarray, request: EmbeddingRequest, model_name: str, tokens: int) -> dict:
    """OpenAI's list object (written by `render`); rows [n, d] float32, L2-normalised."""
    rows = np.asarray(rows, np.float32)
    if request.dimensions is not None and request.dimensions < rows.shape[1]:
        from jaxembed.quantize import truncate_embeddings

        rows = truncate_embeddings(rows, request.dimensions, normalize=True)
    if request.encoding_format == "base64":
        little = rows.astype("<f4", copy=False)
        vectors = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        vectors = rows.astype(np.float64)  # doubles hold float32 values exactly; JSON writes them round-trip
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
        "model": model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
