"""`edgespec models`: the GGUF models on this machine and the names that run them."""
from __future__ import annotations

import json
import os

import click


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line, with each file's path.")
def models_cmd(as_json):
    """List the models on this machine: Ollama's, LM Studio's, the Hugging Face
    cache's GGUFs and edgespec's benchmark models, with the name that runs each."""
    from edgespec.errors import ModelFileError
    from edgespec.models.sources import list_models
    from edgespec.models.gguf import model_summary

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
