"""`edgespec generate`: one answer to one prompt, streamed, with --stats or --json.

What the command runs with no options is RunConfig.defaults() (run/settings.py)
and the request value's defaults (core/params.py's Request); the bench's
method `default` reads the same (bench/methods.py's resolve_default).
"""
from __future__ import annotations

import json
import sys

import click

from edgespec.app.cli.loading import load_model, with_chat_template
from edgespec.app.cli.options import (complete_model, generation_options, make_sampling, model_options,
                                      user_errors)
from edgespec.app.cli.output import echo_stream, exactness_notice, json_default, stats_lines


@click.command()
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
def generate(args, max_tokens, temperature, top_k, top_p, min_p, seed, stop, config, raw, stats, as_json,
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
        model_path = with_chat_template(model_path, "use --raw to send the prompt as plain text")
    model = load_model(model_path, config.but(calibrate=True))
    notice = exactness_notice(model)
    if notice and not as_json:
        click.echo(click.style(notice, fg="bright_black"), err=True)
    try:
        with user_errors():
            result = model.generate(prompt, max_tokens=max_tokens, sampling=sampling, stop=list(stop), raw=raw,
                                    on_text=None if as_json else echo_stream, **constraint)
        if as_json:
            d = result.to_dict()
            d["model"] = model.model_path
            d["max_tokens"] = max_tokens
            d["cost_gate"] = config.cost_gate
            d["corpora"] = list(config.corpora)
            d["exact"] = model.exact
            d["calibration"] = model.calibration_state
            if model.exactness is not None and not model.exactness.exact:
                d["exactness"] = model.exactness.to_json()
            click.echo(json.dumps(d, default=json_default))
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
