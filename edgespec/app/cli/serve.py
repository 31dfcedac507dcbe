"""`edgespec serve`: the OpenAI-compatible HTTP server, and its guard options.

The options are turned into the server's request defaults, limits and
browser rules here; the server itself is edgespec/app/server.py.
"""
from __future__ import annotations

import os

import click

from edgespec.app.cli.loading import load_model
from edgespec.app.cli.options import complete_model, generation_options, make_sampling, model_options
from edgespec.app.cli.output import calibration_line, exactness_notice


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
        click.option("--fim-suffix-tokens", type=click.IntRange(min=0), default=None,
                     help="Read at most this many tokens of a fill-in-the-middle request's suffix (/infill, "
                          "suffix on /v1/completions) [default: 128]: each new cursor line reads them again."),
        click.option("--fim-prefix-tokens", type=click.IntRange(min=0), default=None,
                     help="Read at most this many tokens of a fill-in-the-middle request's prefix, from an "
                          "anchor line that stays first while the person types [default: as the context "
                          "allows]; llama-server reads 768 with its FIM preset."),
        click.option("--fim-layout", type=click.Choice(["psm", "mid"]), default="psm", show_default=True,
                     help="Where /infill's `prompt` (the text typed on the cursor's line) goes: psm ends the "
                          "prefix with it (llama-server's layout); mid puts it after the middle token (a "
                          "keystroke reads only itself, but suggestions continue half-typed words worse)."),
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


@click.command()
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
              help="Requests that may wait while the running ones run; more get 503 with Retry-After.")
@click.option("--parallel", "parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests run at once (llama-server's -np): slots of --ctx tokens each in one context, "
                   "stepped in turn (docs/scheduler.md).")
@click.option("--model-id", default=None, help="The model's name in /v1/models (default: the file's name "
                                               "without .gguf).")
@click.option("--no-cache-prompt", "cache_prompt", is_flag=True, flag_value=False, default=True,
              help="Prefill every prompt whole unless its request says cache_prompt: true (by default every "
                   "request reuses the longest prefix the model holds; docs/serving.md).")
@click.option("--cache-reuse", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="INEXACT, opt-in (llama-server's --cache-reuse): /infill, /completion and /v1/completions "
                   "also keep the cached cells of a chunk of at least N tokens after an edit (at an editor's "
                   "cursor: the suffix), shifted to their new positions, and read only the edited text and the "
                   "prompt's end.  Answers may then differ from exact decoding's (their timings.cache_shifted_n "
                   "> 0); a request's n_cache_reuse overrides it; chat stays exact.  0: exact reuse only.")
@serve_guard_options
def serve(model, max_tokens, temperature, top_k, top_p, min_p, seed, stop, config, host, port, api_key, max_queue,
          parallel, model_id, cache_prompt, cache_reuse, api_key_file, allow_host, cors, **limits):
    """Serve MODEL over an OpenAI-compatible HTTP API, with a chat page at /.

    POST /v1/chat/completions and /v1/completions (streamed or not), GET
    /v1/models, /health, /props and /metrics (Prometheus).  The generation
    options are the defaults of requests that leave them out; a request
    without max_tokens runs to the end of its turn or a full context unless
    --max-tokens is given.  --parallel requests run at once (default one);
    the others wait in a queue of --queue requests.  SIGTERM (or Ctrl-C) answers the queue with
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
        from edgespec.app.request_fields import SERVE_DEFAULTS, Limits
    except ImportError as e:
        raise click.ClickException(f"serve needs {e.name}: pip install 'edgespec[serve]'") from None
    sampling = make_sampling(temperature, top_k, top_p, min_p, seed)      # a bad value fails before the model loads
    m = load_model(model, config.but(calibrate="background", parallel=parallel))
    if cache_reuse and m.backend.splice_refusal() is not None:
        m.close()
        raise click.ClickException(f"--cache-reuse cannot run with this model: {m.backend.splice_refusal()}")
    notice = exactness_notice(m)
    if notice:
        click.echo(notice, err=True)
    if cache_reuse:
        click.echo(f"--cache-reuse {cache_reuse}: completions may reuse shifted cells, and then their answers may "
                   "differ from exact decoding's (timings.cache_shifted_n > 0)", err=True)
    if m.calibration_state == "measuring":
        click.echo(calibration_line(m), err=True)
    name = model_id or os.path.basename(m.model_path).removesuffix(".gguf")
    # the server's defaults (SERVE_DEFAULTS) with the options given; without
    # --max-tokens a request that leaves max_tokens out runs to the end of its
    # turn or a full context (OpenAI's and llama-server's meaning)
    if click.get_current_context().get_parameter_source("max_tokens") == click.core.ParameterSource.DEFAULT:
        max_tokens = SERVE_DEFAULTS.max_tokens
    defaults = SERVE_DEFAULTS.but(max_tokens=max_tokens, sampling=sampling, stop=tuple(stop),
                                  drafter=config.drafter, reuse_prefix=cache_prompt, cache_reuse=cache_reuse)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach it may use it", err=True)
    click.echo(f"edgespec serve: {name} (drafter {config.drafter}) on http://{host}:{port}/  (chat page at /, "
               f"API at /v1)", err=True)
    try:
        S.serve(m, host=host, port=port, model_id=name, api_key=api_key, max_queue=max_queue, defaults=defaults,
                log_level="warning", limits=Limits(**limits), allow_hosts=allow_host, cors=cors)
    finally:
        m.close()
