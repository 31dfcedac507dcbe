"""What users touch: the library API, the llama-cpp-python drop-in, the HTTP server, the CLI and chat."""
