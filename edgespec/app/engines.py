"""How a SpecModel builds its engines and keeps them calibrated.

One engine per drafter spec (a name, a Drafter object, or either with a
request's predicted output), all over the same backend, EngineConfig and cost
curve c(T); where c(T) and the exactness verdict come from (the cache, a
foreground measurement, the built-in curve while a background thread measures
between requests) and the switch of every engine to a new curve.  ModelEngines
is SpecModel's base class: it works on the attributes SpecModel's constructor
sets (backend, model_path, prefix_cache, _engines, _calibration) and sets the rest
(vocab, corpora, cost, exactness, config, engine) in _setup.
"""
from __future__ import annotations

import dataclasses
import warnings

from edgespec.backend.llama import EXACT_MAX_BATCH
from edgespec.calibration.background import Pacer
from edgespec.calibration.cache import CalibrationStopped, backend_key
from edgespec.calibration.curve import CostCurve, cached_curve, load_or_measure, plan_contexts
from edgespec.calibration.first import builtin_curve, quick_curve
from edgespec.calibration.exactness import ExactnessReport, load_or_check_exactness
from edgespec.core.engine import Engine
from edgespec.core.verify import VerifyConfig
from edgespec.run.settings import RunConfig
from edgespec.run.specs import drafter_from_spec, engine_settings, split_verify
from edgespec.errors import ConfigError
from edgespec.memory import close_memory, open_memory


class ModelEngines:
    """SpecModel's engines and their calibration (see the module doc)."""

    def _setup(self, run: RunConfig, progress) -> None:
        """Everything after the backend has loaded: the corpora, the memory
        store, c(T) and the exactness verdict (by run.calibrate), the
        EngineConfig (run.engine_config) and the default engine."""
        self.vocab = self.backend.vocab
        self.corpora = []
        if run.corpora:
            from edgespec.corpus.format import Corpus
            self.corpora = [Corpus.load(p, vocab=self.vocab) for p in run.corpora]
        self.memory = open_memory(run.memory, self.vocab)
        if self.backend.exact and run.max_nodes > EXACT_MAX_BATCH:
            raise ConfigError(f"max_nodes must be <= {EXACT_MAX_BATCH} on CPU: larger batches take a llama.cpp "
                              "kernel whose numerics differ from one-token decoding")
        self.cost: CostCurve | None = None
        self.exactness: ExactnessReport | None = None
        self.calibration_error: BaseException | None = None
        self._calibration_state = "off"
        if run.calibrate is True:
            self.cost = self._calibrate(False, progress)
        elif run.calibrate == "background":
            self._from_cache_or_quick(progress)
        else:
            self.exactness = load_or_check_exactness(self.backend, self._calibration_key(), cached_only=True)
        self.config = run.engine_config(batch_cap=self.backend.max_nodes)
        drafter = run.drafter
        self._drafter = drafter
        self.drafter_name = drafter if isinstance(drafter, str) else drafter.name
        self.engine = self.engine_for(drafter)

    def _calibration_key(self) -> str:
        return backend_key(self.backend)

    def _calibrate(self, remeasure: bool, progress) -> CostCurve:
        key = self._calibration_key()
        # a small --ctx caps the measured contexts: a cached curve that stops
        # short of what this context size measures is measured again
        cost = load_or_measure(self.backend, key, remeasure=remeasure, progress=progress,
                               needed=plan_contexts(self.backend.n_ctx)[-1])
        self._use_calibration(cost, load_or_check_exactness(self.backend, key, recheck=remeasure,
                                                            progress=progress))
        return self.cost

    def _use_calibration(self, cost: CostCurve, exactness: ExactnessReport | None) -> None:
        """Switch every engine to this curve (with the model held, or before any request)."""
        self.cost, self.exactness = cost, exactness
        for e in self._engines.values():
            e.set_cost(cost)
        fresh = cost.origin == "measured" or (exactness is not None and exactness.origin == "measured")
        self._calibration_state = "measured" if fresh else "cached"

    def _from_cache_or_quick(self, progress) -> None:
        """calibrate="background" at load: the cached curve and self-check if both
        are there; else a quick curve measured now (quick_curve: seconds; the
        built-in curve where that fails), and the constructor starts the
        full measurement in the background."""
        key = self._calibration_key()
        cost = cached_curve(key, plan_contexts(self.backend.n_ctx)[-1])
        self.exactness = load_or_check_exactness(self.backend, key, cached_only=True)
        if cost is not None and self.exactness is not None:
            self._use_calibration(cost, self.exactness)
            return
        try:
            self.cost = cost or quick_curve(self.backend, progress)
        except ValueError:          # not a usable curve (NaN timings): the built-in one until measured
            self.cost = builtin_curve(gpu=self._every_layer_on_gpu())
        self._calibration_state = "measuring"

    def _every_layer_on_gpu(self) -> bool:
        """Every layer on the GPU: the built-in curve's shape, not the Loadout's
        `offloaded` (any layer on a GPU or RPC workers): a partial offload
        keeps the CPU's steeper built-in curve."""
        be = self.backend
        if be.n_gpu_layers >= 0:
            arch = be.metadata("general.architecture") or ""
            blocks = be.metadata(f"{arch}.block_count") or ""
            return be.n_gpu_layers > 0 and blocks.isdigit() and be.n_gpu_layers >= int(blocks)
        return True

    def _measure_between_requests(self, pacer: Pacer) -> None:
        """The background calibration's thread: measure what is not cached in
        slices between requests, then switch the engines to it."""
        key = self._calibration_key()
        try:
            cost = load_or_measure(self.backend, key, pacer=pacer, needed=plan_contexts(self.backend.n_ctx)[-1])
            exactness = load_or_check_exactness(self.backend, key, pacer=pacer)
            pacer.pause()           # a slice of its own: no request runs while the engines switch
            self._use_calibration(cost, exactness)
        except CalibrationStopped:
            self._calibration_state = "built-in"
            raise
        except Exception as e:
            self._calibration_state = "built-in"
            self.calibration_error = e
            warnings.warn(f"the background calibration failed ({e}); the built-in cost curve stays in use "
                          "(`edgespec calibrate` measures it in the foreground)", RuntimeWarning)

    def _stop_calibration(self) -> None:
        """Stop a background calibration (waits at most for its slice in progress)."""
        task = self._calibration
        if task is not None:
            task.stop()

    def use_memory(self, memory) -> None:
        """Switch the memory of earlier requests (SpecModel's memory=: True,
        False, a path or a MemoryStore); a file store in use is written first.
        The engines are built anew (their acceptance statistics start over),
        the KV cache is kept."""
        with self._request():
            close_memory(self.memory)
            self.memory = open_memory(memory, self.vocab)
            self._engines = {}
            self.engine = self.engine_for(self._drafter)

    def verify_for(self, drafter) -> VerifyConfig:
        """The verification mode the engine of `drafter` (None: the model's)
        runs, without building it: an '@mode' of a spec's own, else the model's."""
        if isinstance(drafter, str):
            return engine_settings(split_verify(drafter)[1]).get("verify", self.config.verify)
        return self.config.verify

    def engine_for(self, drafter, prediction: bool = False, slot: int = 0) -> Engine:
        """The engine of a drafter: a Drafter, or a name such as "auto",
        "suffix-nocorpus" (without the loaded corpora) or "auto@relaxed" (with a
        lossy verification mode, see VerifyConfig).  prediction: the engine
        whose drafter also drafts from a request's predicted output.  slot: the
        parallel slot it runs in (edgespec.app.scheduler): each slot has engines
        of its own (their drafters' and gates' state), over its own KV sequences;
        a Drafter object runs in slot 0 only."""
        key = drafter if isinstance(drafter, str) else id(drafter)
        key = ("slot", slot, key) if slot else key
        backend = self.backend.slot(slot) if slot else self.backend
        if prediction:
            if ("prediction", key) not in self._engines:
                from edgespec.drafters.prediction import PredictionDrafter
                base = self.engine_for(drafter, slot=slot)
                d = PredictionDrafter(base.drafter)
                d.warmup()
                self._engines[("prediction", key)] = Engine(backend, d, self.cost, base.config)
                self._engines[("prediction", key)].memory = self.memory
                self._engines[("prediction", key)].prefix_cache = self.prefix_cache
            return self._engines[("prediction", key)]
        if key not in self._engines:
            config = self.config
            if isinstance(drafter, str):
                d, mode = drafter_from_spec(drafter, n_vocab=self.vocab.n_vocab, model_path=self.model_path,
                                            corpora=self.corpora, memory_store=self.memory)
                if mode:        # an engine mode gets a config of its own; the others share the model's
                    config = dataclasses.replace(self.config, **engine_settings(mode))
            elif slot:
                raise ConfigError("a Drafter object runs in parallel slot 0 only (name a drafter to run it in every slot)")
            else:
                d = drafter
            d.warmup()
            self._engines[key] = Engine(backend, d, self.cost, config)
            self._engines[key].memory = self.memory
            self._engines[key].prefix_cache = self.prefix_cache
        return self._engines[key]

