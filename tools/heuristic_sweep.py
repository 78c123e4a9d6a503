"""Switch off each heuristic of the adaptive policy in turn and see which tests fail.

Every heuristic the policy keeps must have a test that fails without it (issue 27). This
runs the policy's tests once per switch-off, in a fresh pytest process each, and prints
which tests caught it; a heuristic no test catches is reported as UNGUARDED.

    .venv/bin/python tools/heuristic_sweep.py [NAME ...] > runs/heuristics.txt

As a pytest plugin (``-p heuristic_sweep`` with tools/ on PYTHONPATH) it applies the
switch-off named in SPECRUN_SWITCH_OFF before any test runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/control", "tests/drafters", "tests/engine/test_engine.py"]


def _after_init(cls, **values):
    """Set dataclass fields after __post_init__ (their defaults are baked into __init__)."""
    original = cls.__post_init__

    def post_init(self):
        for name, value in values.items():
            setattr(self, name, value)
        original(self)

    cls.__post_init__ = post_init


def _switch_offs():
    from specrun.control import costs as pass_costs
    from specrun.control import draft_length, policy
    from specrun.control import gate as speculation_gate
    from specrun.drafters.lookup import PromptLookupDrafter
    from specrun.drafters.ngram import NgramPoolDrafter

    costs, controller, gate = pass_costs.TargetCosts, draft_length.DraftLengthController, speculation_gate.SpeculationGate

    class AlwaysAsk(speculation_gate.IdleBackoff):
        def ask(self):
            return True

    def no_carried_gaps():
        forget = policy.AdaptivePolicy.forget_acceptance

        def forget_all(self):
            forget(self)
            self.memory.carried_gaps = {}

        policy.AdaptivePolicy.forget_acceptance = forget_all

    def inherit_nothing():
        def acceptances(self, limit):
            out = [1.0]
            for position in range(1, limit + 1):
                weight = self.tried[position] + self.prior_weight
                out.append((self.accepted[position] + self.prior_accept * self.prior_weight) / weight)
            return out

        controller.acceptances = acceptances

    return {
        # target and draft pass costs
        "plain pass apart from the line (SEPARATE_PLAIN)": lambda: setattr(costs, "SEPARATE_PLAIN", False),
        "spike cap": lambda: setattr(costs, "SPIKE_CAP", float("inf")),
        "ageing unvisited lengths (AGE)": lambda: setattr(costs, "AGE", 1.0),
        "stale tolerance (table rebuilt on every pass)": lambda: setattr(costs, "STALE_TOLERANCE", 0.0),
        "switch-back accounting (note_pass)": lambda: setattr(costs, "note_pass", lambda self, n, s, previous: True),
        "non-decreasing fit": lambda: setattr(pass_costs, "_non_decreasing", lambda values, weights: values),
        "one-point line (+10% a token)": lambda: setattr(costs, "_one_point_line", staticmethod(lambda n0, t0, m: [t0] * (m + 1))),
        # the draft-length controllers
        "acceptance decay": lambda: _after_init(controller, decay=1.0),
        "later positions inherit earlier estimates": inherit_nothing,
        "ramp-up (evidenced length)": lambda: _after_init(controller, ramp_up=False),
        "probe gap doubling": lambda: _after_init(controller, max_probe_gap=8),
        "controller on/off switch": lambda: setattr(controller, "_settle_gate", lambda self: None),
        "plain pass timed first (PLAIN_TRIES)": lambda: setattr(controller, "PLAIN_TRIES", 0),
        "short first tries at a fixed length (FIRST_TRIES)": lambda: setattr(controller, "FIRST_TRIES", 0),
        "explore: plain pass before the first draft": lambda: setattr(controller, "_explore", lambda self, limit: min(self.probe_len, limit)),
        "longer probes for cheap drafters": lambda: setattr(policy, "CHEAP_PROBE_LEN", draft_length.PAID_PROBE_LEN),
        "cheap drafters' time sunk": lambda: setattr(policy.AdaptivePolicy, "_counts_draft_time", lambda self, source: True),
        "switch charge on speculative steps": lambda: setattr(costs, "switch_charge", property(lambda self: 0.0)),
        # the gate, the idle backoff, free scoring
        "speculation gate": lambda: setattr(gate, "record", lambda self, *args: None),
        "gate waits for engaged steps (MIN_ENGAGED)": lambda: setattr(gate, "MIN_ENGAGED", 0.0),
        "gate margin": lambda: setattr(gate, "MARGIN", 0.0),
        "proposing time counts as engaged": lambda: setattr(policy, "PROPOSING_SHARE", float("inf")),
        "gate judges a text only after MIN_STEPS": lambda: setattr(gate, "MIN_STEPS", gate.RETRY_STEPS),
        "idle backoff": lambda: setattr(policy, "IdleBackoff", AlwaysAsk),
        "cheap proposals scored for free": lambda: setattr(draft_length.ProposalScores, "add", lambda self, *args: None),
        "weighing a cheap proposal against the draft model": lambda: setattr(policy.AdaptivePolicy, "_cheap_worth_taking", lambda self, proposal: len(proposal) >= 2),
        # priors and memory across texts
        "lookup's priors by n-gram length": lambda: setattr(PromptLookupDrafter, "kind_priors", {}),
        "the n-gram pool's low prior": lambda: setattr(NgramPoolDrafter, "kind_priors", {}),
        "a chain's draft model stays off into the next text": no_carried_gaps,
        "drafters earlier processes left off start off": lambda: setattr(controller, "start_off", lambda self, gap: None),
    }


def pytest_configure(config):
    name = os.environ.get("SPECRUN_SWITCH_OFF")
    if name:
        _switch_offs()[name]()


def main(names: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    every = list(_switch_offs())
    unguarded = []
    for name in names or every:
        env = {**os.environ, "SPECRUN_SWITCH_OFF": name, "PYTHONPATH": str(ROOT / "tools")}
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "heuristic_sweep", "-p", "no:cacheprovider", *TESTS],
            cwd=ROOT, env=env, capture_output=True, text=True,
        )
        failed = sorted(set(re.findall(r"^FAILED (\S+)", run.stdout, re.M)))
        if not failed:
            unguarded.append(name)
        print(f"## {name}: {len(failed)} failing" + ("  UNGUARDED" if not failed else ""), flush=True)
        for test in failed:
            print(f"   {test}", flush=True)
    print(f"\n{len(unguarded)} unguarded: {unguarded}")
    return 1 if unguarded else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
