"""A fake OpenAI-compatible server for the bench tests, run as its own process.

It streams `max_tokens` tokens with a fixed time to first token and a fixed gap between chunks,
both paced against absolute deadlines, so the timings the client should see are known exactly.
POST /_config changes its behaviour between tests:

  ttft_s, itl_s       first text chunk at arrival + ttft_s; chunk k at first + k * itl_s, where
                      first is when the first chunk actually went out (so that a late start,
                      which the client rightly sees in TTFT, does not shorten every later gap)
  tokens_per_chunk    tokens carried by each text chunk (usage counts them all)
  usage               whether to honour stream_options.include_usage
  tokenize            whether POST /tokenize exists (404 otherwise)
  fail_pattern        kinds cycled over requests by arrival order: ok, http_500, malformed,
                      stream_error, incomplete, disconnect
  max_concurrent      requests generating at once; the rest wait their turn (a saturating server)
  api_key             when set, every OpenAI route answers 401 without "Authorization: Bearer <key>"
  root                the model path /v1/models gives (as tuili serve gives its model's path)

GET /_stats returns the number of generation requests by kind and every prompt received. /metrics
exports tuili:-prefixed counters the way tuili serve does; each completed request adds 1e12 to
tuili:prefill_flops_total and ttft_s to tuili:prefill_seconds_total, against tuili:peak_flops 1e14.

Token counts come from a real tokenizer.json when --tokenizer is given, else whitespace words.
It prints its port on the first line of stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

DEFAULTS = {"ttft_s": 0.05, "itl_s": 0.01, "tokens_per_chunk": 1, "usage": True, "tokenize": True,
            "fail_pattern": ["ok"], "max_concurrent": 1000, "api_key": None, "root": None}

app = FastAPI()
state = {"config": dict(DEFAULTS), "requests": 0, "by_kind": {}, "prompts": [], "prompt_tokens": 0,
         "generation_tokens": 0, "prefill_flops": 0.0, "prefill_seconds": 0.0,
         "slots": asyncio.Semaphore(1000)}
tokenizer = None


def refused(request: Request) -> JSONResponse | None:
    """The 401 answer when an API key is configured and the request lacks it (a plain check rather
    than an HTTP middleware: Starlette's BaseHTTPMiddleware would tidy up a deliberately broken stream)."""
    key = state["config"]["api_key"]
    if key and request.headers.get("authorization") != f"Bearer {key}":
        return JSONResponse({"error": {"message": "wrong API key", "type": "auth", "param": None, "code": 401}},
                            status_code=401)
    return None


def count_tokens(text: str) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)
    return len(text.split())


@app.post("/_config")
async def set_config(request: Request):
    state["config"] = {**DEFAULTS, **(await request.json())}
    state.update(requests=0, by_kind={}, prompts=[], slots=asyncio.Semaphore(state["config"]["max_concurrent"]))
    return state["config"]


@app.get("/_stats")
async def stats():
    return {"requests": state["requests"], "by_kind": state["by_kind"], "prompts": state["prompts"]}


@app.get("/v1/models")
async def models(request: Request):
    if denied := refused(request):
        return denied
    return {"object": "list", "data": [{"id": "fake-model", "object": "model", "root": state["config"]["root"]}]}


@app.post("/tokenize")
async def tokenize(request: Request):
    if denied := refused(request):
        return denied
    if not state["config"]["tokenize"]:
        return JSONResponse({"detail": "Not Found"}, status_code=404)
    body = await request.json()
    n = count_tokens(body["prompt"])
    return {"count": n, "tokens": list(range(n)), "max_model_len": 1 << 20}


@app.get("/metrics")
async def metrics():
    lines = [
        "# TYPE tuili:prompt_tokens_total counter", f"tuili:prompt_tokens_total {state['prompt_tokens']}",
        "# TYPE tuili:generation_tokens_total counter",
        f"tuili:generation_tokens_total {state['generation_tokens']}",
        "# TYPE tuili:decode_mbu gauge", "tuili:decode_mbu 0.42",
        "# TYPE tuili:prefill_flops counter",  # labelled like tuili serve's utilization samples
        f'tuili:prefill_flops_total{{model_name="fake-model"}} {state["prefill_flops"]}',
        "# TYPE tuili:prefill_seconds counter",
        f'tuili:prefill_seconds_total{{model_name="fake-model"}} {state["prefill_seconds"]}',
        "# TYPE tuili:peak_flops gauge", 'tuili:peak_flops{model_name="fake-model"} 1e14',
        "# TYPE tuili:prefix_cache_hits_total counter", 'tuili:prefix_cache_hits_total{tier="device"} 7',
        "# TYPE other_metric gauge", "other_metric 1",
    ]
    return PlainTextResponse("\n".join(lines) + "\n")


@app.post("/v1/completions")
async def completions(request: Request):
    return await generate(request, chat=False)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await generate(request, chat=True)


async def generate(request: Request, chat: bool):
    received = time.perf_counter()  # before parsing: the pacing leaves out this server's own overhead
    if denied := refused(request):
        return denied
    body = await request.json()
    config = state["config"]
    pattern = config["fail_pattern"]
    kind = pattern[state["requests"] % len(pattern)]
    state["requests"] += 1
    state["by_kind"][kind] = state["by_kind"].get(kind, 0) + 1
    if kind == "http_500":
        return JSONResponse({"error": {"message": "fake overload", "type": "server_error", "param": None,
                                       "code": 500}}, status_code=500)
    prompt = "\n\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
    state["prompts"].append(body["messages"] if chat else prompt)
    prompt_tokens = count_tokens(prompt)
    chunks = body["max_tokens"]
    per_chunk = config["tokens_per_chunk"]
    want_usage = config["usage"] and (body.get("stream_options") or {}).get("include_usage")

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def chunk(text: str | None, finish: str | None = None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
        return event({"id": "x", "object": "chunk", "model": "fake-model", "choices": [choice]})

    async def stream():
        queued = time.perf_counter()
        async with state["slots"]:
            # Time spent waiting for a slot is queueing the client must see; the rest is overhead.
            async for event_text in paced(received + time.perf_counter() - queued):
                yield event_text

    async def paced(arrival: float):
        if chat:  # the role chunk carries no text and must not count as the first token
            yield event({"id": "x", "object": "chunk", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        await asyncio.sleep(max(0.0, arrival + config["ttft_s"] - time.perf_counter()))
        first = time.perf_counter()
        for k in range(chunks):
            await asyncio.sleep(max(0.0, first + k * config["itl_s"] - time.perf_counter()))
            yield chunk(" tok" * per_chunk)
            if k == 0 and kind == "malformed":
                yield "data: {this is not json\n\n"
                return
            if k == 0 and kind == "stream_error":
                yield event({"error": {"message": "fake engine failure", "code": 500}})
                return
            if k == 0 and kind == "disconnect":
                raise ConnectionAbortedError("fake server drops the connection")
        if kind == "incomplete":
            return
        yield chunk(None, "length")
        state["prompt_tokens"] += prompt_tokens
        state["prefill_flops"] += 1e12
        state["prefill_seconds"] += config["ttft_s"]
        state["generation_tokens"] += chunks * per_chunk
        if want_usage:
            yield event({"id": "x", "object": "chunk", "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": chunks * per_chunk,
                "total_tokens": prompt_tokens + chunks * per_chunk}})
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


def main() -> None:
    global tokenizer
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer")
    args = parser.parse_args()
    if args.tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="critical", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
