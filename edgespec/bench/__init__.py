"""The benchmark: the prompts and their answer checks (prompts, answers), the
methods and the peers they run (methods, llama_peer, peers, peer_server), the
run itself (runner, divergence) and the report (results, stats, report)."""
