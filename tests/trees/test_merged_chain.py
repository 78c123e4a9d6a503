"""Chains of drafters merged into one token tree (issue 28, item 4): the cheap proposals a chain
passed over for the draft model's are verified in the same pass as it (AdaptivePolicy._merged).

The merge itself (shared prefixes, siblings in order, rows given what came before, budgets,
credit), the policy's use of it, exactness under sampling, and greedy output equal to plain
decoding on the fake, llama.cpp and MLX backends."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specrun.drafters.chain
from specrun.engine.passes import TargetPasses
from fake_models import CostedFake, SimClock, hashed_logits
from lossless_harness import merged_row_problems, real_scenario, run_scenario, selected_row_problems
from model_factory import open_exact_copies, perturbed_copy
from specrun.backends.fake import FakeBackend
from specrun.control.policy import AdaptivePolicy, Plan, StepReport
from specrun.control.trees import BranchRates, merged_values, node_values, select_merged
from specrun.drafters.base import Drafter, Proposal
from specrun.drafters.chain import ChainDrafter, MergedProposal, merge_proposals
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sampling import SamplingSettings
from specrun.tree import TokenTree
from specrun.verify import verify_tree_sampled

VOCAB = 512


# ---- the merge -----------------------------------------------------------------------------
def test_shared_prefixes_become_one_path_and_other_tokens_siblings_in_order():
    draft = Proposal((5, 6, 7), source="draft")
    lookup = Proposal((5, 6, 9), source="lookup")
    ngram = Proposal((4, 8), source="ngram")
    merged = merge_proposals([draft, lookup, ngram])
    assert merged.tokens == (5, 6, 7, 9, 4, 8)
    assert merged.parents == (-1, 0, 1, 1, -1, 4)
    assert merged.tree.children_of(1) == (2, 3)  # the draft's 7 first, lookup's 9 its alternative
    assert merged.tree.children_of(-1) == (0, 4)
    assert merged.part_nodes == ((0, 1, 2), (0, 1, 3), (4, 5))
    assert merged.owners == ((0, 0), (0, 1), (0, 2), (1, 2), (2, 0), (2, 1))  # 5 and 6: the draft's
    assert merged.source == "draft+lookup+ngram"
    assert all(parent < node for node, parent in enumerate(merged.parents))


def test_a_proposal_inside_another_adds_no_node():
    merged = merge_proposals([Proposal((5, 6, 7), source="draft"), Proposal((5, 6), source="lookup")])
    assert merged.tokens == (5, 6, 7) and merged.is_chain
    assert merged.part_nodes == ((0, 1, 2), (0, 1))


def test_branching_parts_merge_node_by_node():
    draft = Proposal((5, 6, 8), source="draft", parents=(-1, 0, -1))  # 8: a second guess for 5
    lookup = Proposal((8, 3, 6, 1), source="lookup", parents=(-1, 0, -1, 2))  # 8 3, and 6 1
    merged = merge_proposals([draft, lookup])
    assert merged.tokens == (5, 6, 8, 3, 6, 1)
    assert merged.parents == (-1, 0, -1, 2, -1, 4)  # lookup's 8 is the draft's 8; its 6 a root child
    assert merged.part_nodes == ((0, 1, 2), (2, 3, 4, 5))


def test_rows_keep_the_first_proposers_and_a_drawn_node_after_siblings_loses_their_tokens():
    q_first = np.array([0.1, 0.2, 0.3, 0.4])
    q_second = np.array([0.25, 0.25, 0.25, 0.25])
    lookup = Proposal((1, 2), source="lookup")  # one-hot: rows None
    draft = Proposal((3, 0), (q_first, q_second), source="draft")
    merged = merge_proposals([lookup, draft])
    assert merged.tokens == (1, 2, 3, 0) and merged.parents == (-1, 0, -1, 2)
    assert merged.p_draft[:2] == (None, None)
    np.testing.assert_allclose(merged.p_draft[2], [0.1 / 0.8, 0.0, 0.3 / 0.8, 0.4 / 0.8])  # without lookup's 1
    np.testing.assert_allclose(merged.p_draft[3], q_second)  # no sibling before it: as drawn
    shared = merge_proposals([lookup, Proposal((1, 0), (q_first, q_second), source="draft")])
    assert shared.tokens == (1, 2, 0) and shared.p_draft[0] is None  # the 1 is lookup's node
    np.testing.assert_allclose(shared.p_draft[2], [1 / 3, 1 / 3, 0.0, 1 / 3])  # without lookup's 2
    first = merge_proposals([draft, lookup])  # the draft first: no row changes
    assert first.p_draft[0] is q_first and first.p_draft[2] is None


def test_a_drawn_sibling_is_conditioned_on_every_sibling_before_it_drawn_or_not():
    """Heads and a draft model both sampling under auto (lossless_harness.merged_row_problems)."""
    assert merged_row_problems() == []


def test_select_keeps_each_node_with_its_own_row():
    assert selected_row_problems() == []
    rows = (np.ones(4) / 4,) * 2
    tree = Proposal((1, 2), rows, "draft", (-1, 0))
    assert tree.select(range(2)) is tree


def test_credit_goes_to_the_parts_whose_chains_hold_the_accepted_path():
    merged = merge_proposals([Proposal((5, 6, 7), source="draft"), Proposal((5, 6, 9), source="lookup"),
                              Proposal((4,), source="ngram")])
    assert merged.accepted_by_part((0, 1, 3)) == (2, 3, 0)  # through lookup's 9: the draft had 2 right
    assert merged.accepted_by_part((0, 1, 2)) == (3, 2, 0)
    assert merged.accepted_by_part((4,)) == (0, 0, 1)
    assert merged.accepted_by_part(()) == (0, 0, 0)


def test_select_and_prefix_keep_the_parts_mapping():
    merged = merge_proposals([Proposal((5, 6, 7), source="draft"), Proposal((5, 6, 9), source="lookup"),
                              Proposal((4,), source="ngram")])
    kept = merged.select([0, 1, 3, 4])
    assert isinstance(kept, MergedProposal)
    assert kept.tokens == (5, 6, 9, 4) and kept.parents == (-1, 0, 1, -1)
    assert kept.part_nodes == ((0, 1, -1), (0, 1, 2), (3,))
    assert [kept.verified_chain(part) for part in range(3)] == [2, 3, 1]
    assert kept.accepted_by_part((0, 1, 2)) == (2, 3, 0)
    chain = merged.main_chain
    assert isinstance(chain, MergedProposal) and chain.tokens == (5, 6, 7) and chain.part_nodes[2] == (-1,)


def _random_parts(rng: np.random.Generator) -> list[Proposal]:
    parts = []
    for source in ("draft", "lookup", "ngram"):
        n = int(rng.integers(1, 7))
        parents = tuple(int(rng.integers(-1, i)) for i in range(n))
        tokens: list[int] = []  # 8 ids, so the parts share nodes often and have room for siblings
        for i, parent in enumerate(parents):  # siblings within a part differ, as a drafter's do
            taken = {tokens[j] for j in range(i) if parents[j] == parent}
            tokens.append(int(rng.choice([t for t in range(8) if t not in taken])))
        parts.append(Proposal(tuple(tokens), source=source, parents=parents))
    return parts


@pytest.mark.parametrize("seed", range(40))
def test_budgets_keep_a_valid_tree_within_its_caps(seed):
    """Random parts, random caps: the nodes kept include every kept node's parent, the forced
    ones come first within the caps, and the result is a tree whose parents precede children."""
    rng = np.random.default_rng(seed)
    parts = _random_parts(rng)
    merged = merge_proposals(parts)
    assert sorted({node for mapped in merged.part_nodes for node in mapped}) == list(range(len(merged)))
    for a, b in ((a, b) for a in range(len(merged)) for b in range(a)):
        assert not (merged.parents[a] == merged.parents[b] and merged.tokens[a] == merged.tokens[b])
    forced = [node in merged.part_nodes[0] for node in range(len(merged))]
    max_nodes, max_paths = int(rng.integers(1, 8)), int(rng.integers(1, 4)) if seed % 2 else 0
    kept = select_merged(merged.tree, forced, None, [], 0.0, max_nodes, max_paths)
    assert len(kept) <= max_nodes and kept == sorted(kept)
    assert all(merged.parents[node] < 0 or merged.parents[node] in kept for node in kept)
    result = merged.select(kept)
    TokenTree(result.tokens, result.parents)  # raises where a parent follows its child
    if max_paths:
        assert len(result.tree.paths) <= max_paths
    for part, mapped in enumerate(result.part_nodes):  # each part's kept nodes point at its tokens
        assert all(node < 0 or result.tokens[node] == parts[part].tokens[j] for j, node in enumerate(mapped))
    if not max_paths:  # the forced nodes first: as many of them as the cap holds
        assert sum(forced[node] for node in kept) == min(sum(forced), max_nodes)


def test_values_of_merged_nodes_count_what_earlier_siblings_leave():
    merged = merge_proposals([Proposal((5, 6), source="draft"), Proposal((5, 9), source="lookup"),
                              Proposal((4,), source="ngram")])
    draft_values = node_values(merged.parts[0].tree, [1.0, 0.8, 0.5], BranchRates())  # a_1 0.8, a_2 0.5
    lookup_values = node_values(merged.parts[1].tree, [1.0, 0.9, 0.6], BranchRates())
    ngram_values = node_values(merged.parts[2].tree, [1.0, 0.3], BranchRates())
    values = merged_values(merged, [draft_values, lookup_values, ngram_values])
    assert values[0] == pytest.approx(0.8)  # the draft's 5
    assert values[1] == pytest.approx(0.8 * 0.5)  # the draft's 6
    assert values[2] == pytest.approx(0.8 * 0.6 * (1 - 0.5))  # lookup's 9 where the draft's 6 is wrong
    assert values[3] == pytest.approx(0.3 * (1 - 0.8))  # ngram's 4 where the 5 is wrong


def test_in_adaptive_selection_a_sibling_joins_only_where_it_pays():
    tree = merge_proposals([Proposal((5, 6), source="draft"), Proposal((4,), source="lookup")]).tree
    forced, values = [True, True, False], [0.8, 0.4, 0.1]
    flat = [None, 1.0, 1.0, 1.0, 1.0]  # a pass costs the same whatever it holds (a GPU)
    steep = [None, 1.0, 2.0, 3.0, 4.0]  # each token a plain pass more (a CPU)
    assert select_merged(tree, forced, values, flat, 0.0, 8, 0) == [0, 1, 2]
    assert select_merged(tree, forced, values, steep, 0.0, 8, 0) == [0, 1]
    assert select_merged(tree, forced, values, flat, 0.0, 8, 1) == [0, 1]  # one path: no room for it
    assert select_merged(tree, forced, values, flat, 0.0, 2, 0) == [0, 1]  # two nodes


# ---- exact under sampling -------------------------------------------------------------------
P_TARGET = np.array([0.1, 0.4, 0.3, 0.2])
Q_DRAFT = np.array([0.15, 0.45, 0.1, 0.3])
SAMPLES = 50_000


def _first_tokens(order: str, rng: np.random.Generator) -> Counter:
    """The first token of SAMPLES verified merged trees: lookup's fixed 1 and a draft token drawn
    from Q_DRAFT, merged in ``order``, verified against P_TARGET."""
    counts: Counter = Counter()
    lookup = Proposal((1,), source="lookup")
    for _ in range(SAMPLES):
        draft = Proposal((int(rng.choice(4, p=Q_DRAFT)),), (Q_DRAFT,), source="draft")
        merged = merge_proposals([lookup, draft] if order == "lookup first" else [draft, lookup])
        p_rows = np.tile(P_TARGET, (1 + len(merged), 1))  # (1 + n, V)
        verdict = verify_tree_sampled(merged.tree, p_rows, merged.p_draft, rng)
        counts[merged.tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    return counts


def _chi_square_p(counts: Counter) -> float:
    return float(scipy_stats.chisquare([counts[t] for t in range(4)], SAMPLES * P_TARGET).pvalue)


@pytest.mark.parametrize("order", ["lookup first", "draft first"])
def test_merged_siblings_sample_the_targets_distribution(order):
    assert _chi_square_p(_first_tokens(order, np.random.default_rng(7))) > 1e-3


def test_a_drawn_sibling_with_its_row_as_drawn_fails_the_same_test(monkeypatch):
    """The check above has the power to see a wrong row: the draft's row left as drawn after
    lookup's sibling (ignoring that the node exists only where its token is not lookup's)."""
    monkeypatch.setattr(specrun.drafters.chain, "sibling_row", lambda row, tokens: row)
    assert _chi_square_p(_first_tokens("lookup first", np.random.default_rng(7))) < 1e-6


def test_the_merged_chain_scenario_merges_shares_nodes_and_tries_siblings(monkeypatch):
    """The harness's "merged chain" (its chi-square and acceptance checks run in test_acceptance)
    verifies merged trees, with shared nodes and cheap siblings tried after the draft's."""
    merged = []
    verify = TargetPasses.verify

    def recording(self, last_token, drafts, sampling, rng, allowed=None, text=None):
        if isinstance(drafts, MergedProposal):
            merged.append(drafts)
        return verify(self, last_token, drafts, sampling, rng, allowed, text)

    monkeypatch.setattr(TargetPasses, "verify", recording)
    sampled, problems = run_scenario("merged chain", runs=300)
    assert problems == []
    assert sampled.verified.siblings_tested > 0
    assert len(merged) > 100
    assert sum(sum(len(part) for part in each.parts) > len(each) for each in merged) > 50  # shared nodes
    assert all(each.parts[0].source == "draft" for each in merged if "draft" in each.source)


# ---- the policy ----------------------------------------------------------------------------
class _Stub(Drafter):
    def __init__(self, name: str, paid: bool) -> None:
        self.name, self.pays_per_token = name, paid

    def propose(self, context, draft_len, sampling, rng) -> Proposal:
        return Proposal()


def _policy(max_nodes: int) -> AdaptivePolicy:
    policy = AdaptivePolicy(clock=lambda: 0.0)
    policy.set_drafter(ChainDrafter([_Stub("lookup", False), _Stub("draft", True)]))
    policy.configure(4, adaptive=False, max_nodes=max_nodes, max_paths=4)
    return policy


def test_the_policy_merges_what_it_passed_over_with_the_draft_models_proposal_first():
    policy = _policy(max_nodes=8)
    draft, lookup = Proposal((5, 6, 7), source="draft"), Proposal((5, 9), source="lookup")
    merged = policy.chosen(draft, [lookup], 10)
    assert isinstance(merged, MergedProposal)
    assert merged.tokens == (5, 6, 7, 9) and merged.parents == (-1, 0, 1, 0)
    assert _policy(max_nodes=8).chosen(draft, [], 10) is draft  # nothing passed over
    assert _policy(max_nodes=0).chosen(draft, [lookup], 10) is draft  # chains only (--chain)
    assert _policy(max_nodes=8).chosen(draft, [Proposal((5, 6), source="lookup")], 10) is draft  # nothing new
    cheap_taken = _policy(max_nodes=8).chosen(lookup, [draft], 10)  # the draft's nodes go first all the same
    assert cheap_taken.tokens == (5, 6, 7, 9) and cheap_taken.parts[0] is draft


def test_the_draft_model_is_credited_with_its_own_nodes_on_the_accepted_path():
    policy = _policy(max_nodes=8)
    merged = policy.chosen(Proposal((5, 6, 7), source="draft"), [Proposal((5, 9), source="lookup")], 10)
    context = [1] * 10 + [5, 9, 3]
    policy.observe(StepReport(Plan(draft=True), merged, (0, 3), 0.0, 0.1, 0.2, context, 10))
    controller = policy.controllers["draft"]
    assert controller.tried[1] == 1.0 and controller.accepted[1] == 1.0  # its 5, shared, accepted
    assert controller.tried[2] == 1.0 and controller.accepted[2] == 0.0  # its 6 lost to lookup's 9
    assert controller.tried[3] == 0.0
    assert policy.target_costs.known(5)  # one pass over the last token and the tree's 4 nodes


# ---- greedy: plain decoding's output on every backend -----------------------------------------
class _Oracle(Drafter):
    """A cheap drafter that knows the target's next 3 greedy tokens (a copy of the target drafts
    them) and is passed over (the chain takes 4), so the draft model is asked too."""

    name = "oracle"

    def __init__(self, copy) -> None:
        self.inner = DraftModelDrafter(copy)

    def propose(self, context, draft_len, sampling, rng) -> Proposal:
        return Proposal(self.inner.propose(context, 3, sampling, rng).tokens, source=self.name)

    def finish(self, context) -> None:
        self.inner.finish(context)

    def close(self) -> None:
        self.inner.close()


class _WrongFromThird(Drafter):
    """The draft model: a copy of the target whose drafts go wrong from the third token on, so
    the oracle's third token is the one accepted there, on a branch beside the draft's."""

    name = "draft"
    pays_per_token = True

    def __init__(self, copy, vocab_size: int) -> None:
        self.inner, self.vocab_size = DraftModelDrafter(copy), vocab_size

    def propose(self, context, draft_len, sampling, rng) -> Proposal:
        tokens = self.inner.propose(context, draft_len, sampling, rng).tokens
        return Proposal(tuple(t if i < 2 else (t + 1) % self.vocab_size for i, t in enumerate(tokens)),
                        source=self.name)

    def bind(self, target, clock) -> None:
        self.inner.bind(target, clock)

    def finish(self, context) -> None:
        self.inner.finish(context)

    def close(self) -> None:
        self.inner.close()


def _merged_and_plain(target, oracle_copy, draft_copy, plain_target, prompt, clock, tree_nodes=16, new_tokens=80):
    """Greedy output of the merging chain and of plain decoding. ``clock``: simulated seconds in
    which a target pass costs far more than a draft token, so the draft model's gate (a fixed
    chain's) keeps it on, as on a memory-bound machine, whatever this machine's timings."""
    chain = ChainDrafter([_Oracle(oracle_copy), _WrongFromThird(draft_copy, target.vocab.size)], min_tokens=4)
    engine = SpeculativeEngine(target, chain, "oracle+draft", clock=clock)
    result = engine.run(prompt, GenerationParams(new_tokens, draft_len=4, stop_at_eos=False, tree_nodes=tree_nodes))
    plain = SpeculativeEngine(plain_target).run(prompt, GenerationParams(new_tokens, draft_len=0, stop_at_eos=False))
    chain.close()
    return plain.token_ids, result


def _fakes(clock: SimClock) -> list[FakeBackend]:
    table = hashed_logits(VOCAB, salt=3)
    return [CostedFake(table, clock, 1.0, 0.02, VOCAB), FakeBackend(table, VOCAB),
            CostedFake(table, clock, 0.02, 0.0, VOCAB), FakeBackend(table, VOCAB)]


class _SimulatedClock:
    """Simulated seconds: each pass of a charged backend, chain or tree, costs its set price."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, backend, per_pass: float) -> None:
        for name in ("forward", "forward_argmax", "forward_tree", "forward_tree_argmax"):
            method = getattr(backend, name, None)
            if method is not None:
                setattr(backend, name, self._charged(method, per_pass))

    def _charged(self, method, per_pass: float):
        def charged(*args):
            self.now += per_pass
            return method(*args)

        return charged


class _Passes:
    """The proposals the engine verifies and the accepted paths (monkeypatched)."""

    def __init__(self, monkeypatch) -> None:
        self.merged: list[tuple[MergedProposal, tuple[int, ...]]] = []
        self.verified = 0
        verify = TargetPasses.verify

        def recording(passes, last_token, drafts, sampling, rng, allowed=None, text=None):
            proposal, verdict = verify(passes, last_token, drafts, sampling, rng, allowed, text)
            self.verified += bool(proposal.tokens)
            if isinstance(proposal, MergedProposal):
                self.merged.append((proposal, tuple(verdict.path)))
            return proposal, verdict

        monkeypatch.setattr(TargetPasses, "verify", recording)

    def through_cheap_branch(self) -> int:
        """Passes whose accepted path left the draft's chain for the oracle's branch."""
        return sum(1 for proposal, path in self.merged
                   if proposal.accepted_by_part(path)[1] > proposal.accepted_by_part(path)[0])


def test_greedy_merged_chains_equal_plain_decoding_on_the_fake(monkeypatch):
    passes = _Passes(monkeypatch)
    clock = SimClock()
    plain, merged = _merged_and_plain(*_fakes(clock), [1, 2, 3, 4], clock)
    assert merged.token_ids == plain
    assert len(passes.merged) > 5 and passes.through_cheap_branch() > 5
    assert merged.stats.steps < len(plain) / 2


def test_without_a_node_budget_the_chain_stays_chain_shaped(monkeypatch):
    """--chain (tree_nodes 0): one member's proposal a pass, as before merging existed."""
    passes = _Passes(monkeypatch)
    clock = SimClock()
    plain, chained = _merged_and_plain(*_fakes(clock), [1, 2, 3, 4], clock, tree_nodes=0)
    assert chained.token_ids == plain
    assert passes.merged == [] and passes.verified > 5


@pytest.mark.parametrize("kind", ["llama", "mlx"])
def test_greedy_merged_chains_equal_plain_decoding_on_the_real_backends(monkeypatch, tiny_models, kind):
    """llama.cpp (F32 weights and cache, flash attention off: exact) and MLX on a tiny model."""
    passes = _Passes(monkeypatch)
    backends = open_exact_copies(tiny_models["llama"], kind, 4)
    try:
        assert backends[0].tree_support.available, backends[0].tree_support.reason
        clock = _SimulatedClock()
        clock.charge(backends[0], 1.0)
        clock.charge(backends[2], 0.05)
        for prompt in ([1, 2, 3, 4, 5], [40, 41, 42]):
            plain, merged = _merged_and_plain(*backends, prompt, clock)
            assert merged.token_ids == plain
        assert len(passes.merged) > 5 and passes.through_cheap_branch() > 5
    finally:
        for backend in backends:
            backend.close()


@pytest.mark.parametrize("kind", ["llama", "mlx"])
def test_sampled_merged_chains_on_the_real_backends_are_lossless(monkeypatch, tiny_models, tmp_path_factory, kind):
    """The full chain at temperature 1 with a draft that disagrees at times (the tiny model plus
    noise), on a target that verifies trees: every output token's PIT against a second copy of
    the target and the acceptance count against its expectation (lossless_harness), with passes
    that merged the draft model's proposal and cheap ones among them."""
    passes = _Passes(monkeypatch)
    model = tiny_models["llama"]
    drafts = perturbed_copy(model, tmp_path_factory.mktemp("perturbed"))
    if kind == "llama":
        pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
        from specrun.backends.llama import LlamaCppBackend

        target, reference = (LlamaCppBackend(model.gguf_path, n_ctx=2048, tree_paths=paths) for paths in (8, 0))
        draft = LlamaCppBackend(drafts["llama"], n_ctx=2048)
    else:
        pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
        from specrun.backends.mlx import MlxBackend

        target, reference, draft = (MlxBackend(source, n_ctx=2048) for source in (model.hf_dir, model.hf_dir,
                                                                                   drafts["mlx"]))
    try:
        _, problems = real_scenario(target, draft, reference, "lookup+ngram+draft", SamplingSettings(temperature=1.0),
                                    adaptive=True)
    finally:
        for backend in (target, draft, reference):
            backend.close()
    assert problems == []
    assert len(passes.merged) > 10
    assert any(not proposal.is_chain for proposal, _ in passes.merged)
