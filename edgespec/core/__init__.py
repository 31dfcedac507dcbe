"""The engine's data path: draft trees, the engine loop and its gate, verification, logprobs.

Nothing here imports click; llama_cpp is reached only through a backend."""
