"""llama.cpp's reasoning budget on the real backends (specrun/reasoning_budget.py).

The looping tiny model (tests/conftest.py) as target, its prompt's last token taken for the start
tag with the rule reading from there (as a generation prompt that opens the thinking): plain
decoding under the rule is free decoding until the budget is spent and the character the last
token left unfinished is whole (the model's own pieces, ``incomplete_tokens_of``: here several
byte tokens in a row), then says the forced sequence; speculation under it (prompt lookup, a
draft model forcing its own rows) makes plain decoding's text on both backends. llama-cpp-python
does not expose llama.cpp's reasoning-budget sampler (it lives in llama.cpp's common library), so
the rule itself is proven against a transcription of it (tests/engine/test_reasoning_budget.py).
"""

from __future__ import annotations

import pytest

from specrun.reasoning_budget import ReasoningBudget, incomplete_tokens_of
from specrun.sampling import SamplingSettings
from test_penalties_real import PROMPT, _open, _run

BUDGET = 5
N_TOKENS = 128  # the looping model falls into a cycle lookup catches after ~90 tokens


def _rule(target, prompt: list[int]) -> ReasoningBudget:
    end = tuple(target.tokenize("</think>", add_bos=False))
    return ReasoningBudget(starts=((prompt[-1],),), ends=(end,),
                           forced=(*target.tokenize(" enough.", add_bos=False), *end),
                           budget=BUDGET, start_at=len(prompt) - 1, incomplete=incomplete_tokens_of(target))


@pytest.mark.parametrize("kind", ["llama", "mlx"])
@pytest.mark.parametrize("method", ["lookup", "draft"])
def test_speculation_under_a_reasoning_budget_makes_plain_decoding_s_text(looping_llama, kind, method):
    target = _open(kind, looping_llama[kind])
    draft = _open(kind, looping_llama[kind]) if method == "draft" else None
    try:
        prompt = target.tokenize(PROMPT)
        rule = _rule(target, prompt)
        sampling = SamplingSettings(reasoning_budget=rule)
        plain, _ = _run(target, None, "none", prompt, sampling, N_TOKENS)
        spoken, accepted = _run(target, draft, method, prompt, sampling, N_TOKENS)
        free, _ = _run(target, None, "none", prompt, SamplingSettings(), N_TOKENS)
    finally:
        target.close()
        if draft is not None:
            draft.close()
    assert spoken == plain
    assert accepted > 0
    # the budget spent at token BUDGET, then waiting for a whole character: forced after it
    whole = next(at for at in range(BUDGET - 1, len(free)) if free[at] not in rule.incomplete)
    assert whole > BUDGET - 1  # the tiny vocabulary's byte tokens made it wait
    forced_at = whole + 1
    assert plain[:forced_at] == free[:forced_at]
    assert tuple(plain[forced_at : forced_at + len(rule.forced)]) == rule.forced
    assert rule.forced[0] != free[forced_at]
