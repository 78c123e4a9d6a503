"""llama-server's own endpoints (server/native.py), as editors' plugins call them: /infill with
the chunks of other files llama.vim and llama.vscode send, /completion, n_predict 0 to warm the
cache, n_indent and t_max_predict_ms, ``samplers`` and ``response_fields``; answers in
llama-server's shape, speculating as every request does and equal to plain decoding of the same
prompt; every bad field a 400 naming it."""

from __future__ import annotations

import asyncio
import json

import pytest

from model_factory import REPO_TOKENS, build_fim_model
from server_harness import start_server, stop_server
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.registry.loading import LoadOptions
from specrun.penalties import Penalties
from specrun.dry import Dry
from specrun.adaptive_p import AdaptiveP
from specrun.mirostat import Mirostat
from specrun.sampling import SAMPLER_ORDER, SamplingSettings
from specrun.server.native import parse_native_request, picked, stop_type
from specrun.server.requests import RequestError, ServeDefaults, parse_chat_request
from specrun.server.worker import Delta, Done, Failed, Job, LineLimits, PairOptions, PairWorker, Started, StopCut
from specrun.sessions.infill import Fill, FillTooLongError, FimTokens, fill_prompt, fim_tokens

PREFIX = "def read_config(path):\n    with open(path) as f:\n"
MIDDLE = "        con"
SUFFIX = "\n    return config\n"
EXTRA = (("util.py", "def load(path):\n    return open(path).read()\n"), ("main.py", "import util\n"))


@pytest.fixture(scope="module")
def repo_model(tmp_path_factory):
    return build_fim_model(tmp_path_factory.mktemp("fim-repo"), repo=True)


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    return build_fim_model(tmp_path_factory.mktemp("fim"))


def _llama(model):
    pytest.importorskip("llama_cpp")
    from specrun.backends.llama import LlamaCppBackend

    return LlamaCppBackend(model.gguf_f32_path, n_threads=1, gpu_layers=0, flash_attn=False)


def _mlx(model):
    pytest.importorskip("mlx_lm")
    from specrun.backends.mlx import MlxBackend

    return MlxBackend(model.hf_dir)


# ---- the prompt -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "mlx"])
def test_a_fill_with_chunks_is_laid_out_as_a_repository_with_the_model_s_own_tokens(repo_model, kind):
    backend = _llama(repo_model) if kind == "llama" else _mlx(repo_model)
    try:
        fim = fim_tokens(backend)
        repo, sep = (backend.tokenize(text, add_bos=False, special=True)[0] for text in REPO_TOKENS)
        assert (repo, sep) == (515, 516)

        def tok(text):
            return backend.tokenize(text, add_bos=False)

        ids, cut = fill_prompt(backend, Fill(PREFIX, SUFFIX, MIDDLE, EXTRA), 512)
        assert not cut
        assert ids == [backend.vocab.bos_id, repo, *tok("myproject\n"),
                       sep, *tok("util.py\n"), *tok(EXTRA[0][1]), sep, *tok("main.py\n"), *tok(EXTRA[1][1]),
                       sep, *tok("filename\n"),
                       fim.prefix, *tok(PREFIX), *tok(MIDDLE), fim.suffix, *tok(SUFFIX), fim.middle]
    finally:
        backend.close()


def test_without_repository_tokens_each_chunk_follows_a_snippet_line(fim_model):
    backend = _llama(fim_model)
    try:
        fim = fim_tokens(backend)
        ids, _ = fill_prompt(backend, Fill(PREFIX, SUFFIX, "", EXTRA[:1]), 512)
        snippet = backend.tokenize("\n\n--- snippet ---\n\n", add_bos=False)
        assert ids == [backend.vocab.bos_id, *snippet, *backend.tokenize(EXTRA[0][1], add_bos=False), fim.prefix,
                       *backend.tokenize(PREFIX, add_bos=False), fim.suffix, *backend.tokenize(SUFFIX, add_bos=False),
                       fim.middle]
    finally:
        backend.close()


def test_each_part_keeps_its_share_of_the_context_so_the_chunks_kept_do_not_move_with_the_cursor(repo_model):
    """llama-server's shares: the text around the cursor half the context (three quarters of it
    the prefix's, a quarter less the cursor line the suffix's), an eighth the answer's, the rest
    the chunks', newest first and whole. They depend on the context alone: a plugin's warm-up
    (n_predict 0) and each keystroke after it keep the same chunks, which the cache then holds."""
    backend = _llama(repo_model)
    try:
        fim = fim_tokens(backend)
        assert (fim.repo, fim.separator) == (515, 516)
        chunks = tuple((f"f{i}.py", f"def f{i}(x):\n    return x * {i}\n" * 4) for i in range(12))
        long = Fill("a = 1\n" * 200, "b = 2\n" * 200, "x", chunks)
        ids, cut = fill_prompt(backend, long, 512)
        assert cut and len(ids) <= 512 - 64  # the answer's eighth left
        before = ids[ids.index(fim.prefix) + 1: ids.index(fim.suffix)]
        after = ids[ids.index(fim.suffix) + 1: -1]
        x = backend.tokenize("x", add_bos=False)
        prefix_ids = backend.tokenize(long.prefix, add_bos=False)
        assert before == prefix_ids[-(3 * 256 // 4):] + x  # the prefix's end, three quarters of 256
        assert after == backend.tokenize(long.suffix, add_bos=False)[: 256 // 4 - 2 - len(x)]  # the suffix's start
        kept = ids[: ids.index(fim.prefix)]
        current = [516, *backend.tokenize("filename\n", add_bos=False)]
        assert kept.count(516) >= 3 and kept[-len(current):] == current
        # whole chunks, the newest: each kept chunk's text is there entire, the oldest dropped
        texts = [backend.tokenize(text, add_bos=False) for _, text in chunks]
        held = [_holds(kept, text) for text in texts]
        assert held[-1] and not held[0] and held == sorted(held)
        # the chunks kept are the same tokens whatever the cursor line and the text around it
        for other in (Fill("", "", "", chunks), Fill("c = 3\n" * 90, "", "    ret", chunks),
                      Fill("z\n", "w\n" * 500, "", chunks)):
            moved, _ = fill_prompt(backend, other, 512)
            assert moved[: len(kept)] == kept
        small = Fill("p\n", "s\n", "", EXTRA)
        assert fill_prompt(backend, small, 512) == (fill_prompt(backend, small, 4096)[0], False)
        with pytest.raises(FillTooLongError, match="cursor line"):
            fill_prompt(backend, Fill("", "", "y" * 700), 256)
    finally:
        backend.close()


def test_llama_cpp_s_own_finding_of_the_fill_tokens_is_used():
    """On llama.cpp the tokens are the ones llama.cpp found (the GGUF's ids, its spellings of
    CodeLlama, GLM, Granite…), which llama-server uses; elsewhere the spellings."""
    class Declared:
        def fill_token_ids(self):
            return {"prefix": 7, "suffix": 8, "middle": 9, "separator": 11}

    class Partial:
        def fill_token_ids(self):
            return {"prefix": 7, "repo": 10}

    assert fim_tokens(Declared()) == FimTokens(7, 8, 9, None, 11)
    assert fim_tokens(Partial()) is None


def _holds(ids, part):
    return any(ids[at: at + len(part)] == part for at in range(len(ids)))


# ---- the limits -------------------------------------------------------------------------
def _limited(pieces, indent=0, seconds=0.0, clock=None):
    limits = LineLimits(indent, seconds, clock or (lambda: 0.0))
    out = "".join(limits.feed(piece) for piece in pieces)
    return out + ("" if limits.stopped else limits.flush()), limits.stopped


def test_n_indent_ends_the_answer_before_a_line_indented_less_holding_each_line_s_indentation():
    answer = ["fig = 1\n", "    ", "    a = 2\n  ", "  b = 3\n", "  c = 4\n", "d = 5\n"]
    assert _limited(answer, indent=4) == ("fig = 1\n        a = 2\n    b = 3\n  ", "indent")  # as llama-server
    assert _limited(answer, indent=0) == ("".join(answer), "")
    assert _limited(["x\n", "\n", "    y\n"], indent=4) == ("x\n", "indent")  # an empty line counts as none
    assert _limited(["  first line is never judged\n", "    z"], indent=4) == (
        "  first line is never judged\n    z", "")
    assert _limited(["x\n  "], indent=4) == ("x\n  ", "")  # the answer ended inside the indentation: let out


def test_t_max_predict_ms_ends_the_answer_at_the_first_newline_past_the_time():
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    limits = LineLimits(0, 0.5, clock)
    assert limits.feed("a = 1\nb") == "a = 1\nb"
    now[0] = 0.6
    assert limits.feed(" = 2") == " = 2" and not limits.stopped  # no newline yet
    assert limits.feed("\nc = 3\n") == "\n" and limits.stopped == "time"
    assert limits.feed("more") == ""


def test_the_stop_string_that_stopped_an_answer_is_named():
    cut = StopCut(["</s>", "\n\n"])
    assert cut.feed("a\n\nb</s>") == "a" and cut.word == "\n\n"
    assert stop_type("stop", "word") == "word" and stop_type("stop", "") == "eos"
    assert stop_type("length", "") == stop_type("stop", "indent") == stop_type("length", "time") == "limit"


# ---- requests ---------------------------------------------------------------------------
LLAMA_VIM = {  # what llama.vim sends for a fill (its response_fields, its samplers)
    "id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX,
    "input_extra": [{"text": text, "time": [1, 2], "filename": name} for name, text in EXTRA],
    "prompt": MIDDLE, "n_predict": 16, "stop": [], "n_indent": 8, "top_k": 40, "top_p": 0.90,
    "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500,
    "t_max_predict_ms": 1000, "model": " ",
    "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n",
                        "timings/predicted_per_second", "truncated", "tokens_cached"],
}


def _native(body, infill=True):
    return parse_native_request(body, ServeDefaults(), 4096, "served", infill)


def test_llama_vim_s_fill_is_read_with_its_samplers_and_limits():
    request, fields = _native(LLAMA_VIM)
    assert request.fill == Fill(PREFIX, SUFFIX, MIDDLE, EXTRA)
    assert request.model == "served" and request.max_tokens == 16 and request.indent == 8
    assert request.line_seconds == 1.0 and fields == tuple(LLAMA_VIM["response_fields"])
    # the samplers listed are on; temperature is not listed, so it is 1 (as llama.cpp samples)
    assert request.sampling == SamplingSettings(1.0, 40, 0.9, 0.0, None, infill=True)
    warm, _ = _native({**LLAMA_VIM, "n_predict": 0, "samplers": [], "t_max_predict_ms": 1})
    assert warm.max_tokens == 0 and warm.sampling == SamplingSettings(1.0)
    whole, _ = _native({**LLAMA_VIM, "n_predict": -1})
    assert whole.max_tokens == 4096
    letters, _ = _native({**LLAMA_VIM, "samplers": "edkypmxt", "temperature": 0.3, "min_p": 0.05})
    assert letters.sampling == SamplingSettings(0.3, 40, 0.9, 0.05)
    plain, _ = _native({"prompt": "Once upon", "n_predict": 4}, infill=False)
    assert plain.prompt == "Once upon" and plain.fill is None and plain.sampling == SamplingSettings()


def test_the_samplers_apply_in_the_order_listed():
    """llama-server applies its chain in the list's order: specrun's samplers follow it (a list in
    llama.cpp's default order, or none, is that order: truncation first, the temperature last)."""
    first, _ = _native({**LLAMA_VIM, "samplers": ["temperature", "top_k", "top_p"], "temperature": 0.5})
    assert first.sampling.order == ("temperature", "top_k", "top_p")
    assert first.sampling.chain == ("temperature", "top_k", "top_p")  # no infill listed: off
    letters, _ = _native({**LLAMA_VIM, "samplers": "pkti", "temperature": 0.5})
    assert letters.sampling.order == ("top_p", "top_k", "temperature", "infill")
    assert letters.sampling.chain == ("top_p", "top_k", "temperature", "infill")
    # typical-p and top-n-sigma: on where set (and listed, where a list is sent)
    typical, _ = _native({**LLAMA_VIM, "samplers": "ysk", "typical_p": 0.8, "top_n_sigma": 2})
    assert (typical.sampling.typical_p, typical.sampling.top_n_sigma) == (0.8, 2.0)
    assert typical.sampling.chain == ("typ_p", "top_n_sigma", "top_k")
    unlisted, _ = _native({**LLAMA_VIM, "typical_p": 0.8, "top_n_sigma": 2})  # llama.vim's list names neither
    assert (unlisted.sampling.typical_p, unlisted.sampling.top_n_sigma) == (1.0, 0.0)
    off, _ = _native({**LLAMA_VIM, "samplers": "s", "top_n_sigma": -1})  # llama-server's default: off
    assert off.sampling.top_n_sigma == 0.0
    # XTC: on where its probability is above 0 (and listed, where a list is sent); its threshold
    # read only then (0 or less would leave each row's least likely token)
    xtc, _ = _native({**LLAMA_VIM, "samplers": "kxi", "xtc_probability": 0.5, "xtc_threshold": 0.2})
    assert (xtc.sampling.xtc_probability, xtc.sampling.xtc_threshold, xtc.sampling.chain) == (0.5, 0.2, (
        "top_k", "xtc", "infill"))
    unlisted, _ = _native({**LLAMA_VIM, "xtc_probability": 0.5})
    assert not unlisted.sampling.xtc_on
    inert, _ = _native({**LLAMA_VIM, "samplers": "kxi", "xtc_probability": 0, "xtc_threshold": 0})
    assert not inert.sampling.xtc_on
    # dynamic temperature: on where its range is above 0 (the temperature's place in the list); a
    # range of 0 or less is off, as llama-server reads it
    dynamic, _ = _native({**LLAMA_VIM, "samplers": "kti", "temperature": 0.8, "dynatemp_range": 0.5,
                          "dynatemp_exponent": 2})
    assert (dynamic.sampling.dynatemp_range, dynamic.sampling.dynatemp_exponent) == (0.5, 2.0)
    assert dynamic.sampling.dynatemp_on and dynamic.sampling.chain == ("top_k", "temperature", "infill")
    assert not _native({**LLAMA_VIM, "dynatemp_range": -1})[0].sampling.dynatemp_on
    # off at temperature 0 (the argmax) and where a list leaves the temperature out; its exponent
    # read only where it is on, as llama-server reads it
    for fields in ({"temperature": 0, "dynatemp_range": 0.5}, {"samplers": "k", "dynatemp_range": 0.5},
                   {"dynatemp_exponent": -1}, {"dynatemp_exponent": 500}):
        assert _native({**LLAMA_VIM, **fields})[0].sampling.dynatemp_range == 0.0
    for fields, message in (({"dynatemp_range": 150}, r"dynatemp_range: must be at most 100 \(0 or less: off\)"),
                            ({"samplers": "kti", "temperature": 0.8, "dynatemp_range": 0.5, "dynatemp_exponent": -0.5},
                             r"dynatemp_exponent: must be in \[0, 100\], got -0.5")):
        with pytest.raises(RequestError, match=message):
            _native({**LLAMA_VIM, **fields})
    # mirostat: 1 or 2 on, whatever a list names (llama.cpp's chain under it: the temperature, then
    # mirostat); its target and rate read only where it is on, as llama-server reads them
    miro, _ = _native({**LLAMA_VIM, "samplers": "k", "temperature": 0.8, "mirostat": 2, "mirostat_tau": 3,
                       "mirostat_eta": 0.2})
    assert miro.sampling.mirostat == Mirostat(2, 3.0, 0.2) and miro.sampling.mirostat_on
    assert miro.sampling.temperature == 0.8 and miro.sampling.chain == ("temperature",)
    off, _ = _native({**LLAMA_VIM, "mirostat": 0, "mirostat_tau": -5})  # echoed, as llama-server echoes it
    assert off.sampling.mirostat == Mirostat(0, -5.0, 0.1) and not off.sampling.mirostat_on
    # the penalties and DRY off under it, as in llama.cpp's chain; a bias kept
    shaped, _ = _native({**LLAMA_VIM, "mirostat": 2, "repeat_penalty": 1.3, "samplers": ["penalties", "dry", "top_k"],
                         "dry_multiplier": 0.8, "logit_bias": [[5, -1.0]]})
    assert not shaped.sampling.penalties.on and not shaped.sampling.dry.on
    assert shaped.sampling.logit_bias == ((5, -1.0),)
    assert not _native({**LLAMA_VIM, "mirostat": 1, "temperature": 0})[0].sampling.mirostat_on  # the argmax
    # adaptive-p: on where its target is 0 or more and the list names it (llama-server's default list
    # does not); its ranges read only where on
    adaptive, _ = _native({**LLAMA_VIM, "samplers": ["min_p", "temperature", "adaptive_p"], "min_p": 0.05,
                           "temperature": 0.8, "adaptive_target": 0.4, "adaptive_decay": 0.8})
    assert adaptive.sampling.adaptive_p == AdaptiveP(0.4, 0.8) and adaptive.sampling.adaptive_on
    for fields in ({"adaptive_target": 0.4}, {"samplers": "kt", "adaptive_target": 0.4},
                   {"samplers": "ka", "adaptive_target": -1, "adaptive_decay": 5}):  # unlisted, off
        fields["temperature"] = 0.8
        assert not _native({**LLAMA_VIM, **fields})[0].sampling.adaptive_on
    # DRY: on where its multiplier is above 0 (and listed, where a list is sent), after the penalties
    dry, _ = _native({**LLAMA_VIM, "samplers": ["dry", "top_k", "infill"], "dry_multiplier": 0.8, "dry_base": 0.5,
                      "dry_allowed_length": 3, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", "###"]})
    assert dry.sampling.dry == Dry(0.8, 1.75, 3, -1, ("\n", "###"))  # a base under 1: the server's
    assert not _native({**LLAMA_VIM, "dry_multiplier": 0.8})[0].sampling.dry.on  # llama.vim's list leaves it out
    # llama.cpp's default list, the penalties off: taken
    listed, _ = _native({**LLAMA_VIM, "samplers": "edskypmxt", "dry_multiplier": 0.8})
    assert listed.sampling.dry.on and listed.sampling.order == SAMPLER_ORDER
    for fields, message in (({"dry_multiplier": -1}, r"dry_multiplier: must be in \[0, 100\]"),
                            ({"dry_sequence_breakers": []}, "must be a non-empty array of non-empty strings"),
                            ({"dry_penalty_last_n": -2}, "dry_penalty_last_n: must be -1"),
                            ({"samplers": ["top_k", "dry"]}, "list dry before the other samplers")):
        with pytest.raises(RequestError, match=message):
            _native({**LLAMA_VIM, "samplers": ["dry", "top_k"], "dry_multiplier": 0.8, **fields})
    for fields, message in (({"xtc_probability": 1.5}, r"xtc_probability: must be in \[0, 1\], got 1.5"),
                            ({"xtc_probability": 0.5, "xtc_threshold": 0}, r"xtc_threshold: must be above 0")):
        with pytest.raises(RequestError, match=message):
            _native({**LLAMA_VIM, "samplers": "kxi", **fields})
    default, _ = _native({**LLAMA_VIM, "samplers": "edkypmxti", "temperature": 0.5})
    assert default.sampling.order == SAMPLER_ORDER and default.sampling.chain == ("top_k", "top_p", "temperature",
                                                                                   "infill")
    for twice in (["temperature", "top_k", "temperature"], "kppt"):
        with pytest.raises(RequestError, match="listed more than once; specrun applies each sampler once"):
            _native({**LLAMA_VIM, "samplers": twice})
    # `serve --samplers`: the order of a request that lists none
    served = ServeDefaults(sampling=SamplingSettings(0.7, order=("temperature", "top_k", "top_p", "min_p")))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(chat, served, 2048).sampling.order == ("temperature", "top_k", "top_p", "min_p")
    # `serve --samplers` as llama-server reads its own: a request without a list of its own leaves out
    # what the server's leaves out
    listing = ServeDefaults(sampling=SamplingSettings(0.7, order=("temperature", "top_k")),
                            samplers=("temperature", "top_k"))
    read = parse_chat_request({**chat, "typical_p": 0.5, "top_p": 0.9, "top_k": 5}, listing, 2048).sampling
    assert (read.typical_p, read.top_p, read.top_k, read.chain) == (1.0, 1.0, 5, ("temperature", "top_k"))
    for field, value, message in (("typical_p", 1.5, r"typical_p: must be in \[0, 1\], got 1.5"),
                                  ("top_n_sigma", "wide", "top_n_sigma must be a number")):
        with pytest.raises(RequestError, match=message):
            parse_chat_request({**chat, field: value}, served, 2048)
    assert parse_chat_request({**chat, "samplers": "kpmt"}, served, 2048).sampling.order == SAMPLER_ORDER


def test_llama_vscode_s_chat_edit_fields_are_taken():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False, "cache_prompt": True,
            "samplers": "edkypmxt", "temperature": 0.8, "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40,
            "top_p": 0.95, "min_p": 0.05, "typical_p": 1, "xtc_probability": 0, "xtc_threshold": 0.1,
            "repeat_last_n": 64, "repeat_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0,
            "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
            "max_tokens": -1, "timings_per_token": False}
    request = parse_chat_request(body, ServeDefaults(), 2048)
    assert request.max_tokens == 2048 and request.sampling == SamplingSettings(0.8, 40, 0.95, 0.05)
    # penalties ("e" listed) are taken at any value now (tests/server/test_serve_penalties.py)
    penalised = parse_chat_request({**body, "repeat_penalty": 1.1}, ServeDefaults(), 2048)
    assert penalised.sampling.penalties == Penalties(repeat=1.1, last_n=64)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"input_prefix": None}, "input_prefix", "input_prefix is required"),
    ({"input_suffix": 3}, "input_suffix", "input_suffix must be a string"),
    ({"input_extra": {"text": "x"}}, "input_extra", "must be a list"),
    ({"input_extra": [{"filename": "a.py"}]}, "input_extra[0]", '"text" string'),
    ({"input_extra": [{"text": "x", "filename": 4}]}, "input_extra[0].filename", "must be a string"),
    ({"input_extra": [{"text": "\ud800"}]}, "input_extra[0].text", "lone surrogate"),
    ({"prompt": ["a"]}, "prompt", "cursor line"),
    ({"n_predict": -2}, "n_predict", "must be -1 (until the context is full) or in [0,"),
    ({"n_indent": -1}, "n_indent", "must be in [0,"),
    ({"t_max_predict_ms": "soon"}, "t_max_predict_ms", "must be a number"),
    ({"samplers": ["top_k", "mirror"]}, "samplers", '"mirror" names no sampler'),
    ({"samplers": "kz"}, "samplers", '"z" names no sampler'),
    ({"samplers": 7}, "samplers", "a list of sampler names"),
    ({"samplers": ["top_k", "adaptive_p"], "adaptive_target": 1.5}, "adaptive_target", "must be in [0, 1], got 1.5"),
    ({"samplers": "ka", "adaptive_target": 0.5, "adaptive_decay": 1}, "adaptive_decay", "must be in [0, 0.99], got 1"),
    ({"samplers": "kxa", "adaptive_target": 0.5, "xtc_probability": 0.5}, "adaptive_target",
     "adaptive-p beside XTC (xtc_probability) is not supported"),
    ({"response_fields": "content"}, "response_fields", "a list of field paths"),
    ({"model": 5}, "model", "must be a string"),
    ({"mirostat": 3}, "mirostat", "must be 0 (off), 1 or 2, got 3"),
    ({"mirostat": 2, "mirostat_tau": -1}, "mirostat_tau", "must be in [0, 100], got -1"),
    ({"mirostat": 1, "mirostat_eta": 2}, "mirostat_eta", "must be in [0, 1], got 2"),
    ({"mirostat_eta": "fast"}, "mirostat_eta", "must be a number"),
    ({"lora": [{"id": 0, "scale": 0.5}]}, "lora", "not supported"),
    ({"slot_id": 0}, "slot_id", "unrecognized"),
])
def test_bad_native_fields_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(RequestError) as refused:
        _native({**LLAMA_VIM, **fields})
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    assert message in refused.value.message


def test_response_fields_keep_each_path_asked_for_under_its_path():
    answer = {"content": "x", "timings": {"prompt_n": 3, "predicted_n": 2}, "truncated": False}
    assert picked(answer, ["content", "timings/prompt_n", "timings/missing", "nothing"]) == {
        "content": "x", "timings/prompt_n": 3}
    assert picked(answer, []) == answer


# ---- the worker -------------------------------------------------------------------------
def _events(worker, request):
    async def ask():
        job = Job(request, asyncio.get_running_loop())
        worker.submit(job)
        events = []
        while not isinstance(event := await job.next_event(), (Done, Failed)):
            events.append(event)
        return [*events, event]

    return asyncio.run(ask())


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_fill_speculates_and_answers_what_plain_decoding_of_its_prompt_answers(repo_model, parallel):
    backend = _llama(repo_model)
    fill = Fill(PREFIX, SUFFIX, MIDDLE, EXTRA)
    try:
        ids, _ = fill_prompt(backend, fill, 512)
        plain = SpeculativeEngine(backend, None, method="none").run(ids, GenerationParams(24, 0))
    finally:
        backend.close()
    worker = PairWorker(PairOptions(str(repo_model.gguf_f32_path), None, method="lookup", parallel=parallel,
                                    load=LoadOptions(threads=1, exact=True)))
    worker.start()
    try:
        request, _ = _native({**LLAMA_VIM, "n_predict": 24, "samplers": ["temperature"], "temperature": 0,
                              "n_indent": 0, "t_max_predict_ms": 0})
        events = _events(worker, request)
        started, done = events[0], events[-1]
        assert isinstance(started, Started) and started.prompt_tokens == len(ids) and not started.prompt_cut
        assert isinstance(done, Done)
        assert "".join(e.text for e in events if isinstance(e, Delta)) == plain.text
        # n_predict 0 reads a prompt into the cache and answers nothing; the next request reuses it
        warm, _ = _native({**LLAMA_VIM, "input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 0,
                           "input_extra": [{"text": "def other():\n    pass\n" * 8, "filename": "other.py"}]})
        events = _events(worker, warm)
        assert isinstance(events[-1], Done) and events[-1].stats.new_tokens == 0
        assert not any(isinstance(e, Delta) and e.text for e in events)
        after, _ = _native({**LLAMA_VIM, "n_predict": 2, "input_extra": warm.fill and
                            [{"text": text, "filename": name} for name, text in warm.fill.extra]})
        started = _events(worker, after)[0]
        assert started.reused_tokens > 40  # the chunk read by the warm request
    finally:
        worker.stop()


# ---- over HTTP --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fim_server(repo_model):
    pytest.importorskip("llama_cpp")
    server = start_server("--target", str(repo_model.gguf_f32_path), "--method", "lookup", "--exact",
                          "--threads", "1")
    yield server
    assert stop_server(server) == 0, server.log


def test_llama_vim_s_fill_gets_llama_server_s_answer_with_only_the_fields_it_asked_for(fim_server):
    status, answer = fim_server.post("/infill", LLAMA_VIM)
    assert status == 200, answer
    assert set(answer) == set(LLAMA_VIM["response_fields"])
    assert isinstance(answer["content"], str) and answer["truncated"] is False
    assert answer["tokens_cached"] >= answer["timings/prompt_n"] > 0
    status, whole = fim_server.post("/infill", {**LLAMA_VIM, "response_fields": None, "n_indent": 0,
                                                "t_max_predict_ms": 0})
    assert status == 200
    assert whole["stop"] is True and whole["stop_type"] in ("eos", "limit") and whole["model"]
    assert whole["timings"]["cache_n"] > 0  # the same chunks and prefix: read from the cache
    assert whole["tokens_predicted"] == whole["timings"]["predicted_n"] == whole["speculation"]["new_tokens"]
    if whole["speculation"]["drafted"]:
        assert whole["timings"]["draft_n"] == whole["speculation"]["drafted"]


def test_a_completion_streams_in_llama_server_s_shape_and_ends_without_done(fim_server):
    import http.client

    host, port = fim_server.host_port
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        connection.request("POST", "/completion", body=json.dumps(
            {"prompt": "def main():\n", "n_predict": 12, "stream": True, "stop": ["zzz"],
             "response_fields": ["content", "stop", "stop_type", "timings/predicted_n"]}),
            headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        lines = [line for line in response.read().decode().split("\n") if line]
    finally:
        connection.close()
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert all(line.startswith("data: {") for line in lines)  # no [DONE]
    *chunks, last = events
    assert all(chunk["stop"] is False and "content" in chunk for chunk in chunks)
    assert last == {"content": "", "stop": True, "stop_type": last["stop_type"],
                    "timings/predicted_n": last["timings/predicted_n"]}
    assert last["stop_type"] in ("eos", "limit") and last["timings/predicted_n"] >= 1


def test_bad_native_requests_are_400s_and_the_server_serves_on(fim_server):
    for path, body, param in (("/infill", {"input_suffix": ""}, "input_prefix"),
                              ("/completion", {"prompt": "x", "samplers": ["mirror"]}, "samplers"),
                              ("/completion", {"n_predict": 3}, "prompt")):
        status, answer = fim_server.post(path, body)
        assert status == 400 and answer["error"]["param"] == param, answer
        assert "\n" not in answer["error"]["message"]
    assert fim_server.healthy()
    assert fim_server.post("/completion", {"prompt": "x", "n_predict": 1})[0] == 200


def test_props_says_the_context_the_slots_and_the_template_as_llama_server_does(fim_server, repo_model):
    status, props = fim_server.request("GET", "/props")
    assert status == 200, props
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] >= 1
    assert props["model_path"] == str(repo_model.gguf_f32_path) and props["chat_template"].startswith("{% for")
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert props["build_info"].startswith("specrun ")


def test_a_warm_up_then_keystrokes_read_the_chunks_from_the_cache(fim_server):
    """llama.vim's ring of chunks: more than the context holds. The warm-up reads them; each fill
    after it, whatever its cursor line and length, reads only what changed (a fill's prompt_n)."""
    chunks = [{"filename": f"f{i}.py", "text": f"def f{i}(x):\n    return x * {i}\n" * 4} for i in range(12)]
    base = {**LLAMA_VIM, "input_extra": chunks, "response_fields": None, "n_indent": 0, "t_max_predict_ms": 0}
    status, warm = fim_server.post("/infill", {**base, "input_prefix": "", "input_suffix": "", "prompt": "",
                                               "n_predict": 0, "samplers": []})
    assert status == 200 and warm["content"] == "" and warm["prompt_cut"] is True and warm["truncated"] is False
    for middle, n_predict in (("    x = ", 8), ("    x = f", 3), ("    x = fo", 16)):
        status, fill = fim_server.post("/infill", {**base, "prompt": middle, "n_predict": n_predict})
        assert status == 200, fill
        assert fill["timings"]["cache_n"] >= warm["tokens_evaluated"] - 12  # the chunks, from the cache
        assert fill["prompt_cut"] is True and fill["truncated"] is False  # no "context is full" in llama.vim


def test_llama_server_s_readings_of_a_request(fim_server):
    """What llama-server's clients count on: a chat request naming no model is answered by the
    loaded one; "grammar": "" is none; n_predict wins over max_tokens; an empty stop string is
    none; a stream's last event says whether a newline came; an answer the context ended says
    truncated."""
    status, chat = fim_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 3})
    assert status == 200 and chat["model"] and chat["choices"][0]["message"]["content"] is not None
    status, plain = fim_server.post("/completion", {"prompt": "x", "n_predict": 4, "max_tokens": 9, "grammar": "",
                                                    "stop": ["", "zzz"]})
    assert status == 200 and plain["generation_settings"]["n_predict"] == 4 and plain["generation_settings"][
        "stop"] == ["zzz"]
    # the samplers in the order they apply, as llama-server lists them
    assert plain["generation_settings"]["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p",
                                                        "min_p", "xtc", "temperature"]
    status, ordered = fim_server.post("/completion", {"prompt": "x", "n_predict": 2, "samplers": "tkp"})
    assert status == 200 and ordered["generation_settings"]["samplers"] == ["penalties", "dry", "temperature", "top_k",
                                                                            "top_p", "top_n_sigma", "typ_p", "min_p",
                                                                            "xtc"]
    status, full = fim_server.post("/completion", {"prompt": list(range(1, 510)), "n_predict": 8})
    assert status == 200 and full["truncated"] is True and full["stop_type"] == "limit"


def test_a_stream_s_last_event_says_a_newline_came(fim_server):
    import http.client

    host, port = fim_server.host_port
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        connection.request("POST", "/completion", body=json.dumps(
            {"prompt": "x", "n_predict": 8, "stream": True, "grammar": 'root ::= "a\\nb\\n"'}),
            headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        events = [json.loads(line.removeprefix("data: ")) for line in response.read().decode().split("\n") if line]
    finally:
        connection.close()
    assert "".join(event["content"] for event in events) == "a\nb\n"
    assert events[-1]["stop"] is True and events[-1]["has_new_line"] is True and events[-1]["content"] == ""


def test_tokenize_and_detokenize_use_the_loaded_model_s_tokenizer(fim_server):
    status, plain = fim_server.post("/tokenize", {"content": "def f(x):"})
    assert status == 200 and plain["tokens"] and all(isinstance(t, int) for t in plain["tokens"])
    status, special = fim_server.post("/tokenize", {"content": "<|fim_prefix|>x", "add_special": True})
    assert special["tokens"][:2] == [1, 512]  # the BOS, then the control token parsed (parse_special's default)
    status, literal = fim_server.post("/tokenize", {"content": "<|fim_prefix|>", "parse_special": False})
    assert 512 not in literal["tokens"]
    status, pieces = fim_server.post("/tokenize", {"content": ["def", 512, " f"], "with_pieces": True})
    assert status == 200 and 512 in [piece["id"] for piece in pieces["tokens"]]  # the id passed through
    assert "".join(piece["piece"] for piece in pieces["tokens"]) == "def<|fim_prefix|> f"  # control tokens spelled
    status, text = fim_server.post("/detokenize", {"tokens": plain["tokens"]})
    assert status == 200 and text == {"content": "def f(x):"}
    spelled = fim_server.post("/detokenize", {"tokens": special["tokens"]})[1]
    assert spelled == {"content": "<|bos|><|fim_prefix|>x"}  # control tokens spelled, as llama-server spells them
    for path, body, param in (("/tokenize", {}, "content"), ("/tokenize", {"content": [1.5]}, "content"),
                              ("/tokenize", {"content": [10**6]}, "content"),
                              ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "1"}, "tokens"),
                              ("/detokenize", {"tokens": [1], "more": 1}, "more")):
        status, refused = fim_server.post(path, body)
        assert status == 400 and refused["error"]["param"] == param, (path, body, refused)
    assert fim_server.healthy()


def test_a_stop_string_after_a_line_s_indentation_keeps_it(fim_server):
    """n_indent holds a line's indentation until its text decides; a stop string there lets it
    out, as llama-server keeps the text before its stop word."""
    status, answer = fim_server.post("/completion", {"prompt": "x", "n_predict": 8, "n_indent": 4,
                                                     "grammar": 'root ::= "foo\\n    END"', "stop": ["END"]})
    assert status == 200 and answer["content"] == "foo\n    " and answer["stop_type"] == "word"
    assert answer["stopping_word"] == "END"


def test_a_served_fill_samples_under_the_infill_rule_as_the_engine_does(repo_model):
    """llama.vscode's samplers through the worker: seeded, the answer is plain decoding's under
    the rule token for token, and differs from the same seed without it."""
    backend = _llama(repo_model)
    fill = Fill(PREFIX, SUFFIX, MIDDLE, EXTRA)
    try:
        ids, _ = fill_prompt(backend, fill, 512)
        runs = {infill: [SpeculativeEngine(backend, None, method="none").run(ids, GenerationParams(
            24, 0, sampling=SamplingSettings(1.0, 40, 0.99, seed=seed, infill=infill), stop_at_eos=True)).text
            for seed in range(4)] for infill in (True, False)}
    finally:
        backend.close()
    assert runs[True] != runs[False]
    worker = PairWorker(PairOptions(str(repo_model.gguf_f32_path), None, method="none", parallel=1,
                                    load=LoadOptions(threads=1)))
    worker.start()
    try:
        for seed, expected in enumerate(runs[True]):
            request, _ = _native({**LLAMA_VIM, "n_predict": 24, "top_p": 0.99, "seed": seed, "n_indent": 0,
                                  "t_max_predict_ms": 0})
            events = _events(worker, request)
            assert isinstance(events[-1], Done)
            assert "".join(e.text for e in events if isinstance(e, Delta)) == expected
    finally:
        worker.stop()


def test_mlx_tokenizing_from_two_threads_keeps_each_call_s_reading_of_control_text(repo_model):
    """transformers sets split_special_tokens on the tokenizer it shares, then encodes: a server's
    /tokenize beside its worker swapped each other's setting (MlxBackend.tokenize is locked)."""
    import threading

    backend = _mlx(repo_model)
    text = "x = '<|fim_prefix|>' and <|file_sep|>"
    expected = {special: backend.tokenize(text, add_bos=False, special=special) for special in (False, True)}
    assert expected[False] != expected[True]
    wrong = []

    def tokenize(special: bool) -> None:
        for _ in range(1500):
            if backend.tokenize(text, add_bos=False, special=special) != expected[special]:
                wrong.append(special)

    threads = [threading.Thread(target=tokenize, args=(special,)) for special in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_both_backends_end_a_fill_at_the_repository_and_separator_tokens(repo_model, fim_model):
    """llama.cpp ends generation at a code model's repository, file-separator and padding tokens
    (a fill that wrote one began an invented next file); MLX reads the same spellings."""
    for model, endings in ((repo_model, {515, 516}), (fim_model, set())):
        llama, mlx = _llama(model), _mlx(model)
        try:
            assert llama.vocab.eos_ids == mlx.vocab.eos_ids == {2} | endings  # the tiny vocabulary's end, 2
        finally:
            llama.close()
            mlx.close()
