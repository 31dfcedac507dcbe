"""edgespec: lossless tree speculative decoding for local GGUF models on llama.cpp."""
from edgespec.app.api import SpecModel
from edgespec.app.concurrency import Stream, StreamChunk
from edgespec.app.compat import Llama
from edgespec.app.compat_state import LlamaCache, LlamaDiskCache, LlamaRAMCache, LlamaState
from edgespec.run.settings import RunConfig
from edgespec.core.config import EngineConfig
from edgespec.core.params import Request
from edgespec.core.result import GenerationResult
from edgespec.core.stream import Chunk
from edgespec.errors import (BackendError, BenchError, ConfigError, CorpusError, EdgespecError, EmbeddingsError,
                     ModelBusyError, ModelClosedError, ModelFileError, ModelLoadError, PromptTooLongError)
from edgespec.drafters.tree import DraftTree
from edgespec.core.verify import SamplingConfig
from edgespec.version import __version__

__all__ = ["SpecModel", "RunConfig", "Stream", "StreamChunk", "Chunk", "SamplingConfig", "Request", "GenerationResult", "EngineConfig",
           "DraftTree", "Llama", "LlamaState", "LlamaCache", "LlamaRAMCache", "LlamaDiskCache", "EdgespecError",
           "ConfigError", "PromptTooLongError", "ModelFileError",
           "CorpusError", "EmbeddingsError", "BenchError", "BackendError", "ModelLoadError", "ModelBusyError",
           "ModelClosedError", "__version__"]
