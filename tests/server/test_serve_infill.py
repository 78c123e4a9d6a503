"""Fill-in-the-middle (sessions/infill.py): /v1/completions with ``suffix``, as editors complete
at the cursor. A model with FIM tokens fills between prefix and suffix, speculating as any request
does and answering what plain decoding of the same prompt answers; a model without them is a 400
naming ``suffix``."""

from __future__ import annotations

import pytest

from model_factory import FIM_TOKENS, build_fim_model
from server_harness import answered
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.registry.loading import LoadOptions
from specrun.sampling import SamplingSettings
from specrun.server.native import parse_native_request
from specrun.server.requests import CompletionRequest, RequestError, ServeDefaults, parse_completion_request
from specrun.server.worker import Done, Failed, PairOptions, PairWorker
from specrun.sessions.infill import fim_tokens, infill_ids

PREFIX = "def read_config(path):\n    with open(path) as f:\n        "
SUFFIX = "\n    return config\n\n\ndef read_config_again(path):\n    with open(path) as f:\n"


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    return build_fim_model(tmp_path_factory.mktemp("fim"))


def _backends(model, kinds=("llama", "mlx")):
    for kind in kinds:
        if kind == "llama":
            pytest.importorskip("llama_cpp")
            from specrun.backends.llama import LlamaCppBackend

            yield LlamaCppBackend(model.gguf_f32_path, n_threads=1, gpu_layers=0, flash_attn=False)
        else:
            pytest.importorskip("mlx_lm")
            from specrun.backends.mlx import MlxBackend

            yield MlxBackend(model.hf_dir)


@pytest.mark.parametrize("kind", ["llama", "mlx"])
def test_the_prompt_is_prefix_suffix_middle_with_the_model_s_own_tokens(fim_model, tiny_llama, kind):
    (backend,) = _backends(fim_model, (kind,))
    try:
        fim = fim_tokens(backend)
        assert [fim.prefix, fim.suffix, fim.middle] == [backend.tokenize(t, add_bos=False, special=True)[0]
                                                          for t in FIM_TOKENS] == [512, 513, 514]
        ids = infill_ids(backend, PREFIX, SUFFIX)
        prefix, suffix = backend.tokenize(PREFIX, add_bos=False), backend.tokenize(SUFFIX, add_bos=False)
        assert ids == [backend.vocab.bos_id, 512, *prefix, 513, *suffix, 514]
        quoting = infill_ids(backend, "x = '<|fim_middle|>'", "")
        assert quoting.count(514) == 1 and quoting[-1] == 514  # the prefix's marker stays text
        assert infill_ids(backend, [40, 41], "") == [backend.vocab.bos_id, 512, 40, 41, 513, 514]
    finally:
        backend.close()
    (plain,) = _backends(tiny_llama, (kind,))
    try:
        assert fim_tokens(plain) is None
    finally:
        plain.close()


def _fill(worker, prompt, suffix, max_tokens=24):
    return answered(worker, CompletionRequest("fim", max_tokens, SamplingSettings(), prompt=prompt, suffix=suffix))


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_fill_speculates_and_answers_what_plain_decoding_of_its_prompt_answers(fim_model, parallel):
    pytest.importorskip("llama_cpp")
    from specrun.backends.llama import LlamaCppBackend

    backend = LlamaCppBackend(fim_model.gguf_f32_path, n_threads=1, gpu_layers=0, flash_attn=False)
    try:
        plain = SpeculativeEngine(backend, None, method="none").run(infill_ids(backend, PREFIX, SUFFIX),
                                                                    GenerationParams(24, 0))
    finally:
        backend.close()
    worker = PairWorker(PairOptions(str(fim_model.gguf_f32_path), None, method="lookup", parallel=parallel,
                                    load=LoadOptions(threads=1, exact=True)))
    worker.start()
    try:
        done, text = _fill(worker, PREFIX, SUFFIX)
        assert isinstance(done, Done) and text == plain.text
        empty, _ = _fill(worker, "", SUFFIX, 4)  # at a file's start
        assert isinstance(empty, Done)
        at_end, text = _fill(worker, PREFIX, "")  # at a file's end: still a fill (editors send "")
        assert isinstance(at_end, Done) and at_end.stats.prompt_tokens == len(infill_ids_of(fim_model, PREFIX, ""))
    finally:
        worker.stop()


def infill_ids_of(model, prefix, suffix):
    (backend,) = _backends(model, ("llama",))
    try:
        return infill_ids(backend, prefix, suffix)
    finally:
        backend.close()


def test_a_suffix_for_a_model_without_fill_tokens_is_a_400_naming_it():
    worker = PairWorker(PairOptions("demo-target", None, method="none", load=LoadOptions(threads=1)))
    worker.start()
    try:
        refused, _ = _fill(worker, PREFIX, SUFFIX)
        assert isinstance(refused, Failed) and refused.error.status == 400
        error = refused.error.body()["error"]
        assert error["param"] == "suffix" and "no fill-in-the-middle tokens" in error["message"], error
        assert isinstance(_fill(worker, PREFIX, None, 2)[0], Done)  # the next request is served
        assert isinstance(_fill(worker, PREFIX, "", 2)[0], Done)  # "" (a client's default): no fill asked
        nothing, _ = _fill(worker, "", "", 2)  # no fill and no prompt: the BOS alone was answered
        assert isinstance(nothing, Failed) and nothing.error.param == "prompt"
        huge, _ = _fill(worker, (1, 40), "x" * 4_000_000, 2)  # sized before it is tokenized
        assert isinstance(huge, Failed) and huge.error.code == "context_length_exceeded"
        # llama-server's /infill (server/native.py) the same, naming its own field
        fill, _ = parse_native_request({"input_prefix": PREFIX, "input_suffix": SUFFIX}, ServeDefaults(), 256, "m",
                                       infill=True)
        refused, _ = answered(worker, fill)
        assert isinstance(refused, Failed) and refused.error.status == 400 and refused.error.param == "input_prefix"
        assert "no fill-in-the-middle tokens" in refused.error.message
        assert isinstance(_fill(worker, PREFIX, None, 2)[0], Done)  # served on
    finally:
        worker.stop()


def _parsed(**fields):
    return parse_completion_request({"model": "m", "prompt": "def f(", **fields}, ServeDefaults(), 256)


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"suffix": 5}, "suffix", "suffix must be a string"),
    ({"suffix": "x", "response_format": {"type": "json_object"}}, "suffix", "both shape the answer"),
    ({"suffix": "\ud800"}, "suffix", "lone surrogate"),
    ({"prompt": ""}, "prompt", "must not be empty"),
])
def test_bad_suffixes_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(RequestError) as refused:
        _parsed(**fields)
    assert refused.value.param == param and message in refused.value.message


def test_a_suffix_is_read_and_an_empty_one_kept():
    assert _parsed(suffix="):\n    pass").suffix == "):\n    pass"
    assert _parsed(suffix="").suffix == "" and _parsed(suffix=None).suffix is None  # "": a file's end
    assert _parsed(prompt="", suffix="x").prompt == ""  # a fill at a file's start
    assert _parsed().suffix is None


def test_a_raw_prompt_s_control_token_text_becomes_its_tokens_as_llama_server_reads_it(fim_model):
    """Editors that write the FIM prompt themselves (Continue's raw completions) sent its markers
    as text: 42 tokens of garbage for the 9 of a prompt with a suffix. A raw prompt is read as
    llama-cli, llama-server, mlx_lm and vLLM read one; in a chat template typed text stays text."""
    from specrun.sessions.setup import prompt_token_ids

    for backend in _backends(fim_model):
        try:
            written = prompt_token_ids(backend, "<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>",
                                       chat=False)
            assert written == infill_ids(backend, PREFIX, SUFFIX)
            assert 512 not in prompt_token_ids(backend, "say <|fim_prefix|>", chat=True)  # typed: text
        finally:
            backend.close()
