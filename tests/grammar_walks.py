"""Token sequences against a compiled grammar (specrun/grammar.py), as tests ask of it."""

from __future__ import annotations

from collections.abc import Sequence


def walks(grammar, ids: Sequence[int]) -> bool:
    """Does the grammar allow these tokens one after another, each in its allowed row (as the
    engine masks rows)?"""
    state = grammar.start()
    for token in ids:
        if not state.allowed()[token]:
            return False
        state.advance([token])
    return True


def accepts(grammar, backend, ids: Sequence[int]) -> bool:
    """Does llguidance's matcher take these tokens whole and end accepting (a complete text)?"""
    import llguidance

    from specrun.grammar import Vocabulary

    matcher = llguidance.LLMatcher(Vocabulary.of(backend).tokenizer, grammar.spec.llguidance_grammar(), log_level=0)
    return matcher.consume_tokens(list(ids)) and matcher.is_accepting()
