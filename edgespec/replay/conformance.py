"""Each backend against backend/protocol.py's `Backend`, checked by mypy.

The functions below type-check only while LlamaBackend and ReplayBackend
have every attribute and method `Backend` lists, with compatible types and
signatures, so a backend that drifts from the protocol fails `mypy` (the lint
step of .ci/run), which names the missing or conflicting members.  Nothing
imports this module at run time.
"""
from __future__ import annotations

from edgespec.backend.llama import LlamaBackend
from edgespec.backend.protocol import Backend
from edgespec.replay.simulator import ReplayBackend


def llama_as_backend(backend: LlamaBackend) -> Backend:
    return backend


def replay_as_backend(backend: ReplayBackend) -> Backend:
    return backend
