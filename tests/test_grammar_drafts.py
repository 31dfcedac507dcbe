"""Drafts under a grammar (edgespec.core.grammar_drafts): values copied from the
prompt's characters and values read after a label naming their key, cut where
the grammar rejects a token; with the model, they are accepted drafts and the
answer stays what constrained plain decoding gives."""
import numpy as np

from edgespec.core.config import EngineConfig
from edgespec.core.engine import Engine, drain
from edgespec.core.grammar_drafts import GrammarDrafts, label_end, match_ends
from edgespec.backend.grammar import Grammar, gbnf_for
from edgespec.drafters import Drafter
from edgespec.core.params import Request

PROMPT = "From: Priya Raman <priya@example.org>\nSubject: Moving the review\nOrder ID: A-17\n"


# ------------------------------------------------------------------ no model
def test_match_ends_longest_tail_latest_first():
    src = "ab Priya xPrix Priya y"
    # "Pri" ends at 6, 13 and 18; the longer tail " Pri" only at 6 and 18
    assert match_ends(src, 'name": "a Pri', 3) == [18, 6]      # tail " Pri" ("a Pri" occurs nowhere)
    assert match_ends(src, '"Pri', 3) == [18, 13, 6]           # tail "Pri" (the quote is not in src), newest first
    assert match_ends(src, '"Pri', 2) == [18, 13]
    assert match_ends(src, "xPri", 3) == [13]
    assert match_ends(src, "P", 3) == []                       # shorter than MIN_CHARS
    assert match_ends(src, "zz", 3) == []


def test_label_end_finds_the_key_in_any_spelling():
    assert PROMPT[label_end(PROMPT, "subject"):].startswith("Moving the review")
    for key in ("order_id", "orderId", "OrderID", "order-id", "Order ID"):
        assert PROMPT[label_end(PROMPT, key):].startswith("A-17"), key
    assert label_end(PROMPT, "from") == PROMPT.index("Priya")
    assert label_end(PROMPT, "view") == -1          # inside a word: not a label
    assert label_end(PROMPT, "order") == -1         # "Order ID:" is not a label of "order"
    assert label_end("Total = 17 EUR", "total") == len("Total = ")
    assert label_end(PROMPT, "") == -1


class CharVocab:
    """One token per character (id = code point)."""
    def tokenize(self, text, add_special=False):
        return np.array([ord(c) for c in text], np.int32)

    def detokenize(self, toks):
        return "".join(chr(int(t)) for t in toks)


class NoNewline:
    """A grammar that forces `forced`, and admits anything but a newline."""
    def __init__(self, forced=""):
        self.forced = forced

    def forced_text(self, history):
        return self.forced

    def admits(self, toks):
        for i, t in enumerate(toks):
            if chr(int(t)) == "\n":
                return i
        return len(toks)


def test_copied_chains_are_cut_where_the_grammar_rejects():
    gd = GrammarDrafts(NoNewline(), CharVocab(), PROMPT)
    chains = gd.copied('{"sender": "Pri', 64)
    assert [CharVocab().detokenize(c) for c in chains] == ["ya Raman <priya@example.org>"]
    assert gd.copied('{"x": "zz', 64) == []
    assert len(gd.copied('{"sender": "Pri', 4)[0]) == 4     # at most max_tokens


def test_labelled_value_follows_the_forced_key():
    gd = GrammarDrafts(NoNewline('"order_id": "'), CharVocab(), PROMPT)
    text, forced = gd.forced('{"subject": "Moving the review", ')
    assert text == '"order_id": "'
    label = gd.labelled('{"subject": "Moving the review", ' + text, forced, 64)
    assert CharVocab().detokenize(label) == "A-17"
    assert len(gd.labelled('{"price": ', forced, 64)) == 0          # no label for the key
    assert len(gd.labelled('{"order_id', forced, 64)) == 0          # the key's value is not opened yet


# --------------------------------------------------------------- with model
class Silent(Drafter):
    """Proposes nothing, but is not plain decoding: grammar drafts are drafted."""
    name = "silent"


def test_copied_and_labelled_values_are_accepted_and_change_nothing(model):
    schema = {"type": "object", "properties": {"subject": {"type": "string"}, "sender": {"type": "string"}},
              "required": ["subject", "sender"]}
    prompt = model.prompt_tokens("Order ID: A-17\nFrom: Priya Raman\nSubject: Moving the weekly review to Friday\n\n"
                                 "What are the subject and the sender of this email? Answer in JSON.")
    runs = {}
    for drafter in (Drafter(), Silent()):
        eng = Engine(model.backend, drafter, model.cost, EngineConfig(cost_gate=False))
        g = Grammar(model.vocab, gbnf_for(json_schema=schema))
        try:
            runs[drafter.name] = drain(eng.run(eng.resolve(Request(prompt, max_tokens=48, grammar=g, reuse_prefix=False))))
        finally:
            g.close()
    plain, fast = runs["none"], runs["silent"]
    assert fast.tokens == plain.tokens, (fast.text, plain.text)
    assert '"subject": "Moving the weekly review to Friday"' in plain.text, plain.text
    rows = {}
    for r in eng.acceptance.report():
        rows.setdefault(r["source"], []).append(r)
    assert "label" in rows and "grammar" in rows, rows.keys()
    assert sum(r["observed"] * r["tested"] for r in rows["label"]) >= 5     # the subject's tokens accepted
    assert fast.n_steps < plain.n_steps - 8
