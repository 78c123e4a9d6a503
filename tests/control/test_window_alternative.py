"""auto holding its draft model's windowed cache beside the full one (DrafterOptions.draft_window):
which of the two drafts each step follows what each is measured to yield at the context reached
(AdaptivePolicy._rest_alternatives, AlternativePick), and either way the output is the target's."""

from __future__ import annotations

import numpy as np
import pytest

from fake_models import SimClock
from lossless_harness import greedy_scenario
from specrun.backends.fake import FakeBackend, FakeWindowCache
from specrun.backends.window import WindowedBackend
from specrun.control.policy import AlternativePick
from specrun.drafters.draft_model import WINDOW_NAME
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine

VOCAB = 32
SINKS, WINDOW, BLOCK = 4, 64, 8


def local_logits(salt: int, noise: float = 0.0):
    """A model that reads only the last two tokens: a window of them drafts as the full cache does."""

    def table(context):
        rng = np.random.default_rng(hash((salt, tuple(context[-2:]))) % (2**32))
        logits = rng.normal(0.0, 2.0, VOCAB).astype(np.float32)
        if noise:
            logits += np.random.default_rng(hash((salt + 1, tuple(context[-2:]))) % (2**32)).normal(
                0.0, noise, VOCAB).astype(np.float32)
        return logits

    return table


class CacheCostedFake(FakeBackend):
    """A fake whose pass costs ``per_token`` a token fed plus ``per_cell`` a token its cache holds:
    reading the KV cache, which a long context makes dearer than the weights."""

    def __init__(self, table, clock: SimClock, base: float, per_token: float, per_cell: float) -> None:
        super().__init__(table, VOCAB, n_ctx=100_000)
        self.clock, self.base, self.per_token, self.per_cell = clock, base, per_token, per_cell

    def forward(self, tokens, logit_rows):
        self.clock.now += self.base + self.per_token * len(tokens) + self.per_cell * (self.n_past + len(tokens))
        return super().forward(tokens, logit_rows)

    def forward_tree(self, tokens, tree, logit_rows):  # a merged tree's pass costs time too
        fed = len(tokens) + len(tree)
        self.clock.now += self.base + self.per_token * fed + self.per_cell * (self.n_past + fed)
        return super().forward_tree(tokens, tree, logit_rows)

    def open_window(self, sinks: int, window: int, owns: bool = False):
        model = self

        class Costed(FakeWindowCache):
            def decode(self, tokens, start, rows):
                model.clock.now += model.base + model.per_token * len(tokens) + model.per_cell * (start + len(tokens))
                return super().decode(tokens, start, rows)

        return WindowedBackend(self, lambda cells: Costed(self, cells), sinks, window, owns=owns, block=BLOCK)


def far_sighted(salt: int):
    """A draft that agrees with ``local_logits(salt)`` where it reads more than a window holds, and
    mostly not where it reads a window's tokens alone."""
    near, noisy = local_logits(salt), local_logits(salt, noise=6.0)
    return lambda context: near(context) if len(context) > SINKS + WINDOW + BLOCK else noisy(context)


def run_auto(prompt_len: int, new: int, per_cell: float, seed: int = 0, draft_table=None, learning: bool = False):
    """auto on a target whose passes cost 1 s and a draft that costs 0.02 s a token plus
    ``per_cell`` a cached token, holding a window of 64 + 4 sinks beside the full cache: the
    output, plain decoding's, and the tokens the window read (WindowedBackend.n_past).
    ``learning``: as a CLI run does, starting from what earlier runs of the pair kept
    (learned.json) and keeping what this one measured."""
    from specrun.sessions.setup import load_tuned, remember_run

    clock = SimClock()
    target_table = local_logits(1)
    target = CacheCostedFake(target_table, clock, 1.0, 0.02, 0.0)
    draft = CacheCostedFake(draft_table or local_logits(1, noise=1.0), clock, 0.0, 0.02, per_cell)
    view = draft.open_window(SINKS, WINDOW)
    drafter = build_drafter("auto", draft, DrafterOptions(draft_window=view))
    assert [member.name for member in drafter.members] == ["lookup", "ngram", WINDOW_NAME, "draft"]
    engine = SpeculativeEngine(target, drafter, method="auto", clock=clock)
    tuned = load_tuned(target, draft, None) if learning else None
    if tuned is not None:
        tuned.apply(engine)
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, prompt_len)]
    params = GenerationParams(new, draft_len=8, stop_at_eos=False, adaptive=True)
    result = engine.run(prompt, params)
    if learning:
        remember_run(engine, target, draft, None, tuned)
    read = view.n_past  # before the drafter closes it
    plain = SpeculativeEngine(FakeBackend(target_table, VOCAB, n_ctx=100_000)).run(
        prompt, GenerationParams(new, draft_len=0, stop_at_eos=False))
    drafter.close()
    return result, plain, read


def drafted_by(result, source: str) -> int:
    """Tokens drafted in steps whose proposal ``source`` made or took part in (a merged tree)."""
    return sum(counts.drafted for name, counts in result.stats.by_source.items() if source in name.split("+"))


def test_a_long_context_drafts_from_the_window_and_the_output_is_the_target_s():
    """At 3,000 tokens a full-cache draft token costs 0.02 + 3 s, more than a target pass; the
    window's 0.02 + 0.08: nearly every draft comes from the window (the full cache is tried
    again now and then), and the answer is plain decoding's."""
    result, plain, read = run_auto(3000, 120, per_cell=1e-3)
    assert result.token_ids == plain.token_ids
    window, full = drafted_by(result, WINDOW_NAME), drafted_by(result, "draft")
    assert window > 40 and window > 5 * full
    assert result.stats.accepted > 0
    assert read > 3000  # it read the prompt in the prefill, and the answer as it drafted


def test_a_context_the_window_holds_whole_never_asks_it():
    """Below sinks + window + block both caches hold the same tokens: the full cache alone drafts,
    and the window never reads the prompt."""
    result, plain, read = run_auto(20, 40, per_cell=1e-3)
    assert result.token_ids == plain.token_ids
    assert drafted_by(result, WINDOW_NAME) == 0 and drafted_by(result, "draft") > 0
    assert read == 0


def test_an_answer_that_outgrows_the_window_keeps_the_full_cache():
    """A prompt the window holds whole, an answer that carries the context past it: the window
    would first read sinks + window to save the few tokens past them, so it rests for the text
    (it read no prompt), reads nothing, and the answer is plain decoding's."""
    span = SINKS + WINDOW + BLOCK
    result, plain, read = run_auto(span - 10, 120, per_cell=1e-3)
    assert result.token_ids == plain.token_ids
    assert drafted_by(result, WINDOW_NAME) == 0 and drafted_by(result, "draft") > 0
    assert read == 0


def test_a_prompt_a_few_windows_long_keeps_the_full_cache():
    """Past the window but short of ENGAGE_SPANS of it, reading the prompt into the window would
    cost sinks + window tokens to save a draft pass the few past them: the window reads nothing
    and never drafts; from ENGAGE_SPANS on it reads the prompt in the prefill."""
    from specrun.drafters.draft_model import ENGAGE_SPANS

    span = SINKS + WINDOW + BLOCK
    result, plain, read = run_auto(ENGAGE_SPANS * span - 1, 60, per_cell=1e-3)
    assert result.token_ids == plain.token_ids
    assert drafted_by(result, WINDOW_NAME) == 0 and read == 0
    result, plain, read = run_auto(ENGAGE_SPANS * span, 60, per_cell=1e-3)
    assert result.token_ids == plain.token_ids
    assert read >= SINKS + WINDOW  # the prompt's sinks and last window, in the prefill
    assert drafted_by(result, WINDOW_NAME) > 0


def test_where_reading_the_cache_costs_nothing_the_full_cache_drafts():
    """A draft whose cost does not grow with its cache and which is right only with the whole
    context: the full cache drafts nearly every step (the window's first tries and its retries
    every AlternativePick.RETRY_GAP steps aside)."""
    result, plain, _ = run_auto(600, 160, per_cell=0.0, draft_table=far_sighted(1))
    assert result.token_ids == plain.token_ids
    window, full = drafted_by(result, WINDOW_NAME), drafted_by(result, "draft")
    assert full > 2 * window


def test_what_the_window_measured_is_kept_for_the_next_process():
    """A run that drafted from the held window keeps its draft costs and its acceptance by
    position beside the full cache's (learned.json); the next process starts from them. At 1,500
    tokens the full cache costs more a draft token than a target pass, and the window is cheap
    but mostly wrong (far_sighted): the first process learns that by drafting from it; the next
    ones know it from the start, hardly ask it, and decode faster, with the same output."""
    from specrun.sessions import tuning

    runs = [run_auto(1500, 160, per_cell=1e-3, draft_table=far_sighted(1), learning=True) for _ in range(3)]
    for result, plain, _ in runs:
        assert result.token_ids == plain.token_ids
    (stored,) = tuning.load_all(tuning.learned_path())
    assert stored.held_window_costs and all(seconds > 0 for seconds in stored.held_window_costs.values())
    assert 0 < stored.held_window_acceptance[1] < 0.5  # far_sighted's window is mostly wrong
    window = [drafted_by(result, WINDOW_NAME) for result, _, _ in runs]
    assert window[0] >= 16 and window[1] <= window[0] / 4 and window[2] <= window[0] / 4, window
    rates = [result.stats.new_tokens / result.stats.generation_seconds for result, _, _ in runs]
    assert min(rates[1:]) > 1.2 * rates[0], rates


def test_a_learned_entry_without_the_window_s_figures_still_loads():
    """Entries kept before the window's figures were (no held_window_* fields) read as before."""
    import json
    from dataclasses import asdict

    from specrun.sessions import tuning

    entry = tuning.TuneResult(key="k", target="t", draft="d", machine="m", best_draft_len=0, speedup=0.0,
                              draft_costs={1: 0.1}, learned=True)
    raw = {name: value for name, value in json.loads(json.dumps(asdict(entry))).items()
           if not name.startswith("held_window")}
    assert tuning._checked_result(raw) == entry
    for bad in ({"held_window_costs": {"1": -1.0}}, {"held_window_acceptance": {"1": 1.5}},
                {"held_window_costs": {"x": 0.1}}):
        with pytest.raises((TypeError, ValueError)):
            tuning._checked_result({**raw, **bad})


def test_greedy_auto_holding_a_window_equals_plain_decoding():
    """The harness's copying target, a window of 3 + 1 sink beside the full cache (the window
    moves on many times over each 150-token answer)."""
    problems, drafted, accepted = greedy_scenario("auto", adaptive=True, window_alternative=(1, 3, 1))
    assert problems == []
    assert accepted > 0 and drafted > accepted


class TestAlternativePick:
    @pytest.mark.parametrize("rates, drafts", [
        ({"window": None, "full": 2.0}, "window"),  # never timed: tried first
        ({"window": 3.0, "full": None}, "full"),
        ({"window": 3.0, "full": 2.0}, "window"),
        ({"window": 2.0, "full": 3.0}, "full"),
        ({"window": 2.0, "full": 2.0}, "full"),  # a tie keeps the full cache
        ({"window": 0.0, "full": 0.0}, "full"),  # both switched off: the full cache's probes go on
    ])
    def test_the_faster_one_drafts(self, rates, drafts):
        assert AlternativePick("window", "full").choose(rates.get) == drafts

    def test_after_a_gap_of_drafting_steps_the_other_drafts_once(self):
        """Steps where neither drafted (a plain step, a lookup proposal taken) do not count, and
        the retry stands until the resting one has drafted."""
        gap = AlternativePick.RETRY_GAP
        pick = AlternativePick("window", "full")
        rates = {"window": 1.0, "full": 2.0}.get
        for _ in range(gap):
            assert pick.choose(rates) == "full"
            pick.drafted({"full"})
            pick.drafted({"lookup"})  # a step of another drafter's
        assert pick.choose(rates) == "window"
        pick.drafted(set())  # nothing drafted: the retry stands
        assert pick.choose(rates) == "window"
        pick.drafted({"window", "ngram"})  # a merged tree it took part in
        assert pick.choose(rates) == "full"

    def test_one_switched_off_is_not_retried(self):
        pick = AlternativePick("window", "full")
        for _ in range(3 * AlternativePick.RETRY_GAP):
            assert pick.choose({"window": 0.0, "full": 2.0}.get) == "full"
            pick.drafted({"full"})


class ChainMember:
    """A chain's member as the policy reads it: its name, whether it pays a token (a draft model,
    heads) and what it stands in for (an alternative to the draft model)."""

    min_prob = 0.0
    reads_pass = False
    whole_proposals = False
    kind_priors = {}
    alike_below = 0
    most_tokens = None

    def __init__(self, name, alternative_to=None, pays=True):
        self.name, self.alternative_to, self.pays_per_token = name, alternative_to, pays

    @property
    def members(self):
        return (self,)


def test_a_paid_member_before_the_draft_model_is_weighed_unless_it_is_an_alternative():
    """Heads before the draft model (auto's lookup+ngram+eagle+draft) are weighed against asking
    it, not taken whole as the window alternative is: with the draft model not yet timed, the
    heads' proposal is passed over for it."""
    from specrun.control.policy import AdaptivePolicy
    from specrun.drafters.base import Proposal
    from specrun.drafters.chain import ChainDrafter

    for first, taken in ((ChainMember("eagle"), False), (ChainMember(WINDOW_NAME, alternative_to="draft"), True)):
        policy = AdaptivePolicy()
        policy.set_drafter(ChainDrafter([first, ChainMember("draft")]))
        policy.configure(8, adaptive=True)
        policy.start_text(10)
        for n_tokens, seconds in ((1, 0.1), (4, 0.12)):
            policy.target_costs.observe(n_tokens, seconds)
        policy.memory.draft_costs_of(first.name).observe(3, 0.01)  # timed; the draft model not yet
        proposal = Proposal((1, 2, 3), source=first.name)
        assert policy.takes(proposal, 0, 8) is taken, first.name


class TestWhenAutoHoldsAWindow:
    """setup.auto_draft_window: auto with a draft model whose prompt is long enough for the window
    to engage (ENGAGE_SPANS of its span: 2,320 tokens at the default 512 + 4 sinks)."""

    def draft(self, n_ctx=8192, **attributes):
        model = FakeBackend(local_logits(1), VOCAB, n_ctx=n_ctx)
        for name, value in attributes.items():
            setattr(model, name, value)
        return model

    def test_auto_with_a_long_prompt_holds_one(self):
        from specrun.sessions.setup import auto_draft_window

        view = auto_draft_window("auto", self.draft(), None, None, 2320)
        assert isinstance(view, WindowedBackend) and (view.sinks, view.window) == (4, 512)
        view.close()
        view = auto_draft_window("auto", self.draft(), None, None, None)  # a chat: unbounded
        assert view is not None
        view.close()

    @pytest.mark.parametrize("case", ["draft method", "no draft", "--window 0", "--window 64", "tuned window",
                                      "searched, full kept", "short prompt", "small context", "windowed draft",
                                      "recurrent", "cannot open"])
    def test_otherwise_none(self, case):
        from types import SimpleNamespace

        from specrun.errors import ModelFileError
        from specrun.sessions.setup import auto_draft_window

        method, draft, tuned, window, longest = "auto", self.draft(), None, None, 2320
        if case == "draft method":
            method = "draft"
        elif case == "no draft":
            draft = None
        elif case == "--window 0":
            window = 0
        elif case == "--window 64":
            window = 64
        elif case == "tuned window":
            tuned = SimpleNamespace(window=256, window_context=4096)
        elif case == "searched, full kept":
            tuned = SimpleNamespace(window=0, window_context=4096)
        elif case == "short prompt":  # past the window, short of what engages it
            longest = 2319
        elif case == "small context":
            draft = self.draft(n_ctx=2048)
        elif case == "windowed draft":
            draft = draft.open_window(4, 64)
        elif case == "recurrent":
            draft = self.draft(recurrent=True)
        elif case == "cannot open":
            def refuse(*args, **kwargs):
                raise ModelFileError("no memory for a second cache", "free some")
            draft = self.draft(open_window=refuse)
        assert auto_draft_window(method, draft, tuned, window, longest) is None


def test_the_drafter_closes_its_window_and_a_failed_build_closes_it_too():
    draft = FakeBackend(local_logits(1), VOCAB, n_ctx=4096)
    view = draft.open_window(SINKS, WINDOW)
    build_drafter("auto", draft, DrafterOptions(draft_window=view)).close()
    assert view.cache is None
    view = draft.open_window(SINKS, WINDOW)
    build_drafter("draft", draft, DrafterOptions(draft_window=view)).close()  # not auto: nothing drafts with it
    assert view.cache is None
    view = draft.open_window(SINKS, WINDOW)
    with pytest.raises(ValueError, match="auto drafts with eagle heads but the options hold none"):
        build_drafter("auto", draft, DrafterOptions(draft_window=view, auto_heads="eagle"))
    assert view.cache is None


def test_the_sampled_scenario_drafts_from_both_caches():
    """The harness's "auto window alternative" scenario (chi-square in tests/engine/test_acceptance.py)
    really drafts from each cache, and the window moves on, over the runs the harness makes."""
    import dataclasses

    from lossless_harness import PROMPT, SCENARIOS, SETTINGS, WINDOW as OUTPUT, fake_engine

    scenario = SCENARIOS["auto window alternative"]
    engine = fake_engine(scenario)
    drafted = {WINDOW_NAME: 0, "draft": 0}
    for seed in range(60):
        sampling = dataclasses.replace(SETTINGS[scenario.setting], seed=seed)
        result = engine.run(list(PROMPT), GenerationParams(OUTPUT, draft_len=scenario.draft_len, stop_at_eos=False,
                                                           sampling=sampling, adaptive=True))
        for name in drafted:
            drafted[name] += drafted_by(result, name)
    window = next(member for member in engine.drafter.members if member.name == WINDOW_NAME)
    assert drafted[WINDOW_NAME] > 0 and drafted["draft"] > 0, drafted
    assert window.backend.moves >= 5


def test_a_cheap_tree_is_weighed_against_the_draft_model_by_its_main_chain():
    """A cheap proposal is weighed against asking the draft model at the lengths the cut reads: a
    tree's main chain, not its count of nodes. Six siblings beside a 1-token chain promise what
    one drafted token does: here less than the draft model's best, where six in a row promise more."""
    from specrun.control.policy import AdaptivePolicy
    from specrun.drafters.base import Proposal
    from specrun.drafters.chain import ChainDrafter

    policy = AdaptivePolicy()
    policy.set_drafter(ChainDrafter([ChainMember("lookup", pays=False), ChainMember("draft")]))
    policy.configure(8, adaptive=True)
    policy.start_text(10)
    for n_tokens in range(1, 10):  # a pass: 0.1 s and 5 ms a token more; a drafted token 5 ms
        policy.target_costs.observe(n_tokens, 0.1 + 0.005 * (n_tokens - 1))
    policy.memory.draft_costs_of("draft").observe(3, 0.015)
    cheap = policy._controller_for("lookup")
    paid_best = max(policy._controller_for("draft").expected_rates(8)[1:])
    assert max(cheap.expected_rates(1)) < paid_best < max(cheap.expected_rates(6))  # the case this is
    chain = Proposal((1, 2, 3, 4, 5, 6), source="lookup")
    tree = Proposal((1, 2, 3, 4, 5, 6), source="lookup", parents=(-1, -1, -1, -1, -1, -1))
    assert len(tree.main_chain) == 1
    assert policy.takes(chain, 0, 8) is True
    assert policy.takes(tree, 0, 8) is False
