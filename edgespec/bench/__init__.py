"""The benchmark: runner, peers (llama-server, llama-cpp-python) and report."""
