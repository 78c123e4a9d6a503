"""Where a greedy output first leaves plain decoding's, and whether rounding explains it.

Only the first differing token matters: after it the two outputs continue from different
contexts. There the target is re-run along plain decoding's path and its logits say how
close the two tokens were. A gap within rounding is a near-tie (batched kernels round
differently from one-token ones); anything wider is a defect, and so is every difference
under ``--exact``, which promises bit-identical output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrun.backends.base import Backend
from specrun.backends.kv import common_prefix_len, sequence_for
from specrun.sampling import SamplingSettings, for_vocabulary, shaped_row

NEAR_TIE = 1e-3  # a logit gap below this is a numerical near-tie (docs/design.md)
NEAR_TIE_NOTE = (
    f"* greedy outputs may differ where the target's logits for the two tokens tie within {NEAR_TIE:g}, or "
    "within what reading the same context in a batch was measured to move them by there: batched "
    "verification rounds differently from one-token decoding"
)
END_OF_OUTPUT = "(end of output)"


@dataclass(frozen=True)
class Mismatch:
    """A greedy output that differs from the baseline's: where, which tokens, how close the target was.

    ``top2_gap``: the target's top-1 logit minus its runner-up's there. ``token_gap``: the
    logit of the baseline's token minus the other output's (None where one output ended
    there; the verdict then weighs ``top2_gap``). ``batch_rounding``: the largest change of
    any logit at that position when the same context is read in a batched pass instead of
    one token at a time, measured there. A gap can move by up to twice that, so a
    divergence within it is the target's own batch-dependent rounding (llama.cpp's F16 KV
    cache: up to ~0.026 on the demo target over long Spec-Bench prompts; with an F32 cache
    outputs matched).
    """

    prompt_index: int
    position: int  # first differing output token
    top2_gap: float
    batch_rounding: float = 0.0
    plain_token: int | None = None  # the baseline's token there; None: its output ended
    other_token: int | None = None  # the differing output's token there; None: it ended
    plain_text: str = END_OF_OUTPUT
    other_text: str = END_OF_OUTPUT
    token_gap: float | None = None

    @property
    def gap(self) -> float:
        """The gap the verdict weighs: between the two tokens emitted, else the top two."""
        return self.top2_gap if self.token_gap is None else abs(self.token_gap)

    @property
    def near_tie(self) -> bool:
        """The two tokens tie within NEAR_TIE: a divergence any batched kernel may cause."""
        return self.gap < NEAR_TIE

    @property
    def within_rounding(self) -> bool:
        """A near-tie, or a gap that batched reading was measured to move by at least as much."""
        return self.near_tie or self.gap < 2.0 * self.batch_rounding

    def is_defect(self, exact: bool = False) -> bool:
        """Not explained by rounding. Under ``--exact`` also any difference where reading the
        context in a batch was measured to move no logit (bit-identity was promised and the
        kernels keep it); where it does move them, this machine's kernels cannot keep that
        promise (an AVX2-only x86 CPU: one-token and batched matrix products sum in different
        orders, docs/methods.md) and rounding is weighed as without ``--exact``."""
        return not self.within_rounding or (exact and self.batch_rounding == 0.0)

    def verdict(self, exact: bool = False) -> str:
        """'near-tie' or 'DEFECT'."""
        return "DEFECT" if self.is_defect(exact) else "near-tie"


def find_mismatch(
    target: Backend, prompt_index: int, prompt: list[int], baseline_ids: Sequence[int], other_ids: Sequence[int],
    sampling: SamplingSettings = SamplingSettings(),
) -> Mismatch:
    """Locate the first differing token and measure the target's logit gaps there (its logits as
    ``sampling``'s penalties, DRY and bias shape them, which the greedy choice was made on).

    The gaps are measured along plain decoding's own path (the prompt in one pass, then
    one token at a time): with an F16 KV cache a single batched pass over the same
    context rounds differently and can report a gap 100x larger (measured: 2.5e-5
    one token at a time, 2.1e-3 batched, top two swapped). That batched pass is made
    too, and how far it moves the logits there is the mismatch's ``batch_rounding``.
    """
    position = common_prefix_len(baseline_ids, other_ids)
    sampling = for_vocabulary(sampling, target)
    sequence = sequence_for(target)
    sequence.rewind(0)
    logits = sequence.feed(prompt, [len(prompt) - 1])[0]  # (V,)
    for token in baseline_ids[:position]:
        logits = sequence.feed([token], [0])[0]
    text = [*prompt, *baseline_ids[:position]]
    logits = shaped_row(logits, sampling, text)
    top2 = np.sort(logits)[-2:]
    # The same context with the output (and at least the prompt's last token) read in one batch.
    start = len(prompt) - 1 if position else max(len(prompt) - 2, 0)
    sequence.rewind(start)
    fed = [*prompt[start:], *baseline_ids[:position]]
    batched = shaped_row(sequence.feed(fed, [len(fed) - 1])[0], sampling, text)
    plain_token, other_token = _token_at(baseline_ids, position), _token_at(other_ids, position)
    both = plain_token is not None and other_token is not None
    return Mismatch(
        prompt_index,
        position,
        float(top2[1] - top2[0]),
        float(np.abs(batched - logits).max()),
        plain_token,
        other_token,
        _shown(target, plain_token),
        _shown(target, other_token),
        float(logits[plain_token] - logits[other_token]) if both else None,
    )


def difference_line(method: str, prompt: str, mismatch: Mismatch, exact: bool = False) -> str:
    """One line for a differing output: where it left plain decoding, the two tokens, the gap, the verdict."""
    gap = "" if mismatch.token_gap is None else f"logit gap {mismatch.token_gap:.3g}, "
    rounding = f", batch rounding {mismatch.batch_rounding:.3g}" if mismatch.batch_rounding else ""
    verdict = mismatch.verdict(exact)
    if not mismatch.within_rounding:
        verdict += " (the target had a clear choice)"
    elif exact:
        verdict += (" (--exact promises identical output)" if mismatch.is_defect(exact)
                    else " (--exact cannot hold here: this machine's batched kernels round otherwise)")
    return (
        f"{method} on {prompt}: differs from plain decoding at token {mismatch.position}: "
        f"plain {_token_label(mismatch.plain_text, mismatch.plain_token)} "
        f"vs {_token_label(mismatch.other_text, mismatch.other_token)} "
        f"({gap}top-2 gap {mismatch.top2_gap:.3g}{rounding}): {verdict}"
    )


def _token_at(ids: Sequence[int], position: int) -> int | None:
    return int(ids[position]) if position < len(ids) else None


def _shown(target: Backend, token: int | None) -> str:
    """The token as the user reads it: its text (bytes that are only part of a character
    escaped, as \\xe2), else (a control token) its vocabulary entry."""
    if token is None:
        return END_OF_OUTPUT
    return target.token_bytes(token).decode("utf-8", errors="backslashreplace") or target.token_text(token)


def _token_label(text: str, token: int | None) -> str:
    """'f' (#102): quoted so that spaces and newlines show, with the id (two pieces of one
    character would otherwise read alike)."""
    return text if token is None else f"{text!r} (#{token})"
