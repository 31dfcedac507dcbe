"""The OpenAI answer shapes: completion and chat responses, their stream
chunks, usage, and the server-sent events that carry them.

Both front ends answer in these shapes, so they are built in one place: the
llama-cpp-python drop-in (edgespec.app.compat) returns them as dicts and
`edgespec serve` (edgespec.app.server) sends them as JSON, with
llama-server's `timings` added.
"""
from __future__ import annotations

import json
import uuid

SSE_DONE = "data: [DONE]\n\n"       # the last event of every stream


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def completion_response(cid: str, created: int, model: str, text: str, finish_reason: str | None,
                        n_prompt: int | None = None, n_completion: int | None = None) -> dict:
    """A text_completion (with usage) or, without token counts, one of its stream chunks."""
    d = {"id": cid, "object": "text_completion", "created": created, "model": model,
         "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}
    if n_prompt is not None:
        d["usage"] = usage(n_prompt, n_completion or 0)
    return d


def chat_response(cid: str, created: int, model: str, content: str, finish_reason: str,
                  n_prompt: int, n_completion: int) -> dict:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage(n_prompt, n_completion)}


def chat_chunk(cid: str, created: int, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def timings(r, drafter: str) -> dict:
    """A GenerationResult's timings under llama-server's names, plus edgespec's
    (cache_shifted_n: reused cells that a splice moved, Request.cache_reuse;
    more than 0 says the answer may differ from exact decoding's)."""
    prompt_n = r.n_prompt_tokens - r.n_reused_tokens
    prompt_ms, pred_ms = r.prefill_s * 1e3, r.decode_s * 1e3
    return {"cache_n": r.n_reused_tokens, "cache_shifted_n": r.n_shifted_tokens, "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / r.prefill_s if r.prefill_s > 0 else 0.0,
            "predicted_n": r.n_generated, "predicted_ms": pred_ms,
            "predicted_per_token_ms": pred_ms / (r.n_generated - 1) if r.n_generated > 1 else 0.0,
            "predicted_per_second": r.tokens_per_s,
            "draft_n": r.n_draft_nodes, "draft_n_accepted": r.n_draft_accepted,
            "tokens_per_step": r.mean_accepted, "steps": r.n_steps, "drafter": drafter}


def sse_event(d: dict) -> str:
    return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"


def sse_error(e) -> str:
    """The event of an error after a stream's status was sent (e: a RequestError)."""
    return sse_event({"error": {"message": e.message, "type": e.etype, "code": e.code}})
