"""edgespec: lossless tree speculative decoding for local GGUF models on llama.cpp."""
from .api import SpecModel, Stream, StreamChunk
from .compat import Llama
from .engine import Chunk, EngineConfig, GenerationResult
from .errors import (BackendError, BenchError, ConfigError, CorpusError, EdgespecError, EmbeddingsError,
                     ModelBusyError, ModelClosedError, ModelFileError, ModelLoadError, PromptTooLongError)
from .tree import DraftTree
from .verify import SamplingConfig

__all__ = ["SpecModel", "Stream", "StreamChunk", "Chunk", "SamplingConfig", "GenerationResult", "EngineConfig",
           "DraftTree", "Llama", "EdgespecError", "ConfigError", "PromptTooLongError", "ModelFileError",
           "CorpusError", "EmbeddingsError", "BenchError", "BackendError", "ModelLoadError", "ModelBusyError",
           "ModelClosedError"]
__version__ = "0.1.0"


