"""The request value (edgespec.core.params.Request): every request option's
default is written once, on the value; SpecModel's keyword methods, the CLI
and the server read their defaults from it; an option set on the value
reaches the engine (SmolLM2); docs/architecture.md names only fields that
exist."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

from edgespec.app.api import SpecModel
from edgespec.core.params import DEFAULT, Request
from edgespec.core.verify import SamplingConfig

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "edgespec"

# the defaults a request option has, as they would be typed again; each may
# appear only where it is defined (path relative to edgespec/)
WRITTEN_ONCE = {
    r"max_tokens\b[^\n,()]*?=\s*256\b": "core/params.py",
    r"--max-tokens.{0,60}default=256": None,
    r"\btop_p\b[^\n,()]*?[=:]\s*0\.95\b": "core/verify.py",
    r"\bmin_p\b[^\n,()]*?[=:]\s*0\.05\b": "core/verify.py",
    r"\btop_k\b[^\n,()]*?[=:]\s*40\b": "core/verify.py",
}
# llama_cpp.Llama's own signature, which the drop-in mirrors with that library's
# defaults (its temperature is 0.8): not edgespec's request defaults
MIRRORS = {"app/compat.py"}


def _sources():
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC).as_posix()
        if rel not in MIRRORS:
            yield rel, p.read_text()


@pytest.mark.parametrize("pattern", sorted(WRITTEN_ONCE))
def test_request_defaults_are_written_once(pattern):
    where = sorted(rel for rel, text in _sources() if re.search(pattern, text))
    home = WRITTEN_ONCE[pattern]
    assert where == ([home] if home else []), f"{pattern!r} is written in {where}"


def test_default_request_is_documented_and_frozen():
    r = Request([1, 2, 3])
    assert r.max_tokens == 256 and r.reuse_prefix is True and r.sampling == SamplingConfig()
    assert r.stop == () and Request([1], stop=["a"]).stop == ("a",) and Request([1], sampling=None).sampling.greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.max_tokens = 5            # type: ignore[misc]
    assert r.but(max_tokens=5).max_tokens == 5 and r.max_tokens == 256
    # every field carries its documentation (a string right after it in the class body)
    src = inspect.getsource(Request)
    for f in dataclasses.fields(Request):
        assert re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"", src), f"Request.{f.name} has no docstring"


@pytest.mark.parametrize("method", ["generate", "stream", "chat"])
def test_keyword_defaults_are_the_values(method):
    """SpecModel's public keywords default to what Request defaults to (None
    where the value fills the default in: sampling)."""
    params = inspect.signature(getattr(SpecModel, method)).parameters
    names = {f.name for f in dataclasses.fields(Request)}
    shared = [n for n in params if n in names and n != "prompt"]
    assert {"max_tokens", "sampling", "stop", "logprobs", "reuse_prefix", "grammar"} <= set(shared)
    for n in shared:
        want = getattr(DEFAULT, n)
        got = params[n].default
        assert got == want or (got is None and n in ("sampling", "stop")), (method, n, got, want)


def test_cli_and_server_defaults_are_the_values():
    from click.testing import CliRunner

    import edgespec.app.cli as cli
    out = CliRunner().invoke(cli.main, ["generate", "--help"], terminal_width=200).output
    assert re.search(r"--max-tokens\D+\[default: 256\b", out, re.S), out
    assert "[default: 0.95]" in out and "[default: 0.05]" in out
    from edgespec.app.request_fields import SERVE_DEFAULTS
    # the server's defaults are the value's, but max_tokens: until the end of the turn or a full context
    assert SERVE_DEFAULTS == Request(max_tokens=None)


def test_a_request_checks_itself_where_it_is_built():
    """What a request can get wrong by itself is refused when it is built
    (what depends on the model is checked once, by core.params.resolve)."""
    from edgespec.errors import ConfigError
    for bad in ({"max_tokens": 0}, {"max_tokens": -3}, {"logprobs": 21}, {"logprobs": -1}, {"logprobs": True}):
        with pytest.raises(ConfigError):
            Request([1, 2], **bad)
    assert Request([1], max_tokens=None, logprobs=0).max_tokens is None


def test_resolve_is_the_one_check():
    """core.params.resolve: token ids in the vocabulary, a non-empty prompt
    that leaves room for a token, the verification mode's limits, the token
    limit; each refusal a RequestFieldError naming the field at fault."""
    from edgespec.core.params import resolve
    from edgespec.core.verify import VerifyConfig
    from edgespec.errors import GrammarError, PromptTooLongError, RequestFieldError
    r = resolve(Request([1, 2, 3], max_tokens=None), [1, 2, 3], n_ctx=10, n_vocab=50)
    assert r.prompt.dtype == np.int32 and r.prompt.tolist() == [1, 2, 3] and r.limit == 7
    assert resolve(Request([1], max_tokens=4), [1], n_ctx=10, n_vocab=50).limit == 4
    assert resolve(Request([1], max_tokens=40), [1], n_ctx=10, n_vocab=50).limit == 9     # the context's end
    for ids in ([50], [-1], [[1, 2]], [2**40], [1.5]):
        with pytest.raises(RequestFieldError, match="token ids") as e:
            resolve(Request(ids), ids, n_ctx=10, n_vocab=50)
        assert e.value.param == "prompt"
    with pytest.raises(RequestFieldError, match="empty") as e:
        resolve(Request([]), [], n_ctx=10, n_vocab=50, param="messages")
    assert e.value.param == "messages"
    with pytest.raises(PromptTooLongError) as e:
        resolve(Request(list(range(10))), list(range(10)), n_ctx=10, n_vocab=50)
    assert (e.value.param, e.value.code, e.value.n_prompt) == ("prompt", "context_length_exceeded", 10)
    with pytest.raises(RequestFieldError, match="token ids") as e:
        resolve(Request([1]), [1], n_ctx=10, n_vocab=50, prediction=[99])
    assert e.value.param == "prediction"
    lossy = VerifyConfig("relaxed")
    with pytest.raises(RequestFieldError, match="greedy") as e:
        resolve(Request([1], sampling=SamplingConfig(temperature=0.7)), [1], n_ctx=10, n_vocab=50, verify=lossy)
    assert e.value.param == "temperature"
    with pytest.raises(GrammarError):
        resolve(Request([1]), [1], n_ctx=10, n_vocab=50, verify=lossy, grammar=object())


# where a request used to be checked again; now each of these texts and calls has one home
ONE_HOME = {r"token ids must be a flat": "core/params.py", r"\btoken_limit\(": "core/params.py",
            r"raise PromptTooLongError\(": "core/params.py", r"def check_request": None,
            r"str\(e\)\.startswith": None, r"emit\(\(": None, r"RequestError\(499": "app/request_fields.py"}


@pytest.mark.parametrize("pattern", sorted(ONE_HOME))
def test_a_request_is_checked_in_one_place(pattern):
    where = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if re.search(pattern, p.read_text())}
    home = ONE_HOME[pattern]
    assert where == ({home} if home else set()), where


def test_engine_run_checks_nothing():
    """Engine.run takes a Resolved and reads no field it would have to check."""
    from edgespec.core import engine
    src = inspect.getsource(engine.Engine.run) + inspect.getsource(engine.Engine._start)
    assert not re.search(r"raise \w", src) and "n_vocab" not in src and "token_limit" not in src
    assert "resolved: Resolved" in inspect.getsource(engine.Engine.run).splitlines()[0]


def test_model_resolve_refuses_before_waiting(model):
    """SpecModel.resolve resolves text, messages, a schema and a prediction,
    and refuses without waiting for the model (the server's 400 before the
    queue); a Resolved runs as its Request does."""
    from edgespec.errors import ConfigError, GrammarError, PromptTooLongError
    r = model.resolve(Request("Name three colours.", max_tokens=4, json_schema={"type": "object"},
                              prediction="red, green"))
    assert r.grammar is not None and r.prediction is not None and r.engine_key == (None, True)
    assert r.prompt.tolist() == model.prompt_tokens("Name three colours.").tolist() and r.limit == 4
    r.close()
    with model.stream("Hello", max_tokens=64):       # the model is held by this thread's stream ...
        with pytest.raises(PromptTooLongError):      # ... and resolve does not wait for it
            model.resolve(Request("word " * (2 * model.n_ctx), raw=True))
        with pytest.raises(GrammarError):
            model.resolve(Request("Hi", grammar="root ::= nonsense-rule"))
    once = model.resolve(Request("Hi", max_tokens=2, json_schema={"type": "object"}))
    model.run(once)
    with pytest.raises(ConfigError, match="has run"):      # its grammar's state is spent: refused, not a crash
        model.run(once)
    plain = Request("Name three colours.", max_tokens=6, drafter="none")
    assert model.run(model.resolve(plain)).tokens == model.run(plain).tokens


class _Vocab:
    n_vocab = 100

    def chat_template(self):
        return None


class _Model:
    n_ctx, vocab = 64, _Vocab()


def test_the_server_builds_one_value_from_a_body():
    """RequestParser.parse: an HTTP body into one frozen ServeRequest whose
    Request carries the server's defaults where the body leaves a field out."""
    from edgespec.app.request_fields import SERVE_DEFAULTS, Limits, RequestParser, ServeRequest
    defaults = SERVE_DEFAULTS.but(sampling=SamplingConfig(temperature=0.5, seed=7), drafter="none")
    parser = RequestParser(_Model(), "smol", defaults, Limits().resolve(64))
    call = parser.parse({"prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "logprobs": 2,
                         "json_schema": {"type": "object"}, "stop": "\n"}, chat=False)
    assert isinstance(call, ServeRequest) and call.stream and not call.chat and call.model == "smol"
    r = call.request
    assert (r.prompt, r.max_tokens, r.logprobs, r.stop, r.drafter) == ([1, 2, 3], 4, 2, ("\n",), "none")
    assert r.sampling == SamplingConfig(temperature=0.5, seed=7) and r.json_schema == {"type": "object"}
    assert call.grammar_param == "json_schema" and r.grammar is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.stream = False          # type: ignore[misc]
    chat = parser.parse({"messages": [{"role": "user", "content": "Hi"}], "cache_prompt": False}, chat=True)
    assert chat.request.max_tokens is None and chat.request.reuse_prefix is False and chat.tools is None


def test_request_options_reach_the_engine(model):
    """A Request run whole: max_tokens caps the answer, logprobs reports N
    alternatives per token, the same value through stream, and generate()'s
    keywords build the same request."""
    toks = model.prompt_tokens("Name three colours.")
    req = Request(toks, max_tokens=5, logprobs=2, drafter="none")
    r = model.run(req)
    assert r.n_generated == 5 and r.stop_reason == "length"
    assert len(r.logprobs) == 5 and all(len(t.top) == 2 for t in r.logprobs)
    assert [t.token for t in r.logprobs] == r.tokens
    with model.run_stream(req.but(max_tokens=3, logprobs=None)) as s:
        chunks = list(s)
    last = chunks[-1].result
    assert last.n_generated == 3 and last.logprobs is None and last.tokens == r.tokens[:3]
    g = model.generate(toks, max_tokens=5, logprobs=2, drafter="none")
    assert g.tokens == r.tokens and np.allclose([t.logprob for t in g.logprobs], [t.logprob for t in r.logprobs])
    # reuse_prefix on by default: the same prompt again keeps its prefix in the KV cache
    assert g.n_reused_tokens > 0
    assert model.run(req.but(reuse_prefix=False)).n_reused_tokens == 0


DOC = ROOT / "docs" / "architecture.md"


def test_architecture_names_fields_that_exist():
    """The 'how to add' section of docs/architecture.md names Request,
    RunConfig (fields and the methods that pass it on), BackendSettings and
    EngineConfig fields and drafter registry entries: they exist."""
    from edgespec.run.settings import RunConfig
    text = DOC.read_text()
    section = text[text.index("## How to add"):]
    req = set(re.findall(r"`Request\.(\w+)`", section))
    run = set(re.findall(r"`RunConfig\.(\w+)`", section))
    assert req and run
    assert req <= {f.name for f in dataclasses.fields(Request)}, req
    methods = {n for n in vars(RunConfig) if callable(getattr(RunConfig, n))}
    assert run <= {f.name for f in dataclasses.fields(RunConfig)} | methods, run
    from edgespec.backend.settings import BackendSettings
    from edgespec.core.config import EngineConfig
    for cls in (BackendSettings, EngineConfig):
        named = set(re.findall(rf"`{cls.__name__}\.(\w+)`", section))
        assert named <= {f.name for f in dataclasses.fields(cls)}, named
    for path in re.findall(r"`((?:edgespec/)?(?:core|app|drafters|backend|bench)/[\w/]+\.py)`", text):
        p = ROOT / path if path.startswith("edgespec/") else SRC / path
        assert p.exists(), path
