"""Request: what one request asks for, from the edge (SpecModel's keywords,
an HTTP body, the llama-cpp-python drop-in, the bench) to the engine, as one
frozen value.  Every request option and its default is written here once.

The value travels whole: SpecModel.generate/stream/chat build one from their
keywords (SpecModel.run / run_stream take one directly), SpecModel resolves
the parts only the application can (the prompt's text or messages into
token ids, a JSON schema into a grammar, the cancel check) with `but`, and
Engine.run takes the result and keeps it in the request's state
(RunState.request).  Adding a request option: a field here with its
documentation, its use, its test (docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from edgespec.core.logprobs import check_top
from edgespec.core.verify import SamplingConfig
from edgespec.errors import ConfigError


@dataclass(frozen=True)
class Request:
    """One request's options; Request(prompt) is a request at every default."""
    prompt: Any = ()
    """Token ids (what the engine takes); SpecModel also takes a string (one
    user message in the chat template unless raw) or a messages list."""
    max_tokens: int | None = 256
    """Most tokens to generate (>= 1), never past the context's end
    (token_limit); None: until the end of the turn or a full context (the
    server's default)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How each token is chosen (None: SamplingConfig's defaults, greedy)."""
    stop: tuple[str, ...] = ()
    """Stop strings: the answer ends before the first one it completes."""
    raw: bool = False
    """A string prompt is tokenized as it is, without the chat template."""
    grammar: Any = None
    """GBNF text (llama.cpp's format) the answer must follow; the engine takes
    it compiled (a backend Grammar, which SpecModel makes)."""
    json_schema: Any = None
    """A JSON schema (dict or JSON text; True or {} for any JSON object) the
    answer must follow instead of a grammar (SpecModel turns it into one)."""
    logprobs: int | None = None
    """N in 0..20 also reports every generated token's log-probability and the
    N likeliest tokens there (edgespec.core.logprobs)."""
    record_topk: int = 0
    """K > 0 records the model's K likeliest tokens at every generated position
    (GenerationResult.topk, for the offline replay)."""
    prediction: Any = None
    """Text or token ids the answer is expected to repeat (e.g. the code being
    edited): drafted from as well, still lossless."""
    drafter: Any = None
    """A drafter name or object for this request only (None: the model's)."""
    reuse_prefix: bool = True
    """Keep the KV cells of the longest prefix the prompt shares with what the
    model holds (the live cache, or a prefix saved in the prompt cache:
    core/prefix_cache.py) and prefill only the rest; False prefills the whole
    prompt.  A prefix's cells do not depend on what followed it, so under
    exact kernels the answer does not depend on earlier requests."""
    cancel: Any = None
    """A threading.Event or a callable returning True to stop, checked before
    every step and between prefill chunks (stop_reason "cancelled")."""

    def __post_init__(self):
        # what a request can get wrong by itself is refused where it is built;
        # what depends on the model (the prompt fits the context, the verification
        # mode admits the sampling) is checked once where SpecModel resolves it
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        check_top(self.logprobs)
        if self.sampling is None:
            object.__setattr__(self, "sampling", SamplingConfig())
        if not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))

    def but(self, **changes) -> Request:
        """This request with the named fields changed."""
        return replace(self, **changes)


def token_limit(max_tokens: int | None, n_ctx: int, n_prompt: int) -> int:
    """The most tokens a request generates: its max_tokens, and never past
    the context's end (the room n_ctx - n_prompt leaves); None: to the
    context's end.  The one rule, for every edge (the drop-in maps
    llama-cpp-python's max_tokens onto it: edgespec.app.compat)."""
    room = n_ctx - n_prompt
    return room if max_tokens is None else min(max_tokens, room)


DEFAULT = Request()
"""The defaults, for signatures that spell a field out (SpecModel.generate)."""
