"""The contracts between the engine and the drafters: the draft-source
registry (drafters/tree.py) and the capabilities a drafter asks for
(drafters/base.py Needs), read without getattr."""
import pytest

from edgespec.drafters import tree
from edgespec.core.grammar_drafts import SOURCE_LABEL, SOURCE_VALUE
from edgespec.core.verify import VerifyConfig
from edgespec.drafters import Drafter, make_drafter
from edgespec.drafters.base import Needs
from edgespec.drafters.mechanisms.graft_tail import TailGraft
from edgespec.drafters.prediction import PredictionDrafter


def test_registry_names_and_flags():
    names = [s.name for s in tree.SOURCES]
    assert names[:11] == ["context", "corpus", "trigram", "adjacency", "carry", "branch", "semantic", "prompt",
                          "align", "grammar", "edit"]        # ids stored in results files: fixed
    assert [s.id for s in tree.SOURCES] == list(range(len(names)))
    assert set(tree.sources_with("aligned")) == {tree.SOURCE_PROMPT, tree.SOURCE_ALIGN}
    assert {SOURCE_VALUE, SOURCE_LABEL, tree.SOURCE_CONTEXT, tree.SOURCE_EDIT} <= set(tree.sources_with("retrieved"))
    assert tree.SOURCE_GRAMMAR not in tree.sources_with("retrieved")
    assert tree.source_name(SOURCE_VALUE) == "value" and tree.source_name(31) == "source31"
    with pytest.raises(ValueError, match="already registered"):
        tree.register_source("context")


def test_a_new_source_reaches_every_mechanism_that_reads_its_flags():
    n = len(tree.SOURCES)
    try:
        sid = tree.register_source("test-guess", guess=True, retrieved=True)
        assert sid == n and tree.source_name(sid) == "test-guess"
        assert sid in VerifyConfig("relaxed").relax_sources         # ReSpec relaxes retrieved text
        assert TailGraft(8)._from[sid]                                # graft_tail continues from guesses
        assert sid not in VerifyConfig("entropy").relax_sources
    finally:
        del tree.SOURCES[n:]


def test_needs_of_the_drafters():
    assert Drafter().needs() == Needs()
    adj = make_drafter("adjacency", n_vocab=64)
    assert adj.needs().topk == 8 and adj.needs().observe
    auto = make_drafter("auto", n_vocab=64, trigger=True, entropy=False)
    n = auto.needs()
    assert n.entropy and n.observe and not n.hidden and n.hidden_layer is None


def test_prediction_wrapper_asks_what_its_drafter_asks():
    inner = make_drafter("auto", n_vocab=64, trigger=True)
    assert PredictionDrafter(inner).needs() == inner.needs()
    assert PredictionDrafter(Drafter()).needs() == Needs()


def test_a_prediction_given_to_a_plain_drafter_fails_loudly():
    with pytest.raises(TypeError, match="takes no prediction"):
        make_drafter("suffix").set_prediction([1, 2, 3])
    PredictionDrafter(Drafter()).set_prediction([1, 2, 3])
