"""The drafter registry: names, construction and the docs table come from one table."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.drafters import NAMES, make_drafter, parse_drafter_name
from edgespec.drafters.registry import REGISTRY, DrafterEntry, entry, help_text, markdown_table
from edgespec.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "drafters.md"


def test_docs_table_is_the_generated_one():
    text = DOCS.read_text()
    m = re.search(r"<!-- registry table: generated -->\n(.*?)\n<!-- end of registry table -->", text, re.S)
    assert m, "docs/drafters.md lost its registry table markers"
    assert m.group(1) == markdown_table(), "regenerate the table: " + markdown_table()


def test_every_entry_builds_with_what_it_takes():
    for e in REGISTRY:
        cls, config = e.load()
        d = make_drafter(e.name, n_vocab=300)
        assert type(d) is cls and d.name == e.name
        assert (config is None) == (e.config == "")
        assert e.name in help_text() and e.summary in help_text()
    assert NAMES == tuple(e.name for e in REGISTRY) and NAMES[0] == "none"


def test_registry_refuses_what_it_does_not_know():
    with pytest.raises(ConfigError, match="known drafters: none, suffix"):
        entry("draftmodel")
    with pytest.raises(ConfigError, match="needs n_vocab"):
        make_drafter("trigram")
    with pytest.raises(ConfigError, match="takes no settings"):
        make_drafter("none", max_nodes=3)
    with pytest.raises(ConfigError, match="drafter 'suffix'"):
        make_drafter("suffix", max_nodes=0)
    with pytest.raises(ValueError, match="unknown resources"):
        DrafterEntry("x", "y", "edgespec.drafters.base:Drafter", takes=("gpu",))


def test_spec_switches_are_the_config_fields():
    assert parse_drafter_name("suffix-nomemory+max_nodes=8") == ("suffix", True, {"memory": False, "max_nodes": 8})
    with pytest.raises(ConfigError, match="its switches: .*memory"):
        parse_drafter_name("suffix-notrigram")
    with pytest.raises(ValueError, match="not a numeric setting"):
        parse_drafter_name("trigram+memory=3")


def test_listing_names_imports_no_drafter_module():
    code = ("import sys; from edgespec.drafters.registry import NAMES, help_text; help_text(); "
            "print(sorted(m for m in sys.modules if m.startswith('edgespec.drafters.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)
    assert not any(m.endswith((".trigram", ".adjacency", ".hybrid")) for m in loaded), loaded


def test_plain_decoding_is_the_none_drafter_itself():
    """The engine's plain path hangs on the drafter's kind, not on its name."""
    from edgespec.drafters.base import Drafter
    from edgespec.drafters.prediction import PredictionDrafter

    class Silent(Drafter):
        name = "none"           # named like it, but a drafter of its own

    assert make_drafter("none").plain and not Silent().plain and not make_drafter("suffix").plain
    assert PredictionDrafter(make_drafter("none")).plain and not PredictionDrafter(make_drafter("suffix")).plain
