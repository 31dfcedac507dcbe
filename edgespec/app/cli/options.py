"""The options the commands share, and what reading them needs.

The decorators that add the model, log, backend, generation and corpus
options and the one that turns the run options into a RunConfig
(run_config_options); the per-invocation log settings their callbacks record;
MODEL's completion and the check that it is named once; the drafter and
sampling values checked before a model loads; and user_errors, which turns
the library's errors into one-line messages.  Every command module builds its
options from here, so each option is defined (and its help written) once.
"""
from __future__ import annotations

import contextlib
import functools
import os

import click

from edgespec.backend.llama import MIN_CTX
from edgespec.run.kernels import ENV as KERNELS_ENV
from edgespec.drafters.registry import help_text as drafters_help
from edgespec.run.settings import DEFAULTS, DISK_MIB, RunConfig
from edgespec.run.specs import check_drafter_name
from edgespec.core.params import DEFAULT as REQUEST


def log_settings(ctx=None) -> dict:
    """--verbose / --quiet / --log-file of this invocation (given to the group
    or to the command; kept in the root context, so each run starts afresh)."""
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None:
        return {"verbose": False, "quiet": False, "log_file": None}
    return ctx.find_root().meta.setdefault("edgespec.log", {"verbose": False, "quiet": False, "log_file": None})


def _set_log(ctx, param, value):
    if value and not ctx.resilient_parsing:
        log_settings(ctx)[param.name] = value
        if param.name == "quiet" and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ:
            # huggingface_hub reads it when it is imported (after this, when a model is resolved)
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
            ctx.find_root().call_on_close(lambda: os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None))
    return value


def log_options(f):
    """--verbose (llama.cpp's own log on stderr), --quiet, --log-file FILE."""
    f = click.option("--log-file", type=click.Path(dir_okay=False), expose_value=False, callback=_set_log,
                     help="Append llama.cpp's log to FILE.")(f)
    f = click.option("--quiet", is_flag=True, expose_value=False, callback=_set_log,
                     help="No progress bars or notes on stderr (errors still).")(f)
    return click.option("--verbose", is_flag=True, expose_value=False, callback=_set_log,
                        help="Show llama.cpp's own log on stderr.")(f)


def complete_model(ctx, param, incomplete):
    """Shell completion of MODEL: the names `edgespec models` knows, then paths."""
    from click.shell_completion import CompletionItem

    from edgespec.models.sources import complete
    return [CompletionItem(n) for n in complete(incomplete)] + [CompletionItem(incomplete, type="file")]


def pick_model(positional, option=None, hf=None):
    """The one MODEL given as an argument, -m/--model or -hf (None: the default)."""
    from edgespec.models.sources import HF_PREFIX

    given = [x for x in (positional, option, hf and HF_PREFIX + hf.removeprefix(HF_PREFIX)) if x]
    if len(given) > 1:
        raise click.UsageError(f"the model is named twice ({', '.join(given)}): use MODEL, -m/--model or -hf")
    return given[0] if given else None


def model_options(f):
    """-m/--model MODEL and -hf USER/REPO[:QUANT] as alternatives to the MODEL
    argument (for generate, to the MODEL of [MODEL] PROMPT)."""
    @functools.wraps(f)
    def run(*a, model_opt=None, hf_repo=None, **kw):
        if "args" in kw:
            named = pick_model(None, model_opt, hf_repo)
            if named and len(kw["args"]) > 1:
                pick_model(kw["args"][0], named)
            kw["args"] = ((named,) if named else ()) + tuple(kw["args"])
        else:
            kw["model"] = pick_model(kw.get("model"), model_opt, hf_repo)
        return f(*a, **kw)

    run = click.option("-hf", "--hf-repo", "hf_repo", metavar="USER/REPO[:QUANT]",
                       help="A Hugging Face repo's GGUF (QUANT: Q4_K_M when left out), downloaded into "
                            "huggingface_hub's cache.")(run)
    run = click.option("-m", "--model", "model_opt", metavar="MODEL", shell_complete=complete_model,
                       help="The model (as the MODEL argument).")(run)
    return log_options(run)


@contextlib.contextmanager
def user_errors():
    """Turn the library's errors (edgespec.EdgespecError) into one-line ClickExceptions."""
    from edgespec.errors import EdgespecError

    try:
        yield
    except EdgespecError as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise click.ClickException(msg) from None


class DrafterSpec(click.ParamType):
    """A drafter name with optional switches (see drafters.parse_drafter_name)
    and an optional @mode (run/specs.py: a verification mode, or
    holdN, the held batch width)."""
    name = "NAME"

    def convert(self, value, param, ctx):
        try:
            check_drafter_name(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


def corpus_option(f):
    """--corpus FILE (repeatable)."""
    return click.option("--corpus", "corpora", multiple=True, type=click.Path(dir_okay=False),
                        help="A compiled corpus (edgespec build-corpus) for the drafters that use one "
                             "(suffix, trigram, adjacency); repeatable.")(f)


def _parse_rpc(ctx, param, value):
    """--rpc HOST:PORT,... as a list of endpoints, -ts P0,P1,... as a list of proportions (None: not given)."""
    if not value or ctx.resilient_parsing:
        return None
    from edgespec.backend.ggml import parse_endpoints
    from edgespec.errors import ConfigError

    try:
        if param.name == "rpc":
            return parse_endpoints(value) or None
        return [float(x) for x in value.replace("/", ",").split(",") if x.strip()] or None
    except (ConfigError, ValueError) as e:
        raise click.BadParameter(str(e) if isinstance(e, ConfigError) else
                                 f"proportions separated by commas, not {value!r}") from None


def backend_options(f):
    """--ctx, --n-gpu-layers, --threads, --cache-type-k, --kernels, --rpc, --rpc-output, --tensor-split."""
    f = click.option("-ts", "--tensor-split", "tensor_split", metavar="P0,P1,...", callback=_parse_rpc,
                     help="Proportions of the offloaded layers per device: the --rpc workers in order, then "
                          "local GPUs (default: by their free memory).")(f)
    f = click.option("--rpc-output", "rpc_output", type=click.Choice(("local", "remote")),
                     default=DEFAULTS.rpc_output, show_default=True,
                     help="Over --rpc, where the output layer runs: local = this machine computes the logits "
                          "(only hidden states cross the link), remote = the last worker does (every verified "
                          "token's logits, 4 bytes per vocabulary entry, cross the link).")(f)
    f = click.option("--rpc", metavar="HOST:PORT[,...]", callback=_parse_rpc,
                     help="Put the model's layers on llama.cpp RPC workers (`edgespec rpc-worker` or "
                          "llama.cpp's rpc-server; all layers unless --n-gpu-layers says how many).  Needs "
                          "llama-cpp-python built with CMAKE_ARGS=\"-DGGML_RPC=on\".")(f)
    f = click.option("--kernels", type=click.Choice(("auto", "exact", "fast")), default=None,
                     show_default=f"${KERNELS_ENV}, else auto",      # None: edgespec.run.kernels reads it
                     help="auto = exact where an app's mix costs no more with it than with fast on this machine, else "
                          "fast (timed once per model and thread count, cached; fast until timed); the default "
                          "comes from $EDGESPEC_KERNELS when set.  "
                          "exact = llama.cpp settings under which a verification batch gives logits bit-identical "
                          "to one-token decoding (flash attention on, see --cache-type-k), so greedy output is "
                          "token-identical to --drafter none.  fast = llama.cpp's fastest CPU settings (flash "
                          "attention off, q8_0 K cache, tiled K-quant product on): on llama and qwen models past a few hundred tokens of "
                          "context plain decoding is up to 1.5x faster and verification batches 2-3x cheaper, "
                          "but batched logits differ in the last bits, so greedy output can leave --drafter "
                          "none's at near-ties (the self-check then says not exact).")(f)
    f = click.option("--cache-type-k", type=click.Choice(("auto", "f16", "q8_0")), default=DEFAULTS.cache_type_k,
                     show_default=True,
                     help="K cache type. auto = q8_0 on CPU with 2+ threads (every decode uses every thread and stays "
                          "exact) or with --kernels fast (faster prefill), else f16. f16 on CPU is llama.cpp's "
                          "default cache; edgespec then decodes single tokens past 256 cells on one thread to stay "
                          "exact (slower).")(f)
    f = click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=DEFAULTS.n_threads,
                     help="CPU threads for llama.cpp (default: one per physical core available).")(f)
    f = click.option("-ngl", "--n-gpu-layers", type=int, default=DEFAULTS.n_gpu_layers, show_default=True,
                     help="Layers to offload to the GPU (-1 = all); needs a llama-cpp-python built with a GPU "
                          "backend (README, GPU).")(f)
    f = click.option("-c", "--ctx", "n_ctx", type=click.IntRange(min=MIN_CTX), default=DEFAULTS.n_ctx, show_default=True,
                     help=f"Context size in tokens (prompt + answer); at least {MIN_CTX}, rounded up to a "
                          f"multiple of {MIN_CTX} (llama.cpp's KV cache holds a multiple of {MIN_CTX} cells).")(f)
    return f


def memory_options(f):
    """--memory FILE and --no-memory (SpecModel's memory=: docs/memory.md)."""
    f = click.option("--no-memory", is_flag=True,
                     help="No memory of earlier requests (by default the answers of this process's earlier "
                          "requests are drafted from).")(f)
    return click.option("--memory", "memory_file", type=click.Path(dir_okay=False), default=None,
                        help="Keep the memory of earlier requests (their answers: the user's text) in FILE "
                             "too, so later runs draft from it (mode 0600; see docs/memory.md).")(f)


RUN_OPTIONS = ("drafter", "corpora", "verify", "n_ctx", "n_gpu_layers", "n_threads", "cache_type_k", "kernels",
               "max_nodes", "prompt_cache_mib", "rpc", "tensor_split", "rpc_output")
"""The options named as RunConfig's fields (run/settings.py)."""


def run_config(**settings) -> RunConfig:
    """RunConfig.defaults() with `settings` and this invocation's --verbose."""
    with user_errors():
        return RunConfig.defaults().but(verbose=log_settings()["verbose"], **settings)


def run_config_options(f):
    """Hand the command `config`: the RunConfig its run options make (those
    of RUN_OPTIONS it has, --no-gate and --memory / --no-memory where it has
    them, --verbose), in place of them.  The decorator nearest the function."""
    @functools.wraps(f)
    def command(*args, **kw):
        settings = {k: kw.pop(k) for k in RUN_OPTIONS if k in kw}
        if "no_gate" in kw:
            settings["cost_gate"] = not kw.pop("no_gate")
        if "no_memory" in kw:
            settings["memory"] = memory_setting(kw.pop("memory_file"), kw.pop("no_memory"))
        if "no_prompt_cache_disk" in kw:
            disk_mib, off = kw.pop("prompt_cache_disk_mib"), kw.pop("no_prompt_cache_disk")
            if off and disk_mib:
                raise click.UsageError("--prompt-cache-disk-mib and --no-prompt-cache-disk contradict each other")
            if off or disk_mib is not None:
                settings["prompt_cache_disk_mib"] = 0 if off else disk_mib
        kw["config"] = run_config(**settings)
        return f(*args, **kw)
    return command


def memory_setting(memory_file, no_memory):
    """SpecModel's memory= for --memory FILE / --no-memory (True: in this process)."""
    if memory_file and no_memory:
        raise click.UsageError("--memory FILE and --no-memory contradict each other")
    return False if no_memory else (memory_file or True)


SAMPLING = REQUEST.sampling         # the request options' defaults are edgespec.core.params.Request's


def generation_options(f):
    """Drafter, sampling and engine options shared by generate, chat and serve
    (the run settings reach the command as `config`: run_config_options)."""
    opts = [
        click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=REQUEST.max_tokens,
                     show_default=True,
                     help="Most tokens to generate (per answer in chat)."),
        click.option("--drafter", type=DrafterSpec(), default=DEFAULTS.drafter, show_default=True,
                     help=f"Draft proposer: {drafters_help()}.  NAME-noX / NAME+X switch a component "
                          "off / on (auto-notrigram), NAME-nocorpus ignores --corpus, NAME@holdN holds the "
                          "batch width (docs/cli.md)."),
        click.option("--temp", "--temperature", "temperature", type=float, default=SAMPLING.temperature,
                     show_default=True, help="0 = greedy (output identical to --drafter none); > 0 samples."),
        click.option("--top-k", type=int, default=SAMPLING.top_k, show_default=True,
                     help="Sampling: keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=float, default=SAMPLING.top_p, show_default=True, help="Sampling: nucleus mass (1.0 = off)."),
        click.option("--min-p", type=float, default=SAMPLING.min_p, show_default=True,
                     help="Sampling: drop tokens below min_p x the top one (0 = off)."),
        click.option("--seed", type=int, default=None, help="Sampling seed (default: fresh randomness)."),
        click.option("--max-nodes", type=int, default=DEFAULTS.max_nodes, show_default=True,
                     help="Largest verification batch (pending token + drafts)."),
        click.option("--no-gate", is_flag=True, help="Verify every proposed node (up to --max-nodes) instead of "
                                                     "only those the cost gate expects to pay; for studies."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--prompt-cache-mib", type=click.FloatRange(min=0), default=DEFAULTS.prompt_cache_mib,
                     show_default=True,
                     help="Host memory (MiB) for the KV cells of earlier prompts' prefixes: a request starts "
                          "from the longest prefix of its prompt held there or in the live cache (0 = off; "
                          "docs/serving.md)."),
        click.option("--prompt-cache-disk-mib", type=click.FloatRange(min=0), default=None,
                     help="Disk (MiB) for prompt prefixes' KV cells kept under the cache directory, so that a "
                          "later run starts from them: a restarted server, a resumed chat (0 = off; default "
                          f"{DISK_MIB:g}, or $EDGESPEC_PROMPT_CACHE_DISK_MIB; `edgespec cache` shows and clears "
                          "them; docs/serving.md)."),
        click.option("--no-prompt-cache-disk", is_flag=True,
                     help="Keep no prompt prefixes on disk (the same as --prompt-cache-disk-mib 0)."),
        click.option("--verify", type=click.Choice(("exact", "relaxed", "entropy", "entropy_inv")), default=DEFAULTS.verify,
                     show_default=True,
                     help="exact = lossless. relaxed (ReSpec), entropy (AASD) and entropy_inv are LOSSY opt-ins "
                          "(greedy only): they also accept retrieved draft tokens the model ranks close to its own "
                          "choice, which changes the output."),
    ]
    f = memory_options(corpus_option(backend_options(run_config_options(f))))
    for o in reversed(opts):
        f = o(f)
    return f


def make_sampling(temperature, top_k, top_p, min_p, seed):
    from edgespec.core.verify import SamplingConfig

    with user_errors():
        return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
