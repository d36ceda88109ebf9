"""/v1/embeddings: OpenAI's request in, one engine embedding request per input, their vectors out.

Each input (a string, or token ids) becomes an engine request with the server's pooling
(`--pooler-config`, by default the last token's final hidden state, L2-normalised; vLLM's
`normalize` field overrides the normalisation per call), batched with generation by the same
scheduler. `dimensions` is accepted only when it equals the model's hidden size (tuili does not
shorten vectors); `encoding_format` "base64" sends each vector's little-endian float32 bytes, as
OpenAI's clients decode them. An input may fill the whole context: nothing is generated. vLLM's
`truncate_prompt_tokens` keeps each input's last k tokens (-1: as many as the context holds).
"""

from __future__ import annotations

import base64
import struct
import uuid
from dataclasses import dataclass

from tuili.errors import RequestError
from tuili.pooling import PoolerConfig, PoolingParams
from tuili.sampling import SamplingParams
from tuili.server.driver import Submission
from tuili.server.errors import ApiError
from tuili.server.generation import Backend, check_model, check_sequences
from tuili.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage


@dataclass(frozen=True)
class Embedder:
    """What the embeddings endpoint runs on: the generation backend and the engine's pooling."""

    backend: Backend
    pooler_config: PoolerConfig
    hidden_size: int


@dataclass
class EmbeddingCall:
    """One /v1/embeddings call in flight."""

    api_id: str
    model: str
    encoding_format: str
    submission: Submission
    prompt_lengths: list[int]


def _refuse(field: str, message: str) -> RequestError:
    error = RequestError(message)
    error.field = field
    return error


async def start_embedding(embedder: Embedder, request: EmbeddingRequest, arrival: float) -> EmbeddingCall:
    """Validate, tokenize and queue every input (all or none); raises RequestError naming the field."""
    request.check_supported()
    backend = embedder.backend
    model = check_model(backend, request.model)
    pooling = PoolingParams(request.normalize, request.dimensions).resolve(embedder.pooler_config,
                                                                           embedder.hidden_size)
    given = request.input
    items = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
    if not items:
        raise _refuse("input", "input=[] is invalid: expected a string, token ids, or a non-empty list of them")
    check_sequences(backend, len(items), 1)
    limit = backend.max_model_len
    keep = request.truncate_prompt_tokens
    if keep is not None and (keep == 0 or keep > limit):
        raise _refuse("truncate_prompt_tokens", f"truncate_prompt_tokens={keep} is invalid: expected 1 to "
                      f"max_model_len={limit}, or -1 for as many as the context holds")
    prompts, texts = [], []
    for i, item in enumerate(items):
        where = "input" if len(items) == 1 else f"input[{i}]"
        if isinstance(item, str):
            if keep is None:  # a text far longer than the context is refused before it is all tokenized
                await backend.tokenizer.check_text_length(item, "input", limit)
            ids = await backend.tokenizer.encode(item, request.add_special_tokens) if item else []
        else:
            ids = list(item)
            backend.tokenizer.check_ids(ids, "input")
        if not ids:
            raise _refuse("input", f"{where} is empty: expected text or at least one token id")
        if keep is not None:  # vLLM's left truncation: the last tokens are kept
            ids = ids[-(limit if keep == -1 else keep):]
        if len(ids) > limit:
            raise _refuse("input", f"{where} has {len(ids)} tokens but the context holds {limit}: shorten it")
        prompts.append(ids)
        texts.append(item if isinstance(item, str) and keep is None else None)
    api_id = f"embd-{uuid.uuid4().hex}"
    submission = await backend.driver.submit(api_id, prompts, texts, SamplingParams(), arrival, pooling=pooling)
    return EmbeddingCall(api_id, model, request.encoding_format, submission, [len(p) for p in prompts])


async def finish_embedding(call: EmbeddingCall) -> EmbeddingResponse:
    """The vectors, in input order, once every one is computed."""
    finals = await call.submission.final()
    data = []
    for index, out in enumerate(finals):
        if out.embedding is None:  # aborted: the server is shutting down
            raise ApiError(503, "the server is shutting down: the embedding was not finished", type="server_error",
                           code="shutting_down")
        vector = out.embedding
        if call.encoding_format == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        data.append(EmbeddingData(index=index, embedding=vector))
    tokens = sum(call.prompt_lengths)
    return EmbeddingResponse(id=call.api_id, model=call.model, data=data,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
