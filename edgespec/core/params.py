"""Request: what one request asks for, from the edge (SpecModel's keywords,
an HTTP body, the llama-cpp-python drop-in, the bench) to the engine, as one
frozen value.  Every request option and its default is written here once.

The value travels whole: SpecModel.generate/stream/chat build one from their
keywords (SpecModel.run / run_stream take one directly).  Before it runs,
it is resolved once against the model (`Resolved`, made only by `resolve`,
which SpecModel.resolve calls after turning text, messages and a JSON schema
into token ids and a grammar): that is the one place a request is checked
against a model, and Engine.run takes the Resolved and checks nothing.
Adding a request option: a field here with its documentation, its use, its
test (docs/architecture.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from edgespec.core.logprobs import check_top
from edgespec.core.verify import SamplingConfig, VerifyConfig
from edgespec.errors import ConfigError, GrammarError, PromptTooLongError, RequestFieldError

if TYPE_CHECKING:
    from edgespec.backend.grammar import Grammar


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
    stop_tokens: tuple[int, ...] = ()
    """Token ids that end the answer as the model's end-of-generation tokens
    do (not part of it; stop_reason "stop"): an infill's FIM end tokens
    (edgespec.app.infill)."""
    t_max_predict_ms: float | None = None
    """llama-server's t_max_predict_ms: once the answer holds a newline,
    generation ends (stop_reason "length") as soon as this many milliseconds
    have passed since the prompt was read; checked before every step, like
    cancel.  None: no time limit."""
    n_indent: int = 0
    """llama-server's n_indent: every line after the answer's first newline
    must be indented (spaces and tabs) by at least this much; the first that
    is not, once a character follows its indentation (a blank line counts),
    ends the answer there (its indentation kept; stop_reason "length"), as
    an editor plugin asks for a suggestion that stays in the cursor's block
    (core/stream.py).  0: no such cut."""
    cache_reuse: int = 0
    """llama-server's --cache-reuse / n_cache_reuse, INEXACT: N > 0 (with
    reuse_prefix) also keeps the cached cells of a chunk of at least N
    tokens that follows an edit (text inserted or removed after the common
    prefix), moved to their new positions, and decodes only the inserted
    text and the prompt's tail (core/cache_reuse.py).  Those cells were
    computed after the old text, so the answer may differ from exact
    decoding's (GenerationResult.n_shifted_tokens says how many such cells
    it read).  0: only the exact prefix reuse, and no cell a splice made."""

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
        if not isinstance(self.stop_tokens, tuple):
            object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if self.t_max_predict_ms is not None and not self.t_max_predict_ms > 0:
            raise ConfigError("t_max_predict_ms must be > 0 (None: no time limit)")
        if self.n_indent < 0:
            raise ConfigError("n_indent must be >= 0 (0: no indentation cut)")
        if self.cache_reuse < 0:
            raise ConfigError("cache_reuse must be >= 0 (0: exact prefix reuse only)")

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


@dataclass(frozen=True, eq=False)
class Resolved:
    """A Request resolved against one model: what Engine.run takes, made
    only by `resolve`, which checked every part.  It runs once (its grammar's
    state advances with the answer); `close` frees the grammar of one that
    will not run."""
    request: Request
    """The options as asked (prompt, prediction, grammar as the caller gave them)."""
    prompt: np.ndarray
    """The prompt's token ids: int32, non-empty, in the vocabulary, leaving room for one token."""
    limit: int
    """The most tokens to generate: token_limit of max_tokens (>= 1)."""
    grammar: Grammar | None = None
    """The compiled grammar the answer follows (a backend Grammar), or None."""
    prediction: np.ndarray | None = None
    """The predicted output's token ids (non-empty), or None."""
    engine_key: tuple = (None, False)
    """Which of the model's engines runs it: (the request's drafter, a name
    or Drafter, or None for the model's; whether it drafts from a prediction)."""
    cancel: Any = None
    """The cancel check the engine polls (the request's, which SpecModel
    widens with its own close and stream events)."""
    truncated: bool = False
    """The prompt was cut to fit the context (an infill's parts: edgespec.app.infill)."""

    def but(self, **changes) -> Resolved:
        return replace(self, **changes)

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()


def resolve(request: Request, prompt, *, n_ctx: int, n_vocab: int, verify: VerifyConfig | None = None,
            grammar: Grammar | None = None, prediction=None, param: str = "prompt",
            splice_refusal: str | None = None) -> Resolved:
    """The one check of a request against a model: its prompt's token ids
    (in 0..n_vocab-1, non-empty, fitting n_ctx with room for one token), the
    token limit, and whether the verification mode admits its sampling and
    grammar; returns the Resolved the engine runs.  prompt: the token ids the
    caller made of request.prompt; grammar: its compiled grammar (compiling
    is its own check: GrammarError); prediction: its token ids; param: the
    field a bad prompt is named by; splice_refusal: why the model cannot
    splice (Backend.splice_refusal), which refuses a request with
    cache_reuse.  Raises RequestFieldError (PromptTooLongError)."""
    ids = _ids(prompt, n_vocab, param)
    if ids.size == 0:
        raise RequestFieldError("empty prompt", param)
    if ids.size >= n_ctx:
        raise PromptTooLongError(f"the prompt has {ids.size} tokens, which does not fit the context of "
                                 f"{n_ctx} tokens (raise it with --ctx / n_ctx)", int(ids.size), n_ctx, param)
    vcfg = verify or VerifyConfig()
    if not vcfg.exact and not request.sampling.greedy:
        raise RequestFieldError(f"--verify {vcfg.mode} applies to greedy decoding only (temperature 0)",
                                "temperature")
    if not vcfg.exact and grammar is not None:
        raise GrammarError(f"--verify {vcfg.mode} cannot be combined with a grammar")
    if request.stop_tokens:
        _ids(list(request.stop_tokens), n_vocab, "stop_tokens")
    if request.cache_reuse and splice_refusal is not None:
        raise RequestFieldError(f"cache reuse by shifting cannot run here: {splice_refusal}", "n_cache_reuse")
    pred = None
    if prediction is not None and len(prediction):
        pred = _ids(prediction, n_vocab, "prediction")
    return Resolved(request, ids, token_limit(request.max_tokens, n_ctx, int(ids.size)), grammar, pred,
                    (request.drafter, pred is not None), request.cancel)


def _ids(tokens, n_vocab: int, param: str) -> np.ndarray:
    """Token ids as a flat int32 array, each in 0..n_vocab-1 (checked before
    the cast, which would wrap large ids: drafters index their tables with
    them, llama.cpp refuses them)."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= n_vocab)):
        raise RequestFieldError(f"token ids must be a flat list of integers in 0..{n_vocab - 1}", param)
    return np.ascontiguousarray(ids, dtype=np.int32)
