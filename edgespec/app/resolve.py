"""A request resolved against a SpecModel: the one place a request is
checked against the model it runs on (docs/architecture.md, "A request's path").

`resolve_request` turns what only the application can read (a prompt given
as text or a messages list, through the chat template; a JSON schema or GBNF
text, bounded and compiled; a predicted output given as text) into token ids
and a compiled grammar, then hands them to core.params.resolve, which checks
the ids, the context and the verification mode and computes the token limit.
Every edge (SpecModel's methods, the HTTP server before a request queues,
the llama-cpp-python drop-in before it returns a stream) resolves a request
once, here; Engine.run takes the Resolved and checks nothing.
"""
from __future__ import annotations

import numpy as np

from edgespec.app.infill import Infill, fim_prompt
from edgespec.app.structured import constraint_gbnf
from edgespec.backend.chattokens import chat_tokens
from edgespec.backend.grammar import Grammar
from edgespec.core.params import Request, Resolved, resolve
from edgespec.errors import ConfigError


def is_token_ids(prompt) -> bool:
    """A prompt given as token ids (a numpy array, or a non-empty list of ints)."""
    return isinstance(prompt, np.ndarray) or (isinstance(prompt, (list, tuple)) and len(prompt) > 0
                                              and isinstance(prompt[0], (int, np.integer)))


def prompt_tokens(model, prompt, raw: bool = False) -> np.ndarray:
    """The token ids of a prompt: ids as given (resolve checks them), a
    messages list through the chat template, a string as one user message
    in it unless raw (then tokenized as it is)."""
    if is_token_ids(prompt):
        return np.asarray(prompt)
    vocab = model.vocab
    if isinstance(prompt, str):
        if raw:
            return vocab.tokenize(prompt, add_special=True, parse_special=False)
        prompt = [{"role": "user", "content": prompt}]
    if not vocab.chat_template():
        raise ConfigError("this model has no chat template; use raw prompts (--raw)")
    return chat_tokens(vocab, list(prompt))


def _prediction(model, prediction):
    if prediction is None or isinstance(prediction, str) and not prediction:
        return None
    if isinstance(prediction, str):
        return model.vocab.tokenize(prediction, add_special=False)
    return np.asarray(prediction)


def resolve_request(model, request: Request) -> Resolved:
    """`request` resolved against `model` (a SpecModel, with its vocabulary
    in use): RequestFieldError (PromptTooLongError, GrammarError) for one
    that cannot run.  A compiled grammar belongs to the Resolved (close() it
    if it never runs).  A prompt given as an Infill becomes its FIM prompt
    (edgespec.app.infill: the answer also ends at its FIM end tokens, and
    Resolved.truncated says whether a part was cut to fit)."""
    truncated = False
    if isinstance(request.prompt, Infill):
        fim = fim_prompt(model.vocab, request.prompt, model.n_ctx, request.max_tokens)
        toks, truncated = fim.ids, fim.truncated
        request = request.but(stop_tokens=tuple(dict.fromkeys(request.stop_tokens + fim.stop_tokens)))
    else:
        toks = prompt_tokens(model, request.prompt, raw=request.raw)
    gbnf = constraint_gbnf(request.grammar, request.json_schema)
    grammar = Grammar(model.vocab, gbnf) if gbnf is not None else None
    try:
        resolved = resolve(request, toks, n_ctx=model.n_ctx, n_vocab=model.vocab.n_vocab,
                           verify=model.verify_for(request.drafter), grammar=grammar,
                           prediction=_prediction(model, request.prediction),
                           splice_refusal=model.backend.splice_refusal() if request.cache_reuse else None)
        return resolved.but(truncated=True) if truncated else resolved
    except BaseException:
        if grammar is not None:
            grammar.close()
        raise
