"""OpenAI response pieces shared by /v1/completions and /v1/chat/completions: log-prob formats,
SSE framing, and the one streaming loop (`sse_stream`) and collecting loop (`collect`) both
endpoints run; each endpoint supplies only how one choice is written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.engine.outputs import CompletionUpdate, RequestUpdate
from serving.http.protocol import RequestError

log = logging.getLogger("jdet.server")

DONE = "data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.1  # how often a non-streaming handler asks whether its client is still there


class ClientGone(Exception):
    """The client of a non-streaming request disconnected; its requests were aborted."""


def decode_text(tok: Any, ids: list[int]) -> str:
    return "" if tok is None else tok.decode(ids)


def token_str(tok: Any, token_id: int) -> str:
    return "" if tok is None else tok.decode([token_id])


def completion_logprobs(
    tok: Any, c: CompletionUpdate, start: int, end: int, text_offset: int
) -> dict:
    ids = c.token_ids[start:end]
    strs = [token_str(tok, t) for t in ids]
    offsets, o = [], text_offset
    for s in strs:
        offsets.append(o)
        o += len(s)
    top = None
    if c.top_logprobs is not None:
        top = [{token_str(tok, i): lp for i, lp in row} for row in c.top_logprobs[start:end]]
    return {
        "tokens": strs,
        "token_logprobs": c.logprobs[start:end],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tok: Any, c: CompletionUpdate, start: int, end: int) -> dict:
    content = []
    for k in range(start, end):
        s = token_str(tok, c.token_ids[k])
        tops = []
        if c.top_logprobs is not None:
            for i, lp in c.top_logprobs[k]:
                ts = token_str(tok, i)
                tops.append({"token": ts, "logprob": lp, "bytes": list(ts.encode())})
        content.append(
            {"token": s, "logprob": c.logprobs[k], "bytes": list(s.encode()), "top_logprobs": tops}
        )
    return {"content": content}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def stream_finish(c: CompletionUpdate) -> str | None:
    """A streamed choice's finish_reason: an abort (the client left) is not reported."""
    return c.finish_reason if c.finish_reason != "abort" else None


async def sse_stream(
    outputs: AsyncIterator[RequestUpdate | str],
    head: dict,
    first: list[dict],
    choice: Callable[[RequestUpdate, CompletionUpdate], dict],
    *,
    include_usage: bool,
    usage: Callable[[dict[str, RequestUpdate]], dict],
) -> AsyncIterator[str]:
    """The SSE events of one response: the `first` chunks, then one chunk per choice with new
    text or tokens (or its finish), written by `choice(output, completion)`; the usage chunk if
    asked for; `data: [DONE]`. A string in `outputs` is an error event that ends the stream."""
    extra = {"usage": None} if include_usage else {}
    for chunk in first:
        yield sse(chunk)
    finals: dict[str, RequestUpdate] = {}
    done: set[tuple[str, int]] = set()
    async for o in outputs:
        if isinstance(o, str):  # the error event: the stream ends here
            yield o
            return
        for c in o.outputs:
            key = (o.request_id, c.index)
            ends = c.finish_reason is not None and key not in done
            if not c.delta_text and not c.delta_token_ids and not ends:
                continue
            if ends:
                done.add(key)
            yield sse({**head, "choices": [choice(o, c)], **extra})
        if o.finished:
            finals[o.request_id] = o
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(finals)})
    yield DONE


async def collect(outputs: AsyncIterator[RequestUpdate]) -> dict[str, RequestUpdate]:
    """The final output of every request (a non-streaming response)."""
    finals = {}
    async for o in outputs:
        if o.finished:
            finals[o.request_id] = o
    return finals


async def results(
    driver: Any, rids: list[str], q: asyncio.Queue, request: Any = None
) -> AsyncIterator[RequestUpdate]:
    """Outputs of these engine requests until all finish; aborts the rest if cancelled.

    With `request` (non-streaming responses, which Starlette does not cancel when the client
    goes away) the client is polled every DISCONNECT_POLL_S; a gone client ends the iteration
    and its requests are aborted, so nobody computes tokens for a closed socket.
    """
    live = set(rids)
    last_poll = time.monotonic()
    try:
        while live:
            if request is not None and time.monotonic() - last_poll >= DISCONNECT_POLL_S:
                last_poll = time.monotonic()
                if await request.is_disconnected():
                    log.info("client went away; aborting %d request(s)", len(live))
                    raise ClientGone
            try:
                timeout = None if request is None else DISCONNECT_POLL_S
                item = await asyncio.wait_for(q.get(), timeout)
            except TimeoutError:
                continue  # nothing yet: time to look at the client again
            if isinstance(item, RequestError):
                raise item
            if item.finished:
                live.discard(item.request_id)
            yield item
    finally:
        for rid in live:
            driver.abort(rid)


async def guarded(it: AsyncIterator[RequestUpdate]) -> AsyncIterator[RequestUpdate | str]:
    """A stream's outputs; an error after the 200 went out becomes one SSE error event and
    `data: [DONE]` (the connection ends cleanly instead of breaking mid-stream)."""
    try:
        async for o in it:
            yield o
    except RequestError as e:
        yield sse(e.body()) + DONE


def usage(prompts: list[list[int]], finals: dict[str, RequestUpdate]) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(o.token_ids) for f in finals.values() for o in f.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
