"""Running llama-cpp-python's own `Llama` beside edgespec with edgespec's load settings.

The bench (and the tests that compare edgespec with llama-cpp-python) load a
reference `llama_cpp.Llama`; its constructor has no argument for CPU weight
repacking, which edgespec turns off (backend/llama.py, load_model), so the
setting is applied here by wrapping the parameters it starts from.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def llama_cpp_python_repack(cpu_repack: bool):
    """While active, llama_cpp.Llama loads models with CPU weight repacking on
    or off (its constructor has no argument for it: it starts from
    llama_model_default_params(), which this wraps).  The bench runs
    llama-cpp-python beside edgespec with the same setting (see load_model)."""
    import llama_cpp.llama_cpp as C

    orig = C.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = bool(cpu_repack)
        return p

    C.llama_model_default_params = params
    try:
        yield
    finally:
        C.llama_model_default_params = orig
