"""edgespec: lossless tree speculative decoding for local GGUF models on llama.cpp."""
from .api import SpecModel
from .engine import EngineConfig, GenerationResult
from .tree import DraftTree
from .verify import SamplingConfig

__all__ = ["SpecModel", "SamplingConfig", "GenerationResult", "EngineConfig", "DraftTree"]
__version__ = "0.1.0"
