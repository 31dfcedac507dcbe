"""Finding a model: names, paths, sources (Hugging Face, Ollama, LM Studio) and the zoo of known GGUFs."""
