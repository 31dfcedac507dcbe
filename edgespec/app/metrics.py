"""`edgespec serve`'s /metrics: Prometheus counters of one server.

Each Server has a registry of its own (not prometheus_client's global one), so
several servers in one process count apart.  Counters (exposed with the
`_total` suffix):

    edgespec_requests{endpoint, status}       HTTP requests answered
    edgespec_generations{stop_reason}         generations ended: stop, length, cancelled
    edgespec_generations_to_context_end       ... of them without max_tokens (they may run to
                                              the end of the turn or of the context)
    edgespec_prompt_tokens                    prompt tokens of ended generations
    edgespec_prompt_tokens_cached             ... of them reused from the KV cache (the live
                                              one or the prompt cache): llama-server's cache_n
    edgespec_generated_tokens                 tokens generated
    edgespec_draft_tokens                     draft tokens verified (proposed by the
                                              drafter and kept by the cost gate)
    edgespec_draft_tokens_accepted            draft tokens accepted
    edgespec_steps                            verification steps (decodes after the prefill)
    edgespec_prefill_seconds                  time in prefill
    edgespec_decode_seconds                   time in decoding (drafting and verification)

Gauges: edgespec_queue_depth (requests waiting), edgespec_requests_running,
edgespec_prompt_cache_bytes and edgespec_prompt_cache_entries (the saved
prefixes of edgespec.core.prefix_cache, 0 when it is off).

The prompt cache's disk tier (edgespec.core.prompt_disk), counted by this
process, 0 when it is off:

    edgespec_prompt_cache_disk_hits           prefixes restored from files
    edgespec_prompt_cache_disk_misses         prompts no file shared a whole block with
    edgespec_prompt_cache_disk_read_bytes     bytes of files read
    edgespec_prompt_cache_disk_written_bytes  bytes of files written
    edgespec_prompt_cache_disk_evictions      files deleted for the budget (this process's)

and the gauges edgespec_prompt_cache_disk_bytes / _files (this model's files
in the folder) and edgespec_prompt_cache_disk_on (0 once the tier turned off).
"""
from __future__ import annotations

from typing import Callable


DISK_COUNTERS = (
    ("edgespec_prompt_cache_disk_hits", "disk_hits", "Prompt prefixes restored from the prompt cache's files"),
    ("edgespec_prompt_cache_disk_misses", "disk_misses", "Prompts that no prompt cache file shared a block with"),
    ("edgespec_prompt_cache_disk_read_bytes", "disk_bytes_read", "Bytes of prompt cache files read"),
    ("edgespec_prompt_cache_disk_written_bytes", "disk_bytes_written", "Bytes of prompt cache files written"),
    ("edgespec_prompt_cache_disk_evictions", "disk_evicted", "Prompt cache files deleted for the disk budget"),
)


class ServerMetrics:
    """The counters of one server; observe() takes a finished GenerationResult."""

    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float],
                 prompt_cache: Callable[[], dict] = dict):
        from prometheus_client import CollectorRegistry, Counter, Gauge
        self.registry = r = CollectorRegistry()
        self.requests = Counter("edgespec_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.generations = Counter("edgespec_generations", "Generations ended, by stop reason", ["stop_reason"],
                                   registry=r)
        self.prompt_tokens = Counter("edgespec_prompt_tokens", "Prompt tokens of ended generations", registry=r)
        self.prompt_cached = Counter("edgespec_prompt_tokens_cached",
                                     "Prompt tokens reused from the KV cache instead of decoded", registry=r)
        self.to_end = Counter("edgespec_generations_to_context_end",
                              "Generations whose request gave no max_tokens (they may run to the end of the context)",
                              registry=r)
        self.generated = Counter("edgespec_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("edgespec_draft_tokens", "Draft tokens verified (proposed and kept by the cost gate)",
                               registry=r)
        self.accepted = Counter("edgespec_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.steps = Counter("edgespec_steps", "Verification steps (decodes after the prefill)", registry=r)
        self.prefill_s = Counter("edgespec_prefill_seconds", "Seconds spent in prefill", registry=r)
        self.decode_s = Counter("edgespec_decode_seconds", "Seconds spent decoding (drafting and verification)",
                                registry=r)
        Gauge("edgespec_queue_depth", "Requests waiting for the model", registry=r).set_function(queue_depth)
        Gauge("edgespec_requests_running", "Requests running on the model", registry=r).set_function(running)
        Gauge("edgespec_prompt_cache_bytes", "Bytes of KV state held by the prompt cache",
              registry=r).set_function(lambda: prompt_cache().get("bytes", 0))
        Gauge("edgespec_prompt_cache_entries", "Prompt prefixes saved in the prompt cache",
              registry=r).set_function(lambda: prompt_cache().get("entries", 0))
        self._disk_tier(prompt_cache)

    def _disk_tier(self, prompt_cache: Callable[[], dict]) -> None:
        """The disk tier's counters, read from the cache's stats at every scrape."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        class DiskTier:
            def collect(self):
                s = prompt_cache()
                for name, key, doc in DISK_COUNTERS:
                    yield CounterMetricFamily(name, doc, value=s.get(key, 0))
                yield GaugeMetricFamily("edgespec_prompt_cache_disk_bytes", "Bytes of this model's prompt cache files",
                                        value=s.get("disk_bytes", 0))
                yield GaugeMetricFamily("edgespec_prompt_cache_disk_files", "This model's prompt cache files",
                                        value=s.get("disk_entries", 0))
                yield GaugeMetricFamily("edgespec_prompt_cache_disk_on", "1 while the prompt cache's disk tier is on",
                                        value=int("disk_off" in s and s["disk_off"] is None))
        self.registry.register(DiskTier())

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe(self, r, to_end: bool = False) -> None:
        """Count a finished generation (an engine GenerationResult; to_end: its request gave no max_tokens)."""
        self.generations.labels(r.stop_reason).inc()
        if to_end:
            self.to_end.inc()
        self.prompt_tokens.inc(r.n_prompt_tokens)
        self.prompt_cached.inc(r.n_reused_tokens)
        self.generated.inc(r.n_generated)
        self.drafted.inc(r.n_draft_nodes)
        self.accepted.inc(r.n_draft_accepted)
        self.steps.inc(r.n_steps)
        self.prefill_s.inc(max(0.0, r.prefill_s))
        self.decode_s.inc(max(0.0, r.decode_s))

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the text format."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
