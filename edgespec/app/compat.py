"""A drop-in for llama-cpp-python's `Llama`: edgespec behind the same calls.

    from edgespec import Llama                 # instead of: from llama_cpp import Llama
    llm = Llama(model_path="model.gguf", n_ctx=2048, seed=1, drafter="suffix")
    out = llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
    print(out["choices"][0]["message"]["content"], out["usage"])
    for chunk in llm("Q: Name a fruit. A:", max_tokens=16, stop=["\\n"], stream=True):
        print(chunk["choices"][0]["text"], end="")

The constructor takes llama_cpp.Llama's parameters where they apply
(model_path, n_ctx, n_threads, n_gpu_layers, seed, verbose, type_k ...),
accepts with a warning the ones that do not change the answers (use_mmap,
n_batch, ...), refuses the ones edgespec cannot honour (embedding, LoRA, rope
scaling, ...), and adds edgespec's own (drafter, corpora, max_nodes, ...).
create_completion / __call__ / create_chat_completion take llama-cpp-python's
parameters and return its OpenAI-style dicts (stream=True: iterators of
chunks).  Text comes from edgespec's engine, so it equals edgespec's own
`--drafter none` for the same settings (greedy, or sampling with the same
seed); it may differ from llama-cpp-python's, whose prompt chunking, K cache
and sampler order differ.  logprobs come in llama-cpp-python's shapes
(create_completion(logprobs=N): tokens, token_logprobs, top_logprobs,
text_offset; create_chat_completion(logprobs=True, top_logprobs=N):
choices[].logprobs.content) without its logits_all=True: they come from
the logits verification computes anyway.  Unlike llama-cpp-python,
logprobs=True without top_logprobs gives the tokens' own log-probabilities
(OpenAI's meaning), and token bytes are filled in.  Parameters edgespec does
not implement (repetition penalties, mirostat, functions, ...) raise
ConfigError when given a value other than their neutral default.

Structured output: create_completion(grammar=...) and
create_chat_completion(grammar=... or response_format=...) constrain the
answer (grammar: a llama_cpp.LlamaGrammar or GBNF text; response_format:
{"type": "json_object"} for any JSON object, {"type": "json_object",
"schema": {...}} as llama-cpp-python, or OpenAI's {"type": "json_schema",
"json_schema": {"schema": {...}}}); one of the two at a time, where
llama-cpp-python lets response_format win silently.  A schema the converter
cannot take is a ConfigError, not llama-cpp-python's silent fallback to any
JSON.  create_chat_completion(tools=..., tool_choice=...) renders the tools
with the GGUF's template and answers calls in OpenAI's shape
(message.tool_calls, finish_reason "tool_calls"; edgespec.app.tools), for
templates that write Qwen2.5's <tool_call> blocks.

The dicts are built by edgespec.app.openai_format, which `edgespec serve`
answers with too.
"""
from __future__ import annotations

import time
import warnings
from typing import Iterator, NamedTuple

import numpy as np

from edgespec.run.settings import DEFAULTS
from edgespec.app import tools as tooling
from edgespec.app.api import SpecModel
from edgespec.app.compat_state import LlamaDiskCache, LlamaRAMCache, LlamaState, make_state
from edgespec.app.openai_format import chat_chunk, chat_response, completion_response, new_id
from edgespec.errors import ConfigError
from edgespec.core.logprobs import LogprobFormatter
from edgespec.app.infill import Infill
from edgespec.core.params import Request, Resolved
from edgespec.app.structured import grammar_text, response_format_schema, schema_gbnf
from edgespec.core.verify import SamplingConfig

LLAMA_DEFAULT_SEED = 0xFFFFFFFF    # llama_cpp.LLAMA_DEFAULT_SEED

# llama_cpp.Llama constructor arguments that change nothing edgespec's answers
# depend on (memory mapping, batch sizes, NUMA, timing output): accepted, ignored
_IGNORED_INIT = ("split_mode", "main_gpu", "use_mmap", "use_mlock", "n_batch", "n_ubatch",
                 "logits_all", "offload_kqv", "flash_attn", "op_offload", "swa_full", "no_perf",
                 "last_n_tokens_size", "numa")
# ... and the ones it cannot honour: refused
_REFUSED_INIT = ("vocab_only", "kv_overrides", "rope_scaling_type", "pooling_type", "attention_type",
                 "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast",
                 "yarn_beta_slow", "yarn_orig_ctx", "embedding", "lora_base", "lora_scale", "lora_path",
                 "chat_handler", "draft_model", "tokenizer", "type_v", "spm_infill")
_TYPE_K = {1: "f16", 8: "q8_0"}     # ggml type ids of the K cache types edgespec runs

# sampling parameters edgespec does not implement, with their neutral values
_NEUTRAL = {"typical_p": 1.0, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "repeat_penalty": 1.0, "tfs_z": 1.0, "mirostat_mode": 0,
            "stopping_criteria": None, "logits_processor": None, "logit_bias": None,
            "functions": None, "function_call": None}


class _Reply(NamedTuple):
    """What every chunk of one answer repeats: its id, creation time and
    model name (openai_format's first three arguments)."""
    id: str
    created: int
    model: str


def _max_tokens(max_tokens: int | None) -> int | None:
    """llama-cpp-python's max_tokens as Request.max_tokens, whose rule
    (core.params.token_limit) then holds: None and <= 0 mean to the
    context's end (Request's None), and a larger one than the context leaves
    also stops at its end (llama-cpp-python's too)."""
    return None if max_tokens is None or max_tokens <= 0 else int(max_tokens)


def _stops(stop) -> tuple[str, ...]:
    """llama-cpp-python's stop: a string or a list of them (None: none)."""
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def _refuse_unsupported(**given) -> None:
    for name, value in given.items():
        neutral = _NEUTRAL[name]
        if value is not None and value != neutral:
            raise ConfigError(f"edgespec.Llama does not support {name}={value!r} "
                              f"(leave it at {neutral!r})")


# ------------------------------------------------------------------- Llama
class Llama:
    """llama_cpp.Llama's interface over an edgespec SpecModel (see the module doc).

    Like llama_cpp.Llama, one object is one model with one KV cache; calls
    reuse the cached prefix of the previous one.  Unlike it, an object may be
    shared between threads: calls queue (SpecModel's rules)."""

    def __init__(self, model_path: str | None = None, *, n_gpu_layers: int = 0, seed: int = LLAMA_DEFAULT_SEED,
                 n_ctx: int = 512, n_threads: int | None = None, n_threads_batch: int | None = None,
                 chat_format: str | None = None, type_k: int | None = None, verbose: bool = True,
                 drafter=DEFAULTS.drafter, corpora=(), max_nodes: int = DEFAULTS.max_nodes,
                 cost_gate: bool = DEFAULTS.cost_gate,
                 calibrate: bool | str = "background", verify=None, progress=None,
                 rpc_servers: str | None = None, tensor_split: list[float] | None = None, **kwargs):
        for name in kwargs:
            if name in _REFUSED_INIT:
                raise ConfigError(f"edgespec.Llama does not support {name}= (llama-cpp-python only)")
            if name not in _IGNORED_INIT:
                raise TypeError(f"Llama.__init__() got an unexpected keyword argument {name!r}")
            warnings.warn(f"edgespec.Llama ignores {name}= (it does not change edgespec's output)", stacklevel=2)
        if n_threads_batch is not None and n_threads_batch != n_threads:
            warnings.warn("edgespec.Llama ignores n_threads_batch: batches use n_threads too", stacklevel=2)
        if chat_format is not None:
            raise ConfigError("edgespec.Llama renders chats with the GGUF's own template; chat_format "
                              f"{chat_format!r} is not supported")
        if type_k is not None and type_k not in _TYPE_K:
            raise ConfigError(f"type_k must be one of {sorted(_TYPE_K)} (f16, q8_0) or None, got {type_k!r}")
        self._model = SpecModel(model_path, drafter=drafter, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers,
                                n_threads=n_threads, max_nodes=max_nodes, cost_gate=cost_gate,
                                calibrate=calibrate, verbose=verbose, progress=progress, corpora=corpora,
                                verify=verify, cache_type_k=_TYPE_K.get(type_k), rpc=rpc_servers,
                                tensor_split=tensor_split)
        self.model_path = self._model.model_path
        self.verbose = verbose
        self._seed = seed

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str, additional_files=None, local_dir: str | None = None,
                        local_dir_use_symlinks="auto", cache_dir: str | None = None, **kwargs) -> "Llama":
        """As llama_cpp.Llama.from_pretrained: download the file of the Hugging
        Face repo `repo_id` that the glob `filename` names (a split GGUF: all
        its parts) through huggingface_hub's cache, then load it; kwargs go
        to Llama()."""
        from edgespec.models.sources import hf_pretrained

        path = hf_pretrained(repo_id, filename, additional_files, cache_dir=cache_dir, local_dir=local_dir)
        return cls(model_path=path, **kwargs)

    # --------------------------------------------------------------- basics
    @property
    def spec_model(self) -> SpecModel:
        """The edgespec SpecModel underneath (its stream(), stats, ...)."""
        return self._model

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._model.tokenize(text.decode("utf-8", errors="replace"), add_special=add_bos,
                                    parse_special=special).tolist()

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        return self._model.detokenize(tokens).encode("utf-8")

    def n_ctx(self) -> int:
        return self._model.n_ctx

    def n_vocab(self) -> int:
        return self._model.vocab.n_vocab

    def token_eos(self) -> int:
        return self._model.vocab.eos_token()

    def token_bos(self) -> int:
        return self._model.vocab.bos_token()

    def set_seed(self, seed: int) -> None:
        self._seed = seed

    def reset(self) -> None:
        """Forget the KV cache (the next call prefills its whole prompt)."""
        self._model.new_session()

    def close(self) -> None:
        self._model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------- requests
    def _sampling(self, temperature, top_k, top_p, min_p, seed) -> SamplingConfig:
        return SamplingConfig(temperature=max(0.0, float(temperature)), top_k=max(0, int(top_k)),
                              top_p=float(top_p), min_p=float(min_p),
                              seed=int(seed if seed is not None else self._seed))

    def _completion_prompt(self, prompt, suffix: str | None = None) -> tuple[list[int] | Infill, str]:
        """A completion's prompt (text, or token ids) as (token ids, text);
        with a suffix, as the Infill whose FIM prompt the model resolves."""
        if suffix:
            if not isinstance(prompt, str) or not isinstance(suffix, str):
                raise ConfigError("suffix needs the prompt and the suffix as text (fill in the middle)")
            return Infill(prompt, suffix), prompt
        if isinstance(prompt, str):
            toks = self._model.tokenize(prompt, add_special=True, parse_special=True) if prompt else \
                self._model.tokenize("", add_special=True)
            return toks, prompt
        toks = [int(t) for t in prompt]
        return toks, self._model.detokenize(toks)

    def create_completion(self, prompt, suffix=None, max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0, logprobs=None,
                          echo: bool = False, stop=(), frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: str | None = None, stopping_criteria=None, logits_processor=None,
                          grammar=None, logit_bias=None):
        """Complete a prompt (text, or token ids): a text_completion dict, or
        with stream=True an iterator of its chunks (the last one has
        finish_reason).  echo=True puts the prompt before the answer.
        max_tokens as llama-cpp-python's: 16 unless given; None or <= 0: to
        the context's end; never past it (core.params.token_limit).
        logprobs=N (0..20): each token's log-probability and the N likeliest
        tokens there (not with echo: the prompt's own are not computed).
        grammar: a llama_cpp.LlamaGrammar or GBNF text the answer follows.
        suffix: the text after the answer; a prompt with a suffix is
        filled in the middle with the model's FIM tokens (edgespec.app.infill,
        the prompt /infill builds; ConfigError for a model without them)."""
        if echo and logprobs is not None:
            raise ConfigError("edgespec.Llama does not support logprobs with echo=True (the prompt's "
                              "log-probabilities are not computed)")
        _refuse_unsupported(typical_p=typical_p,
                            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                            repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                            stopping_criteria=stopping_criteria, logits_processor=logits_processor,
                            logit_bias=logit_bias)
        gbnf = grammar_text(grammar)
        toks, prompt_text = self._completion_prompt(prompt, suffix)
        # resolved (the one check) before a stream is returned: a bad call raises here
        request = self._model.resolve(Request(toks, max_tokens=_max_tokens(max_tokens), stop=_stops(stop),
                                              logprobs=logprobs, grammar=gbnf,
                                              sampling=self._sampling(temperature, top_k, top_p, min_p, seed)))
        reply = _Reply(new_id("cmpl"), int(time.time()), model or self.model_path)
        head = prompt_text if echo else ""
        fmt = LogprobFormatter(self._model.vocab, len(prompt_text)) if logprobs is not None else None
        if stream:
            return self._completion_chunks(request, reply, head, fmt)
        r = self._model.run(request)
        d = completion_response(*reply, head + r.text, r.stop_reason, len(request.prompt), r.n_generated)
        if fmt is not None:
            d["choices"][0]["logprobs"] = fmt.completion(r.logprobs)
        return d

    __call__ = create_completion

    def _completion_chunks(self, request: Resolved, reply: _Reply, head: str, fmt) -> Iterator[dict]:
        cid, created, name = reply
        with self._model.run_stream(request) as s:
            if head:
                yield completion_response(cid, created, name, head, None)
            lp = []         # logprobs of tokens whose text is held back (a possible stop string)
            for c in s:
                lp += c.logprobs or []
                if c.finish_reason is not None:
                    yield completion_response(cid, created, name, "", c.finish_reason)
                elif c.text:
                    d = completion_response(cid, created, name, c.text, None)
                    if fmt is not None:
                        d["choices"][0]["logprobs"], lp = fmt.completion(lp), []
                    yield d

    def create_chat_completion(self, messages, functions=None, function_call=None, tools=None, tool_choice=None,
                               temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                               min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False, stop=(),
                               seed: int | None = None, response_format=None, max_tokens: int | None = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: str | None = None,
                               logits_processor=None, grammar=None, logit_bias=None, logprobs=None,
                               top_logprobs=None):
        """Answer a chat (rendered with the GGUF's template): a chat.completion
        dict, or with stream=True an iterator of chat.completion.chunk dicts
        (the first has delta {"role": "assistant"}, the last finish_reason).
        max_tokens as llama-cpp-python's: None or <= 0 (the default None): to
        the context's end; never past it (core.params.token_limit).
        logprobs=True (top_logprobs=N, 0..20): choices[].logprobs.content.
        response_format / grammar: the answer's format (the module doc);
        tools / tool_choice: OpenAI's, answered in message.tool_calls
        (edgespec.app.tools); with stream=True and tools the answer is gathered
        and sent as one content or tool_calls chunk."""
        _refuse_unsupported(functions=functions, function_call=function_call, typical_p=typical_p,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                            logits_processor=logits_processor, logit_bias=logit_bias)
        n_top = (top_logprobs or 0) if logprobs else None       # top_logprobs alone asks for nothing
        treq, gbnf = self._chat_constraint(response_format, grammar, tools, tool_choice)
        # an assistant's tool_calls as the template wants them (arguments as objects)
        messages = [tooling.history_message(m, i) if isinstance(m, dict) and m.get("tool_calls") else m
                    for i, m in enumerate(messages)]
        toks = (tooling.prompt_tokens(self._model, messages, treq.tools) if treq is not None
                else self._model.prompt_tokens(messages))
        request = self._model.resolve(Request(toks, max_tokens=_max_tokens(max_tokens), stop=_stops(stop),
                                              logprobs=n_top, grammar=gbnf,
                                              sampling=self._sampling(temperature, top_k, top_p, min_p, seed)))
        reply = _Reply(new_id("chatcmpl"), int(time.time()), model or self.model_path)
        fmt = LogprobFormatter(self._model.vocab) if n_top is not None else None
        if stream and treq is not None:
            return self._chat_tool_chunks(request, reply, fmt, treq)
        if stream:
            return self._chat_chunks(request, reply, fmt)
        r = self._model.run(request)
        d = chat_response(*reply, r.text, r.stop_reason, len(toks), r.n_generated)
        if treq is not None:
            msg, finish = tooling.answer(r.text, r.stop_reason, treq)
            d["choices"][0].update(message=msg, finish_reason=finish)
        if fmt is not None:
            d["choices"][0]["logprobs"] = fmt.chat(r.logprobs)
        return d

    def _chat_constraint(self, response_format, grammar, tools, tool_choice):
        """(tools request or None, GBNF or None) of a chat call: response_format
        or grammar, or tools (whose "required" / named choice is a grammar)."""
        schema = response_format_schema(response_format)
        text = grammar_text(grammar)
        if schema is not None and text is not None:
            raise ConfigError("give response_format or grammar, not both")
        treq = tooling.tool_request(tools, tool_choice, self._model.vocab.chat_template())
        if treq is None:
            return None, (schema_gbnf(schema, "response_format") if schema is not None else text)
        if schema is not None or text is not None:
            raise ConfigError("tools cannot be combined with response_format or grammar (tool_choice=\"none\" "
                              "leaves the tools out)")
        return treq, (tooling.call_grammar(treq) if treq.mode != "auto" else None)

    def _chat_tool_chunks(self, request: Resolved, reply: _Reply, fmt, treq) -> Iterator[dict]:
        """A tools answer as chunks: generated whole first (a call is known
        only once its block has closed), then its deltas and the last chunk
        (with the logprobs)."""
        cid, created, name = reply
        r = self._model.run(request)
        yield chat_chunk(cid, created, name, {"role": "assistant"})
        msg, finish = tooling.answer(r.text, r.stop_reason, treq)
        for delta in tooling.deltas(msg):
            yield chat_chunk(cid, created, name, delta)
        last = chat_chunk(cid, created, name, {}, finish)
        if fmt is not None:
            last["choices"][0]["logprobs"] = fmt.chat(r.logprobs)
        yield last

    def _chat_chunks(self, request: Resolved, reply: _Reply, fmt) -> Iterator[dict]:
        cid, created, name = reply
        with self._model.run_stream(request) as s:
            yield chat_chunk(cid, created, name, {"role": "assistant"})
            lp = []         # logprobs of tokens whose text is held back (a possible stop string)
            for c in s:
                lp += c.logprobs or []
                if c.finish_reason is not None:
                    yield chat_chunk(cid, created, name, {}, c.finish_reason)
                elif c.text:
                    d = chat_chunk(cid, created, name, {"content": c.text})
                    if fmt is not None:
                        d["choices"][0]["logprobs"], lp = fmt.chat(lp), []
                    yield d

    # ------------------------------------------------------- state, cache
    @property
    def n_tokens(self) -> int:
        """Tokens whose cells the KV cache holds (llama-cpp-python's n_tokens)."""
        return int(self._model.backend.n_past)

    def save_state(self) -> LlamaState:
        """The KV cache as a LlamaState (llama-cpp-python's fields;
        edgespec.app.compat_state says what each holds)."""
        tokens, blob = self._model.save_prefix()
        return make_state(tokens, blob, self._model.vocab.n_vocab, self._seed)

    def load_state(self, state: LlamaState) -> None:
        """Put back a save_state() value of this model and settings (another's:
        ConfigError); the next call reuses its prefix and its seed is set."""
        n = int(state.n_tokens)
        self._model.restore_prefix(np.asarray(state.input_ids)[:n], bytes(state.llama_state)[:state.llama_state_size])
        self._seed = state.seed

    def set_cache(self, cache: LlamaRAMCache | LlamaDiskCache | None) -> None:
        """Use edgespec's prompt cache tier in place of llama-cpp-python's
        cache: LlamaRAMCache(capacity_bytes) keeps prefixes in host memory,
        LlamaDiskCache(cache_dir, capacity_bytes) in files (and the default
        host memory beside them); None turns both off (the live KV cache's
        common prefix is still reused, as llama-cpp-python does)."""
        if cache is None:
            self._model.use_prompt_cache(0, 0)
        elif isinstance(cache, LlamaDiskCache):
            self._model.use_prompt_cache(DEFAULTS.prompt_cache_mib, cache.capacity_mib, cache.cache_dir)
        elif isinstance(cache, LlamaRAMCache):
            self._model.use_prompt_cache(cache.capacity_mib, 0)
        else:
            raise ConfigError(f"set_cache takes edgespec's LlamaRAMCache or LlamaDiskCache (from edgespec import "
                              f"LlamaRAMCache) or None, not {type(cache).__name__}")
        pc = self._model.prefix_cache
        if cache is not None and pc is not None:
            cache.stats = pc.stats
        self.cache = cache
