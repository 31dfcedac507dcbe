"""edgespec's errors: one hierarchy under EdgespecError.

    try:
        model.generate(prompt)
    except edgespec.EdgespecError as e:       # anything edgespec itself refuses
        ...

Errors that are a caller's mistake (a bad file, a bad setting, a prompt too
long) also derive from ValueError, so code that caught ValueError before keeps
working; errors about the state of things (llama.cpp failed, the model is busy
or closed) derive from RuntimeError.  The modules that raise them re-export
them under their old names (edgespec.models.gguf.ModelFileError, ...).
"""
from __future__ import annotations


class EdgespecError(Exception):
    """Base class of every error edgespec raises on purpose."""


class ConfigError(EdgespecError, ValueError):
    """A setting or argument out of range or of the wrong kind (a sampling
    parameter, a drafter name, max_tokens < 1, ...)."""


class RequestFieldError(ConfigError):
    """A request that cannot run on this model, with the request field at
    fault (`param`: "prompt", "max_tokens", "prediction", "grammar", ...;
    None where no one field is) and an OpenAI-style error code, so that an
    edge (the HTTP server) answers it without reading the message."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


class PromptTooLongError(RequestFieldError):
    """The prompt does not fit the model's context (n_ctx)."""

    def __init__(self, message: str, n_prompt: int = 0, n_ctx: int = 0, param: str = "prompt"):
        super().__init__(message, param, "context_length_exceeded")
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


class GrammarError(RequestFieldError):
    """A grammar or JSON schema that cannot be used: too large or deep, not
    convertible, or refused by llama.cpp's parser (param: the field it came from)."""

    def __init__(self, message: str, param: str | None = "grammar", code: str = "invalid_value"):
        super().__init__(message, param, code)


class ModelFileError(EdgespecError, ValueError):
    """The model path is missing, unreadable or not a usable GGUF file."""


class CorpusError(EdgespecError, ValueError):
    """A corpus file is missing, damaged, or built for another tokenizer; or a
    build was asked for something impossible (no input, no text, unwritable output)."""


class EmbeddingsError(EdgespecError, ValueError):
    """The model's token embeddings cannot be read (auto's semantic fallback)."""


class BenchError(EdgespecError, ValueError):
    """A user mistake in the benchmark's inputs (prompts file, methods, results file)."""


class BackendError(EdgespecError, RuntimeError):
    """llama.cpp refused or failed an operation."""


class Interrupted(BackendError):
    """A decode stopped by another thread (edgespec.backend.interrupt); the
    KV cache holds the committed prefix only."""


class ModelLoadError(BackendError):
    """The model file could not be loaded."""


class PeerError(EdgespecError, RuntimeError):
    """A peer of the bench (llama.cpp's llama-server) is not built, could not be
    built, started or asked, or was built from another llama.cpp."""


class ModelBusyError(EdgespecError, RuntimeError):
    """The model is serving another request and the caller asked not to wait
    (wait=False), waited longer than its timeout, or would deadlock waiting
    (a request from the thread whose own stream holds the model)."""


class ModelClosedError(EdgespecError, RuntimeError):
    """The model was closed (SpecModel.close()); it cannot run requests any more."""


__all__ = ["EdgespecError", "ConfigError", "RequestFieldError", "PromptTooLongError", "GrammarError", "ModelFileError", "CorpusError",
           "EmbeddingsError", "BenchError", "BackendError", "ModelLoadError", "PeerError", "ModelBusyError",
           "ModelClosedError"]
