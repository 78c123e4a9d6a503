"""Hidden states of a pass (``track_hidden``): the output head's input for every row fed, on the
fake, and KVSequence keeping them by cache position."""

from __future__ import annotations

import numpy as np
import pytest

from fake_models import hashed_logits, hidden_table
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import KVSequence
from specrun.tree import TokenTree

VOCAB = 16
HIDDEN = 8
# root ─┬─ 0 ─┬─ 2
#       │     └─ 3 ── 5
#       └─ 1 ──── 4
PARENTS = (-1, -1, 0, 0, 1, 3)
KEPT = (0, 3, 5)


def hidden_fake(**kwargs) -> FakeBackend:
    return FakeBackend(hashed_logits(VOCAB, salt=1), VOCAB, hidden_table=hidden_table(VOCAB, HIDDEN),
                       hidden_size=HIDDEN, **kwargs)


# ---- the fake ------------------------------------------------------------------------------
def test_fake_hidden_rows_are_the_table_at_each_rows_context():
    backend, table = hidden_fake(), hidden_table(VOCAB, HIDDEN)
    backend.forward([1, 2], [])
    backend.track_hidden(True)
    backend.forward([3, 4, 5], [2])
    np.testing.assert_array_equal(backend.hidden_rows([2, 0]), [table((1, 2, 3, 4, 5)), table((1, 2, 3))])
    tree = TokenTree((6, 7, 8, 9, 10, 11), PARENTS)
    backend.forward_tree([12], tree, [])
    backend.keep_path(KEPT)  # leaves the rows readable
    np.testing.assert_array_equal(backend.hidden_rows([0, 1 + 5, 1 + 4]),
                                  [table((1, 2, 3, 4, 5, 12)), table((1, 2, 3, 4, 5, 12, 6, 9, 11)),
                                   table((1, 2, 3, 4, 5, 12, 7, 10))])


def test_hidden_rows_need_tracking_in_the_last_pass_and_rows_it_fed():
    backend = hidden_fake()
    backend.track_hidden(True)
    backend.forward([1, 2, 3], [])
    with pytest.raises(ValueError, match="outside the 3 rows"):
        backend.hidden_rows([3])
    backend.track_hidden(False)
    assert backend.hidden_rows([2]).shape == (1, HIDDEN)  # the last pass was tracked
    backend.forward([4], [0])
    with pytest.raises(ValueError, match="tracking off"):
        backend.hidden_rows([0])


def test_tracking_without_support_names_why():
    backend = FakeBackend(hashed_logits(VOCAB, salt=1), VOCAB)
    assert not backend.hidden_support.available
    with pytest.raises(ValueError, match="no hidden table"):
        backend.track_hidden(True)
    with pytest.raises(ValueError, match="fake gives no hidden states: this fake backend has no hidden table"):
        KVSequence(backend).track_hidden(True)


# ---- KVSequence ------------------------------------------------------------------------------
def test_sequence_keeps_states_by_position_and_drops_them_on_rewind():
    sequence, table = KVSequence(hidden_fake()), hidden_table(VOCAB, HIDDEN)
    sequence.feed([1, 2])  # fed while tracking is off: unknown
    sequence.track_hidden(True)
    sequence.feed([3, 4, 5, 6], [3])
    assert sequence.hidden(0, 3) is None and sequence.hidden(1, 2) is None
    np.testing.assert_array_equal(sequence.hidden(2, 6), [table((1, 2, 3)), table((1, 2, 3, 4)),
                                                          table((1, 2, 3, 4, 5)), table((1, 2, 3, 4, 5, 6))])
    assert sequence.hidden(2, 7) is None  # not cached
    assert sequence.hidden(4, 4).shape == (0, HIDDEN)
    sequence.rewind(4)
    assert sequence.hidden(2, 5) is None  # dropped
    sequence.track_hidden(False)
    sequence.feed([7])  # position 4 again, fed untracked: unknown, never the old state
    sequence.track_hidden(True)
    sequence.feed([8], [0])
    assert sequence.hidden(4, 5) is None
    np.testing.assert_array_equal(sequence.hidden(2, 4), [table((1, 2, 3)), table((1, 2, 3, 4))])
    np.testing.assert_array_equal(sequence.hidden(5, 6), [table((1, 2, 3, 4, 7, 8))])


def test_sequence_keep_path_stores_the_kept_nodes_at_their_positions():
    sequence, table = KVSequence(hidden_fake()), hidden_table(VOCAB, HIDDEN)
    sequence.track_hidden(True)
    sequence.feed([1, 2, 3])
    tree = TokenTree((6, 7, 8, 9, 10, 11), PARENTS)
    sequence.feed_tree([4, 5], tree, [1, 2 + 5])
    sequence.keep_path(tree, KEPT)
    assert sequence.tokens == [1, 2, 3, 4, 5, 6, 9, 11]
    expected = [table(tuple(sequence.tokens[: position + 1])) for position in range(len(sequence))]
    np.testing.assert_array_equal(sequence.hidden(0, len(sequence)), expected)
    sequence.feed_tree_argmax([12], tree, [0])
    sequence.keep_path(tree, ())  # nothing kept: the token fed before the tree only
    np.testing.assert_array_equal(sequence.hidden(8, 9), [table((*sequence.tokens[:8], 12))])


def test_sequence_refuses_greedy_feeds_while_tracking():
    sequence = KVSequence(hidden_fake())
    sequence.track_hidden(True)
    for feed in (sequence.feed_greedy, sequence.feed_greedy_deferred):
        with pytest.raises(ValueError, match="while tracking"):
            feed([1], 2)
    with pytest.raises(ValueError, match="while tracking"):
        sequence.feed_argmax_after([1], None)
    assert len(sequence) == 0
