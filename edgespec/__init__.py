"""edgespec: lossless tree speculative decoding for local GGUF models on llama.cpp."""
from edgespec.app.api import SpecModel, Stream, StreamChunk
from edgespec.app.compat import Llama
from edgespec.core.engine import Chunk, EngineConfig, GenerationResult
from edgespec.errors import (BackendError, BenchError, ConfigError, CorpusError, EdgespecError, EmbeddingsError,
                     ModelBusyError, ModelClosedError, ModelFileError, ModelLoadError, PromptTooLongError)
from edgespec.core.tree import DraftTree
from edgespec.core.verify import SamplingConfig

__all__ = ["SpecModel", "Stream", "StreamChunk", "Chunk", "SamplingConfig", "GenerationResult", "EngineConfig",
           "DraftTree", "Llama", "EdgespecError", "ConfigError", "PromptTooLongError", "ModelFileError",
           "CorpusError", "EmbeddingsError", "BenchError", "BackendError", "ModelLoadError", "ModelBusyError",
           "ModelClosedError"]
__version__ = "0.1.0"


