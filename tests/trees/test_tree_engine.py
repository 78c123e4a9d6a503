"""Token trees through the engine: one target pass per tree, the accepted path kept, and the
output exactly plain decoding's (greedy) or distributed as the target's own (sampled, through
the lossless harness's tree scenarios)."""

from __future__ import annotations

import numpy as np
import pytest

import specrun.engine.passes
from fake_models import hashed_logits
from lossless_harness import SCENARIOS, greedy_scenario, run_scenario
from model_factory import open_exact_copies
from specrun.backends.fake import FakeBackend
from specrun.drafters.base import Drafter, Proposal
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.drafters.ngram import NgramPoolDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sampling import SamplingSettings

VOCAB = 512


class SiblingDrafter(Drafter):
    """Proposes a tree whose first branch is one wrong token and whose second branch is a
    draft model's chain: what the target accepts is never the first branch, so every accepted
    path is one that ``keep_path`` must move into place.

    With the draft model a copy of the target, its chain c is the target's greedy continuation;
    the tree is c0 + 1, then c0 → c1 → c2 …: nodes 1 onwards hold c.
    """

    name = "siblings"

    def __init__(self, inner: DraftModelDrafter, vocab_size: int) -> None:
        self.inner, self.vocab_size = inner, vocab_size

    def propose(self, context, draft_len, sampling, rng) -> Proposal:
        chain = self.inner.propose(context, draft_len, sampling, rng).tokens
        if not chain:
            return Proposal()
        wrong = (chain[0] + 1) % self.vocab_size
        return Proposal((wrong, *chain), source=self.name, parents=(-1, -1, *range(1, len(chain))))

    def bind(self, target, clock) -> None:
        self.inner.bind(target, clock)

    def prefill(self, context) -> None:
        self.inner.prefill(context)

    def finish(self, context) -> None:
        self.inner.finish(context)

    def close(self) -> None:
        self.inner.close()


class TreeRecorder:
    """Counts the engine's tree verdicts and the nodes of their accepted paths (monkeypatched)."""

    def __init__(self, monkeypatch) -> None:
        self.paths: list[tuple[int, ...]] = []
        for name in ("verify_tree_greedy", "verify_tree_sampled"):
            inner = getattr(specrun.engine.passes, name)
            monkeypatch.setattr(specrun.engine.passes, name, self._wrap(inner))

    def _wrap(self, inner):
        def verify(*args):
            verdict = inner(*args)
            self.paths.append(verdict.path)
            return verdict

        return verify


def plain_and_tree_outputs(target, draft, plain_target, prompt, new_tokens=40):
    engine = SpeculativeEngine(target, SiblingDrafter(DraftModelDrafter(draft), target.vocab.size), "siblings")
    params = GenerationParams(new_tokens, draft_len=4, stop_at_eos=False)
    tree = engine.run(prompt, params)
    plain = SpeculativeEngine(plain_target).run(prompt, GenerationParams(new_tokens, draft_len=0, stop_at_eos=False))
    return plain.token_ids, tree


def test_the_engine_verifies_a_tree_in_one_pass_and_keeps_the_sibling_path_on_the_fake(monkeypatch):
    recorder = TreeRecorder(monkeypatch)
    table = hashed_logits(VOCAB, salt=3)
    plain, tree = plain_and_tree_outputs(FakeBackend(table, VOCAB), FakeBackend(table, VOCAB),
                                         FakeBackend(table, VOCAB), [1, 2, 3, 4])
    assert tree.token_ids == plain
    assert recorder.paths and all(path[:1] == (1,) for path in recorder.paths)  # the second branch, each time
    assert tree.stats.accepted >= 3 * len(recorder.paths)  # c0 c1 c2 … accepted, not the first branch
    assert tree.stats.steps < len(plain) / 2  # several tokens per pass


@pytest.mark.parametrize("kind", ["llama", "mlx"])
def test_greedy_trees_on_the_real_backends_equal_plain_decoding(monkeypatch, tiny_models, kind):
    """llama.cpp (F32 weights and cache, flash attention off: exact) and MLX on a tiny model:
    the tree passes' output is plain decoding's, token for token."""
    recorder = TreeRecorder(monkeypatch)
    target, draft, reference = open_exact_copies(tiny_models["llama"], kind, 3)
    try:
        assert target.tree_support.available, target.tree_support.reason
        for prompt in ([1, 2, 3, 4, 5], [40, 41, 42]):
            plain, tree = plain_and_tree_outputs(target, draft, reference, prompt)
            assert tree.token_ids == plain
        assert recorder.paths and all(path[:1] == (1,) for path in recorder.paths)
    finally:
        for backend in (target, draft, reference):
            backend.close()


def test_a_target_without_trees_verifies_the_first_branch_as_a_chain(monkeypatch, tiny_llama):
    """llama.cpp opened without tree_paths cannot hold a tree: the engine verifies the
    proposal's first chain instead, and the output is still plain decoding's."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend

    recorder = TreeRecorder(monkeypatch)
    backends = [LlamaCppBackend(tiny_llama.gguf_f32_path, n_ctx=256, kv_type="f32", flash_attn=False) for _ in range(3)]
    try:
        assert not backends[0].tree_support.available
        plain, chained = plain_and_tree_outputs(*backends, [1, 2, 3, 4, 5])
        assert chained.token_ids == plain
        assert recorder.paths == []  # no tree pass
        assert chained.stats.drafted > 0 and chained.stats.accepted == 0  # the wrong first branch, rejected
    finally:
        for backend in backends:
            backend.close()


def test_the_ngram_pool_proposes_its_runner_up_as_a_sibling_with_its_own_followers():
    pool = NgramPoolDrafter(branches=2)
    context = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]  # after 1 2: 3 (3x), 4 (2x)
    proposal = pool.propose(context, 3, SamplingSettings(), np.random.default_rng(0))
    assert proposal.main_chain.tokens == (3, 9, 1)
    # a sibling of the chain's first token, then what follows 1 2 4 (9, then 1): as deep as the chain
    assert proposal.tokens[3:] == (4, 9, 1) and proposal.parents[3:] == (-1, 3, 4)
    assert proposal.tree.children_of(-1) == (0, 3)
    chains_only = NgramPoolDrafter().propose(context, 3, SamplingSettings(), np.random.default_rng(0))
    assert chains_only.is_chain and chains_only.tokens == (3, 9, 1)


def test_the_ngram_pool_offers_every_trusted_follower_likeliest_first_within_its_branches():
    context = [7, 1, 5, 7, 1, 5, 7, 1, 6, 7, 1, 6, 7, 1, 8, 7, 1, 8, 3, 7, 1]  # after 7 1: 5, 6, 8 twice each
    three = NgramPoolDrafter(branches=3, min_share=0.3).propose(context, 1, SamplingSettings(),
                                                                 np.random.default_rng(0))
    assert three.tokens == (5, 6, 8) and three.parents == (-1, -1, -1)  # ties in the order first seen
    one = NgramPoolDrafter(branches=1, min_share=0.3).propose(context, 1, SamplingSettings(), np.random.default_rng(0))
    assert one.tokens == (5, 6)


def test_greedy_ngram_trees_equal_plain_decoding_and_accept_siblings(monkeypatch):
    recorder = TreeRecorder(monkeypatch)
    problems, drafted, accepted = greedy_scenario("ngram", branches=3)
    assert problems == []
    assert 0 < accepted < drafted
    siblings_taken = sum(1 for path in recorder.paths if path != tuple(range(len(path))))
    assert recorder.paths and siblings_taken > 0, recorder.paths[:20]


@pytest.mark.parametrize("name", [name for name, scenario in SCENARIOS.items() if scenario.branches])
def test_sampled_tree_scenarios_verify_trees(monkeypatch, name):
    """The harness's tree scenarios (chi-square and acceptance checks in test_acceptance, the MTP
    tree's in test_mtp_sampling) do
    verify trees, and take siblings."""
    recorder = TreeRecorder(monkeypatch)
    _, problems = run_scenario(name, runs=300)
    assert problems == []
    assert sum(1 for path in recorder.paths if path != tuple(range(len(path)))) > 0
