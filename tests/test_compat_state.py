"""The drop-in's save_state / load_state and set_cache (issue 57, item 4):
llama-cpp-python's calls, with edgespec's prompt cache underneath, on
SmolLM2 in the real llama.cpp (exact kernels: the answers are compared)."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec import ConfigError, Llama, LlamaCache, LlamaDiskCache, LlamaRAMCache, LlamaState

from conftest import dev_prompts

TEXT = dev_prompts(136)[0]["turns"][0] + "\n\nIn one sentence, what is this about?\n"
OTHER = dev_prompts(324)[0]["turns"][0]


def llama(path) -> Llama:
    return Llama(path, n_ctx=1024, drafter="none", calibrate=False, verbose=False)


def text(out: dict) -> str:
    return out["choices"][0]["text"]


def test_save_state_and_load_state_as_llama_cpp_python(model_path):
    with llama(model_path) as llm:
        llm.set_cache(None)                 # only the live KV cache: what load_state puts back is all there is
        want = text(llm(TEXT, max_tokens=8, temperature=0))
        st = llm.save_state()
        toks = llm.tokenize(TEXT.encode())
        assert isinstance(st, LlamaState) and isinstance(st.llama_state, bytes)
        assert st.llama_state_size == len(st.llama_state) > 1000 * st.n_tokens
        assert st.input_ids.dtype == np.intc and st.n_tokens == len(st.input_ids) >= len(toks)
        assert st.input_ids[:len(toks)].tolist() == toks and st.scores.shape == (0, llm.n_vocab())
        llm(OTHER, max_tokens=4)            # the cache now holds another prompt
        llm.set_seed(7)
        llm.load_state(st)
        assert llm._seed == st.seed and llm.spec_model.backend.kv_tokens.tolist() == st.input_ids.tolist()
        r = llm.spec_model.generate(toks, max_tokens=8)
        assert r.n_reused_tokens == len(toks) - 1 and r.text == want
        # misuse fails loudly: another model's (key), damaged bytes, tokens that are not its own
        other_key = st.llama_state.replace(llm.spec_model.cells_key.encode(), b"0" * 24, 1)
        damaged = st.llama_state[:-3] + bytes(b ^ 0xFF for b in st.llama_state[-3:])
        for blob, ids, why in ((other_key, st.input_ids, "another model"), (damaged, st.input_ids, "corrupt"),
                               (st.llama_state, st.input_ids[::-1].copy(), "not the ones")):
            bad = LlamaState(ids, st.scores, st.n_tokens, blob, len(blob), 0)
            with pytest.raises(ConfigError, match=why):
                llm.load_state(bad)


def test_set_cache_takes_edgespecs_tiers(model_path, tmp_path):
    folder = str(tmp_path / "llama_cache")
    with llama(model_path) as llm:
        assert LlamaCache is LlamaRAMCache
        ram = LlamaRAMCache(capacity_bytes=64 << 20)
        llm.set_cache(ram)
        pc = llm.spec_model.prefix_cache
        assert pc.budget == 64 << 20 and pc.disk is None and llm.cache is ram and ram.cache_size == 0
        disk = LlamaDiskCache(cache_dir=folder, capacity_bytes=256 << 20)
        llm.set_cache(disk)
        pc = llm.spec_model.prefix_cache
        assert pc.disk.folder == folder and pc.disk.budget == 256 << 20
        want = text(llm(TEXT, max_tokens=8, temperature=0))
        pc.disk.flush()
        assert disk.cache_size > 0
        llm.set_cache(None)
        assert llm.spec_model.prefix_cache is None
        with pytest.raises(ConfigError, match="LlamaRAMCache"):
            llm.set_cache(object())
    with llama(model_path) as llm:             # a restart: the prompt's cells come from the folder
        llm.set_cache(LlamaDiskCache(cache_dir=folder))
        assert text(llm(TEXT, max_tokens=8, temperature=0)) == want
        assert llm.spec_model.prefix_cache.n_disk_restored == 1
