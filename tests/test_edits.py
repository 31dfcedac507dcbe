"""Copy alignment with learned edits (kernels/edits.py) on hand-written arrays,
and the suffix drafter's use of it."""
import numpy as np

from edgespec.drafters import make_drafter
from edgespec.kernels import edits as E

# a prompt in which token 5 (an identifier) occurs three times
PROMPT = [10, 11, 12, 5, 13, 14, 15, 5, 16, 17, 18, 5, 19, 20]
NP = len(PROMPT)


def _run(answer, max_depth=16, gap=8, anchor=3, state=None, edits=None, min_trust=0.0):
    ctx = np.array(PROMPT + answer, np.int32)
    state = np.zeros(E.STATE_SIZE, np.int64) if state is None else state
    edits = np.zeros((8, E.EDIT_COLS), np.int64) if edits is None else edits
    ne = E.align(ctx, len(ctx), NP, state, edits, gap, anchor)
    tok = np.zeros(max_depth, np.int32)
    p = np.zeros(max_depth, np.float32)
    m, applied, first = E.edited_chain(ctx, len(ctx), NP, state, edits, max_depth, min_trust, tok, p)
    assert applied <= m and 0 <= first <= m
    return ne, state, edits, tok[:m].tolist(), p[:m]


def test_a_rename_seen_once_is_applied_to_the_rest_of_the_copy():
    ne, state, edits, chain, p = _run([10, 11, 12, 7, 13, 14, 15])
    assert ne == 1
    assert edits[0].tolist() == [3, 1, NP + 3, 1, 1, 0]    # prompt's 5 at 3 -> answer's 7, made once
    assert chain == [7, 16, 17, 18, 7, 19, 20]
    # scores rise with the aligned run; an edited token's is discounted by
    # its edit's trust, (1 + 1) / (1 + 0 + 2) after one sighting
    run = 3                                                # aligned since the edit
    conf = np.array([(run + j + 1) / (run + j + 3) for j in range(len(chain))])
    trust = np.where(np.arange(len(chain)) % 4 == 0, 2 / 3, 1.0)
    assert np.allclose(p, conf * trust, atol=1e-6)


def test_an_edit_the_answer_leaves_out_loses_trust():
    ne, _, edits, chain, p = _run([10, 11, 12, 7, 13, 14, 15, 5, 16, 17, 18])
    assert ne == 1 and edits[0, 4:].tolist() == [1, 1]      # made once, left out once
    assert chain == [7, 19, 20]
    run = 7                                                # aligned since the edit
    assert abs(p[0] - (run + 1) / (run + 3) * 0.5) < 1e-6
    # below the drafter's trust threshold the edit is no longer applied
    _, _, _, chain, _ = _run([10, 11, 12, 7, 13, 14, 15, 5, 16, 17, 18], min_trust=0.6)
    assert chain == [5, 19, 20]


def test_a_divergence_the_answer_cannot_resolve_yet_waits():
    ne, state, _, chain, _ = _run([10, 11, 12, 7, 13])
    assert ne == 0 and chain == []
    assert state[0] == NP + 3                              # resumes at the divergence
    # the answer grows: the same state resolves it
    ctx_more = [10, 11, 12, 7, 13, 14, 15]
    ne, state, _, chain, _ = _run(ctx_more, state=state, edits=np.zeros((8, E.EDIT_COLS), np.int64))
    assert ne == 1 and chain[0] == 7


def test_a_known_edit_is_crossed_at_once():
    ne, state, _, chain, _ = _run([10, 11, 12, 7, 13, 14, 15, 7])
    assert ne == 1                                         # not recorded twice
    assert state[0] == NP + 8 and state[1] == 8
    assert chain == [16, 17, 18, 7, 19, 20]


def test_an_insertion_is_followed_but_not_recorded():
    # the answer inserts 99 after 12: nothing in the prompt to key it on
    ne, state, _, chain, _ = _run([10, 11, 12, 99, 5, 13, 14])
    assert ne == 0
    assert state[0] == NP + 7 and state[1] == 6
    assert chain[:3] == [15, 5, 16]


def test_an_answer_that_leaves_the_prompt_gives_no_chain():
    ne, state, _, chain, _ = _run([10, 11, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52])
    assert chain == []
    assert state[1] == -1


def test_the_chain_stops_at_max_depth_and_the_prompt_end():
    _, _, _, chain, _ = _run([10, 11, 12, 7, 13, 14, 15], max_depth=3)
    assert chain == [7, 16, 17]
    _, _, _, chain, _ = _run(PROMPT[:-1])                  # aligned up to the last token
    assert chain == [20]


def test_the_suffix_drafter_proposes_the_edited_copy_first():
    answer = [10, 11, 12, 7, 13, 14, 15]
    ctx = np.array(PROMPT + answer, np.int32)
    d = make_drafter("suffix", max_depth=8, edits=True)     # the plug-in, through the registry
    d.begin(np.array(PROMPT, np.int32))
    t = d.propose(ctx, 32)
    top = [int(t.tokens[0])]
    node = 0
    while True:                 # follow the first child (nodes come likeliest first)
        ch = [j for j in range(len(t)) if t.parents[j] == node]
        if not ch:
            break
        node = ch[0]
        top.append(int(t.tokens[node]))
    assert top[:5] == [7, 16, 17, 18, 7]
    # without edits the plain copy proposes the prompt's own token 5 there
    d0 = make_drafter("suffix", max_depth=8, edits=False)
    d0.begin(np.array(PROMPT, np.int32))
    t0 = d0.propose(ctx, 32)
    assert 7 not in t0.tokens[:1].tolist()
    assert 5 in t0.tokens.tolist()
