"""An independent oracle for the target's sampling distribution: plain Python, no NumPy.

specrun's ``probabilities()`` is what the engine samples with; an oracle built on it would
share its bugs (a top-p off by one, a min-p step skipped). This is a second, deliberately
simple implementation of the documented samplers, in the order the settings name (llama.cpp's
by default: top-n-sigma, top-k, typical-p, top-p, min-p on the model's own distribution, then the
temperature), each followed by renormalising; XTC (before the temperature) the mixture of the rest of the
chain run on the tokens kept and on those XTC leaves; a dynamic temperature from the entropy of the
candidates left at its turn over the log of their count as llama.cpp counts them; temperature 0 is a
one-hot row at the first largest logit. Mirostat (``mirostat_distribution``) cuts the row at the
temperature by a μ its text carries, adaptive-p (``adaptive_distribution``) reshapes the chain's row
by an average its text carries: ``state_rows`` follows either along outputs.
The exact joint distribution of a continuation, which the statistical tests compare
against, is built from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from specrun.adaptive_p import AdaptiveP
from specrun.sampling import SamplingSettings


def distribution(logits: Sequence[float], settings: SamplingSettings) -> list[float]:
    """The next-token distribution of one row of logits under ``settings``."""
    # a row's own list of Python floats (an array's tolist(): iterating one yields NumPy scalars,
    # and their arithmetic is several times slower)
    logits = [float(value) for value in (logits.tolist() if hasattr(logits, "tolist") else logits)]
    vocab = len(logits)
    if settings.temperature == 0.0:
        best = max(range(vocab), key=lambda token: (logits[token], -token))
        return [1.0 if token == best else 0.0 for token in range(vocab)]
    return _sampled(logits, settings, settings.samplers, [True] * vocab, 1.0, vocab)


def _sampled(logits: list[float], settings: SamplingSettings, names: Sequence[str], kept: list[bool],
             temperature: float, count: int) -> list[float]:
    """The samplers ``names`` applied in turn, ``kept`` the tokens every sampler before them kept
    and ``temperature`` the one the logits are read at (1 until the temperature's turn); ``count``
    the candidates llama.cpp has left: the row, shrunk by each truncation, not by a -inf logit."""
    vocab = len(logits)
    for at, name in enumerate(names):
        if name == "temperature":
            temperature = settings.temperature
            if settings.dynatemp_range > 0.0 and count > 1:
                probs = _softmax(logits, 1.0, kept)
                entropy = -sum(p * math.log(p) for p in probs if p > 0.0)
                low = max(0.0, settings.temperature - settings.dynatemp_range)
                high = settings.temperature + settings.dynatemp_range
                temperature = low + (high - low) * (entropy / math.log(count)) ** settings.dynatemp_exponent
                temperature = max(temperature, 1e-30)  # at 0 the row's argmax alone (its entropy is 0)
        elif name == "top_k" and 0 < settings.top_k:
            # the k likeliest of the tokens kept, every token tied with the k-th too
            candidates = sorted((logits[token] for token in range(vocab) if kept[token]), reverse=True)
            if settings.top_k < len(candidates):
                kth_largest = candidates[settings.top_k - 1]
                kept = [kept[token] and logits[token] >= kth_largest for token in range(vocab)]
            count = min(count, settings.top_k)
        elif name == "top_p" and settings.top_p < 1.0:
            # Most likely first (ties: the lower id first); keep a token while the mass of the
            # tokens before it is still short of top_p, so the one that crosses it is kept.
            probs = _softmax(logits, temperature, kept)
            kept, mass_before = [False] * vocab, 0.0
            for token in sorted(range(vocab), key=lambda t: (-probs[t], t)):
                if mass_before >= settings.top_p or probs[token] == 0.0:
                    break
                kept[token] = True
                mass_before += probs[token]
            count = sum(kept)
        elif name == "min_p" and settings.min_p > 0.0:
            probs = _softmax(logits, temperature, kept)
            floor = settings.min_p * max(probs)
            kept = [p > 0.0 and p >= floor for p in probs]
            count = sum(kept)
        elif name == "top_n_sigma" and settings.top_n_sigma > 0.0:
            # the finite logits kept: their mean and standard deviation (over their count)
            values = [logits[token] for token in range(vocab) if kept[token] and math.isfinite(logits[token])]
            if len(values) > 1:
                mean = sum(values) / len(values)
                sigma = math.sqrt(sum((value - mean) ** 2 for value in values) / len(values))
                floor = max(values) - settings.top_n_sigma * sigma
                kept = [kept[token] and math.isfinite(logits[token]) and logits[token] >= floor
                        for token in range(vocab)]
        elif name == "typ_p" and settings.typical_p < 1.0:
            # nearest the entropy first (ties: the lower id first); keep until the mass taken
            # passes typical_p, the token that passes it kept
            probs = _softmax(logits, temperature, kept)
            entropy = -sum(p * math.log(p) for p in probs if p > 0.0)
            ranked = sorted((t for t in range(vocab) if probs[t] > 0.0),
                            key=lambda t: (abs(-math.log(probs[t]) - entropy), t))
            kept, taken = [False] * vocab, 0.0
            for token in ranked:
                kept[token] = True
                taken += probs[token]
                if taken > settings.typical_p:
                    break
            count = sum(kept)
        elif name == "xtc" and settings.xtc_on:
            # with its probability: the tokens at the threshold dropped but the least likely of
            # them (ties: the highest id), where two or more reach it
            probs = _softmax(logits, temperature, kept)
            above = [token for token in range(vocab) if probs[token] >= settings.xtc_threshold]
            if len(above) >= 2:
                spared = min(above, key=lambda token: (probs[token], -token))
                cut = [kept[token] and (token == spared or token not in above) for token in range(vocab)]
                rest = names[at + 1:]
                chance = settings.xtc_probability
                return [(1.0 - chance) * as_is + chance * after_cut for as_is, after_cut in
                        zip(_sampled(logits, settings, rest, kept, temperature, count),
                            _sampled(logits, settings, rest, cut, temperature, count - len(above) + 1))]
    return _softmax(logits, temperature, kept)


def mirostat_distribution(logits: Sequence[float], settings: SamplingSettings, mu: float) -> list[float]:
    """The next-token distribution of one row under mirostat at ``mu``: softmax at the temperature,
    then version 2 keeps the tokens whose surprise -log2 p is at most μ (the likeliest alone where
    none is), version 1 the k likeliest (every token tied with the k-th too), k from μ and the
    Zipf exponent of the likeliest 100 (mirostat's paper, as llama.cpp computes it)."""
    logits = [float(value) for value in (logits.tolist() if hasattr(logits, "tolist") else logits)]
    vocab = len(logits)
    probs = _softmax(logits, settings.temperature, [True] * vocab)
    ranked = sorted(range(vocab), key=lambda t: (-probs[t], t))
    if settings.mirostat.version == 2:
        kept = [p > 0.0 and -math.log2(p) <= mu for p in probs]
        if not any(kept):
            kept[ranked[0]] = True
        return _normalise([p if keep else 0.0 for p, keep in zip(probs, kept)])
    top = [probs[t] for t in ranked[:100]]
    k = 1  # where the fit is undefined: a probability llama.cpp's float32 holds as 0 among the likeliest 100
    if len(top) >= 2 and min(top) >= 1.4e-45 and mu > -math.inf:
        steps = [math.log((i + 2) / (i + 1)) for i in range(len(top) - 1)]
        s_hat = (sum(t * math.log(top[i] / top[i + 1]) for i, t in enumerate(steps))
                 / sum(t * t for t in steps))
        try:
            k_real = ((s_hat - 1.0) * 2.0 ** mu / (1.0 - vocab ** -(s_hat - 1.0))) ** (1.0 / s_hat)
            k = max(1, min(vocab, int(k_real))) if not math.isnan(k_real) else 1
        except ZeroDivisionError:  # an even row: undefined, the likeliest alone
            k = 1
        except OverflowError:  # past any row: every token
            k = vocab
    kth = probs[ranked[k - 1]]
    return _normalise([p if p >= kth else 0.0 for p in probs])


def mirostat_moved(mu: float, settings: SamplingSettings, row: Sequence[float], token: int) -> float:
    """μ after ``token`` drawn from ``row``: less η times (its surprise in bits less τ)."""
    if row[token] <= 0.0:
        return -math.inf
    return mu - settings.mirostat.eta * (-math.log2(row[token]) - settings.mirostat.tau)


def adaptive_distribution(logits: Sequence[float], settings: SamplingSettings,
                          average: tuple[float, float]) -> tuple[list[float], list[float]]:
    """adaptive-p's row at ``average`` (weighted sum, total weight): the rest of the chain's
    distribution, and that one reshaped, each candidate at logit 5 - 10 d² / (1 + d),
    d = |p - t'| / 0.3, t' = 2 t - the average, within [0, 1]."""
    original = distribution(logits, dataclasses.replace(settings, adaptive_p=AdaptiveP()))
    cutting = any(name in settings.chain for name in ("top_k", "top_p", "min_p", "typ_p", "top_n_sigma", "xtc", "infill"))
    # the candidates: those the chain kept, or where nothing cuts every finite logit (llama.cpp's, a
    # probability float64 holds as 0 among them)
    candidates = [p > 0.0 if cutting else math.isfinite(float(value)) for p, value in zip(original, logits)]
    weighted_sum, total_weight = average
    target = settings.adaptive_p.target
    adapted = min(1.0, max(0.0, target if total_weight == 0.0 else 2.0 * target - weighted_sum / total_weight))
    reshaped = []
    for p, candidate in zip(original, candidates):
        d = abs(p - adapted) / 0.3
        reshaped.append(5.0 - 10.0 * d * d / (1.0 + d) if candidate else -math.inf)
    top = max(reshaped)
    return original, _normalise([math.exp(value - top) if value > -math.inf else 0.0 for value in reshaped])


def state_rows(table: Callable[[tuple[int, ...]], Sequence[float]], prompt: Sequence[int],
               settings: SamplingSettings) -> Callable[[tuple[int, ...]], list[float]]:
    """``row(output)``: the distribution after ``prompt`` then ``output`` under a sampler that carries
    a state along the text, from its start moved by each token of the output: mirostat's μ (from 2τ,
    by the token's surprise under the row drawn from), adaptive-p's average (from its target, by the
    token's probability before the reshaping)."""
    import functools

    @functools.cache
    def state(output: tuple[int, ...]):
        logits = table(tuple(prompt) + output)
        if settings.mirostat.on:
            if not output:
                mu = 2.0 * settings.mirostat.tau
            else:
                parent_row, parent_mu = state(output[:-1])
                mu = mirostat_moved(parent_mu, settings, parent_row, output[-1])
            return mirostat_distribution(logits, settings, mu), mu
        if not output:
            average = (settings.adaptive_p.target / (1.0 - settings.adaptive_p.decay),
                       1.0 / (1.0 - settings.adaptive_p.decay))
        else:
            _, (parent_original, parent_average) = state(output[:-1])
            decay = settings.adaptive_p.decay
            average = (parent_original[output[-1]] + decay * parent_average[0], 1.0 + decay * parent_average[1])
        original, row = adaptive_distribution(logits, settings, average)
        return row, (original, average)

    return lambda output: state(tuple(output))[0]


def _softmax(logits: list[float], temperature: float, kept: list[bool]) -> list[float]:
    """softmax(logits / temperature) over the tokens kept, 0 elsewhere."""
    top = max(value for value, keep in zip(logits, kept) if keep) / temperature
    exp = math.exp
    return _normalise([exp(value / temperature - top) if keep else 0.0 for value, keep in zip(logits, kept)])


def _normalise(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def exact_joint(
    table: Callable[[tuple[int, ...]], Sequence[float]],
    prompt: Sequence[int],
    n_tokens: int,
    settings: SamplingSettings,
) -> dict[tuple[int, ...], float]:
    """Probability of every ``n_tokens`` continuation of ``prompt`` under the target's own
    sampling, ``table(context)`` giving the target's logits. Sequences of probability 0
    are listed too (a test must never see them)."""
    if settings.carries_state:  # each row by the state its text reached (mirostat's μ, adaptive-p's average)
        row = state_rows(table, prompt, settings)
        return joint_of(lambda context: row(context[len(prompt):]), prompt, n_tokens)
    joint: dict[tuple[int, ...], float] = {}

    def extend(context: tuple[int, ...], prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == n_tokens:
            joint[prefix] = prob
            return
        for token, p_token in enumerate(distribution(table(context), settings)):
            extend(context + (token,), prefix + (token,), prob * p_token)

    extend(tuple(prompt), (), 1.0)
    return joint


def joint_of(row: Callable[[tuple[int, ...]], Sequence[float]], prompt: Sequence[int],
             n_tokens: int) -> dict[tuple[int, ...], float]:
    """Probability of every ``n_tokens`` continuation of ``prompt`` that plain decoding can make,
    ``row(context)`` giving its distribution after a context (one a rule of its own shapes: the
    infill rule, penalties, which read the text)."""
    joint: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == n_tokens:
            joint[prefix] = prob
            return
        for token, p_token in enumerate(row(tuple(prompt) + prefix)):
            if p_token > 0.0:
                extend(prefix + (token,), prob * p_token)

    extend((), 1.0)
    return joint
