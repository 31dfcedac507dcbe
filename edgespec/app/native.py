"""llama-server's native endpoints on `edgespec serve`: `POST /completion`
(a prompt as text or token ids) and `POST /infill` (fill in the middle at a
cursor: input_prefix, input_suffix, input_extra, prompt; edgespec.app.infill
builds the FIM prompt), as the editor plugins (llama.vim, llama.vscode,
Continue's llama.cpp provider) call them.  Here: their request fields (a
table of their own: /v1's refusals are unchanged), parsed into the one
ServeRequest the server runs, and their answers (llama-server's JSON, or its
native server-sent events: `data: {json}` per chunk with `stop: false`, the
last with `stop: true` and the timings, no `[DONE]`).

Fields: n_predict (-1 or absent: the server's default; 0: the prompt is read
and cached, the answer is empty: one token is computed and not returned),
t_max_predict_ms (Request.t_max_predict_ms: once the answer has a newline it
ends when this many ms have passed since the prompt was read; stop_type
"limit"), n_indent (Request.n_indent: a line after the answer's first
newline indented less than this ends it, cut before its first character;
stop_type "limit"), n_cache_reuse (Request.cache_reuse, INEXACT: the
smallest chunk after an edit whose cells are shifted and kept; absent: the
server's `--cache-reuse`, 0 = exact), stream, stop, cache_prompt,
temperature, top_k, top_p, min_p, seed, grammar, json_schema are honoured.  samplers is accepted and
its order not followed (edgespec's sampling is top-k, top-p, min-p,
temperature; with temperature 0, the default unless `serve --temp`, the
answer is greedy); t_max_prompt_ms, id_slot (one slot), repeat_last_n and
timings_per_token are accepted and change nothing; response_fields filters
the answer as llama-server does (each path, "timings/prompt_n", a key of
its own).  The fields of _NEUTRAL are accepted at their "off" values only.
"""
from __future__ import annotations

import asyncio
import threading

from starlette.responses import JSONResponse

from edgespec.app.answers import last_chunk, receive
from edgespec.app.infill import Infill
from edgespec.app.openai_format import sse_error, sse_event, timings
from edgespec.app.request_fields import (RequestError, RequestParser, ServeRequest, _constraint, _integer, _number,
                                         _sampling, _show, _stop, shutting_down, utf8_len)

COMMON = {"prompt", "n_predict", "stream", "stop", "cache_prompt", "temperature", "top_k", "top_p", "min_p",
          "seed", "grammar", "json_schema", "t_max_predict_ms", "n_indent", "response_fields", "model", "n_cache_reuse",
          # accepted, change nothing (see the module's doc)
          "samplers", "t_max_prompt_ms", "id_slot", "repeat_last_n", "timings_per_token"}
FIELDS = {"completion": COMMON, "infill": COMMON | {"input_prefix", "input_suffix", "input_extra"}}
_NEUTRAL = {"n_probs": (0,), "repeat_penalty": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
            "typical_p": (1,), "mirostat": (0,), "dry_multiplier": (0,), "xtc_probability": (0,),
            "logit_bias": ([], {}), "ignore_eos": (False,), "n_keep": (0, -1), "return_tokens": (True, False),
            "post_sampling_probs": (False,), "lora": ([],), "cache_reuse": (None,)}


def _check_fields(body: dict, kind: str) -> None:
    for name, v in body.items():
        if name in FIELDS[kind]:
            continue
        offs = _NEUTRAL.get(name)
        if offs is None:
            raise RequestError(400, f"unknown field {_show(name)} for /{kind}", name[:100], "unknown_field")
        if not any(v == off and isinstance(v, bool) == isinstance(off, bool) for off in offs):
            raise RequestError(400, f"{name}={_show(v)} is not supported by edgespec (leave it out or set it to "
                               f"{' or '.join(repr(o) for o in offs)})", name, "unsupported")


def _string(body: dict, name: str) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise RequestError(400, f"{name} must be a string", name, "invalid_type")
    utf8_len(v, name)
    return v


def _extra(body: dict) -> tuple[tuple[str, str], ...]:
    """input_extra: [{filename, text}] chunks of other files, oldest first."""
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise RequestError(400, "input_extra must be a list of {filename, text} objects", "input_extra",
                           "invalid_type")
    out = []
    for c in extra:
        if not (isinstance(c, dict) and isinstance(c.get("text"), str)
                and isinstance(c.get("filename", ""), str)):
            raise RequestError(400, "input_extra must be a list of {filename, text} objects with string values",
                               "input_extra", "invalid_type")
        utf8_len(c["text"] + c.get("filename", ""), "input_extra")
        out.append((c.get("filename", ""), c["text"]))
    return tuple(out)


def _list_of_strings(body: dict, name: str) -> tuple[str, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if isinstance(v, str) and name == "samplers":      # llama-server also takes them as one string
        return (v,)
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise RequestError(400, f"{name} must be a list of strings", name, "invalid_type")
    return tuple(v)


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise RequestError(400, f"{name} must be a boolean", name, "invalid_type")
    return v


def parse(parser: RequestParser, body: dict, kind: str) -> ServeRequest:
    """A body of /completion or /infill (kind), checked, as the ServeRequest
    the server runs over its defaults."""
    _check_fields(body, kind)
    d = parser.defaults
    n_predict = _integer(body, "n_predict", -1, -1)
    quiet = n_predict == 0
    max_tokens = d.max_tokens if n_predict < 0 else max(1, n_predict)
    t_max = _number(body, "t_max_predict_ms", -1e12, 1e12, None)
    n_indent = _integer(body, "n_indent", 0, 0)
    _integer(body, "id_slot", -1, -1)
    _number(body, "t_max_prompt_ms", -1e12, 1e12, None)
    _list_of_strings(body, "samplers")
    fields = _list_of_strings(body, "response_fields")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError(400, "model must be a string (the model's name)", "model", "invalid_type")
    constraint = _constraint(body)
    field, value = constraint or (None, None)
    if kind == "infill":
        prompt = Infill(_string(body, "input_prefix"), _string(body, "input_suffix"), _extra(body),
                        _string(body, "prompt"), suffix_tokens=parser.limits.fim_suffix_tokens,
                        prefix_tokens=parser.limits.fim_prefix_tokens, layout=parser.limits.fim_layout)
    else:
        prompt = parser._prompt(body.get("prompt"))
    request = d.but(prompt=prompt, max_tokens=max_tokens, sampling=_sampling(body, d.sampling),
                    stop=tuple(_stop(body, list(d.stop), parser.limits)),
                    reuse_prefix=_flag(body, "cache_prompt", d.reuse_prefix),
                    cache_reuse=_integer(body, "n_cache_reuse", 0, d.cache_reuse),
                    t_max_predict_ms=t_max if t_max is not None and t_max > 0 else None, n_indent=n_indent,
                    grammar=value if field == "grammar" else None,
                    json_schema=value if field not in (None, "grammar") else None)
    return ServeRequest(request, False, parser.model_id, _flag(body, "stream", False), grammar_param=field,
                        native=kind, response_fields=fields, quiet=quiet)


# ------------------------------------------------------------------ answers
def stop_type(r, quiet: bool = False) -> str:
    """llama-server's stop_type of a GenerationResult."""
    if quiet or r.stop_reason == "length":
        return "limit"
    if r.stop_reason == "stop":
        return "word" if r.stop_word else "eos"
    return "none"


def _pick(d: dict, paths) -> dict:
    """response_fields: each path ("timings/prompt_n") that the answer has, under its own key."""
    out = {}
    for path in paths:
        v, found = d, True
        for k in path.split("/"):
            if not isinstance(v, dict) or k not in v:
                found = False
                break
            v = v[k]
        if found:
            out[path] = v
    return out


def final(call: ServeRequest, r, drafter: str, streamed: bool) -> dict:
    """The answer (or a stream's last event) as llama-server's native JSON."""
    assert call.resolved is not None
    n_prompt, quiet = len(call.resolved.prompt), call.quiet
    d = {"index": 0, "content": "" if streamed or quiet else r.text,
         "tokens": [] if streamed or quiet else [int(t) for t in r.tokens], "id_slot": 0, "stop": True,
         "model": call.model, "tokens_predicted": 0 if quiet else r.n_generated, "tokens_evaluated": n_prompt,
         "has_new_line": "\n" in r.text and not quiet, "truncated": call.resolved.truncated,
         "stop_type": stop_type(r, quiet), "stopping_word": r.stop_word,
         "tokens_cached": n_prompt + r.n_generated, "timings": timings(r, drafter)}
    return _pick(d, call.response_fields) if call.response_fields else d


class NativeAnswers:
    """The answers of /completion and /infill, over the server's Answers
    (the drafter's name, whether the server is draining)."""

    def __init__(self, answers):
        self.answers = answers

    async def collect(self, call: ServeRequest, queue: asyncio.Queue):
        try:
            r = (await last_chunk(queue)).result
        except RequestError as e:
            return e.response()
        if self.answers.shut_down(r):
            return shutting_down().response()
        return JSONResponse(final(call, r, self.answers.drafter_name(), streamed=False))

    async def sse(self, call: ServeRequest, queue: asyncio.Queue, cancel: threading.Event):
        """llama-server's native events: a chunk per piece of text, then the last one."""
        assert call.resolved is not None
        n_prompt, n_sent, toks = len(call.resolved.prompt), 0, []
        try:
            while True:
                try:
                    c = await receive(queue)
                except RequestError as e:
                    yield sse_error(e)
                    break
                if c is None:
                    continue
                if c.result is not None:
                    yield sse_event(final(call, c.result, self.answers.drafter_name(), streamed=True))
                    break
                toks += c.tokens
                if not c.text or call.quiet:
                    continue
                n_sent += len(toks)
                yield sse_event({"index": 0, "content": c.text, "tokens": [int(t) for t in toks], "stop": False,
                                 "id_slot": 0, "tokens_predicted": n_sent, "tokens_evaluated": n_prompt})
                toks = []
        finally:
            cancel.set()          # a no-op once the answer is complete
