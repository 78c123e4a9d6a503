"""GGUF -> MLX conversion (`specrun models convert`): weights, config and tokenizer, checked
against llama.cpp running the same GGUF."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

from model_factory import TinyModel
from specrun.cli.app import app
from specrun.errors import ModelFileError
from specrun.modelkit.gguf_convert import PRE_TOKENIZERS, convert_gguf_to_mlx
from specrun.modelkit.gguf_io import from_gguf_layout, gguf_tensor_name, write_gguf

pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")

runner = CliRunner()

# Texts on which a tokenizer most easily goes wrong: digit runs, contractions in both
# cases, unicode letters and numbers, whitespace runs, code, CRLF, and special-token text.
TRICKY_TEXTS = (
    "Hello world! 12345 6789 3.14159 1,000,000",
    "  def fib(n):\n\tif n < 2:\n\t\treturn n  # base case\r\n    return fib(n-1)+fib(n-2)\n\n\n",
    "I'm sure they'll say it's fine; THEY'LL, DON'T, we'Re, ſ's",
    "Grüße aus München! naïve café, Ελληνικά, Привет, 日本語のテキスト 東京2024年, 한국어",
    "emoji 🙂🚀 👩\u200d💻 flags 🇯🇵, fullwidth １２３ and Roman Ⅻ, superscript x² ½",
    "combining: cafe\u0301 n\u0303 A\u030a, Hangul jamo \u1100\u1161, Devanagari \u0915\u094d\u0937",
    "tabs\tand  double  spaces   and\u00a0nbsp\u3000ideographic space   \n \n\t \n",
    "<|im_start|>user\nhi<|im_end|>\n<|bos|><|eos|>  <|pad|>x<|im_end|>",
    '{"key": [1, 2, 3], "url": "https://example.com/a?b=c&d=e#f"} $$x^{2}$$ <div class="x">',
)

# The tiny models' float16 conversions against their F16 GGUFs on llama.cpp: measured
# at most 0.069 (MLX computes in float16 here, llama.cpp accumulates in float32).
TINY_LOGIT_TOLERANCE = 0.15
# SmolLM2-135M-Instruct (smollm2 fixture), first 8 positions of a chat prompt, logits
# spreading over ~35 units, against llama.cpp's F16 copy: its MLX float16 conversion
# differed by at most 0.066 (float16 activations), the exact 4-bit folder of the Q4_1
# file by 0.050. (llama.cpp's Q4_1 kernels differ from both by ~1.0.)
SMOLLM2_LOGIT_TOLERANCE = 0.15
CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _greedy(backend, prompt: list[int], n_new: int) -> list[int]:
    """Plain greedy decoding one token at a time, from an empty cache."""
    backend.rewind(0)
    logits = backend.forward(prompt, [len(prompt) - 1])
    out = [int(logits[-1].argmax())]
    while len(out) < n_new:
        out.append(int(backend.forward(out[-1:], [0])[-1].argmax()))
    return out


def _logits(backend, tokens: list[int]) -> np.ndarray:
    """(len(tokens), vocab) logits of one pass from an empty cache."""
    backend.rewind(0)
    return backend.forward(tokens, list(range(len(tokens))))


def _convert(source: Path, out: Path, mlx_dtype: str) -> Path:
    convert_gguf_to_mlx(source, out, mlx_dtype=mlx_dtype)
    return out


# ---- the tiny random models ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(random_model: TinyModel, tmp_path_factory):
    """One tiny model on llama.cpp (its F16 GGUF) and on MLX (that GGUF converted)."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.backends.mlx import MlxBackend

    folder = _convert(random_model.gguf_path, tmp_path_factory.mktemp("convert") / "mlx", "float16")
    llama, mlx = LlamaCppBackend(random_model.gguf_path, n_ctx=256), MlxBackend(folder, n_ctx=256)
    yield llama, mlx
    llama.close()
    mlx.close()


def test_a_converted_tiny_model_computes_what_llama_cpp_computes(tiny_pair, random_model):
    llama, mlx = tiny_pair
    for text in TRICKY_TEXTS[:4]:
        tokens = llama.tokenize(text)[:48]
        if random_model.config.arch == "llama":  # qwen2: see test_qwen2_folders_get_qwen2_s_own_tokenizer
            assert mlx.tokenize(text)[:48] == tokens
        diff = np.abs(_logits(mlx, tokens) - _logits(llama, tokens)).max()
        assert diff < TINY_LOGIT_TOLERANCE
        assert _greedy(mlx, tokens[:8], 12) == _greedy(llama, tokens[:8], 12)
    assert mlx.chat_template() == random_model.chat_template


def test_q4_requantizes_float_weights_within_half_a_step(tiny_llama: TinyModel, tmp_path):
    import mlx.core as mx

    folder = _convert(tiny_llama.gguf_path, tmp_path / "q4", "q4")
    stored = mx.load(str(folder / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        scales = stored[f"{name}.scales"]
        weight = np.array(mx.dequantize(stored[f"{name}.weight"], scales, stored[f"{name}.biases"], 32, 4))
        expected = tiny_llama.weights[f"{name}.weight"]  # (out, in), HF row order
        step = np.repeat(np.array(scales.astype(mx.float32)), 32, axis=-1)
        assert np.all(np.abs(weight - expected) <= step / 2 + 1e-3)


def test_a_converted_folder_s_files_are_readable_as_its_others_are(tiny_llama: TinyModel, tmp_path):
    """safetensors' writer made the weights owner-only (0600) beside 0644 JSON files: another user,
    or a container under another uid, could not load the folder."""
    import os
    import stat

    umask = os.umask(0o022)  # a common umask: 0644 files (under 077 every file is 0600 anyway)
    try:
        for dtype in ("float16", "q4"):
            folder = _convert(tiny_llama.gguf_path, tmp_path / dtype, dtype)
            modes = {path.name: stat.S_IMODE(os.stat(path).st_mode) for path in folder.iterdir()}
            assert set(modes.values()) == {0o644}, modes
            assert not [path for path in folder.iterdir() if path.name.endswith(".tmp")]
    finally:
        os.umask(umask)


def test_q8_0_blocks_become_exact_8_bit_groups(tiny_qwen2: TinyModel, tmp_path):
    import mlx.core as mx

    source = write_gguf(
        tmp_path / "q8.gguf", tiny_qwen2.config, tiny_qwen2.weights, tiny_qwen2.tokenizer_json, dtype="Q8_0"
    )
    folder = _convert(source, tmp_path / "q4", "q4")
    stored = mx.load(str(folder / "model.safetensors"))
    reader = gguf.GGUFReader(str(source))
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    for hf_name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight"):
        tensor = tensors[gguf_tensor_name(hf_name)]
        expected = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        assert _dequantized(stored, hf_name, bits=8).tobytes() == expected.astype(np.float32).tobytes()


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "qwen35", "llama-bpe", "glm4", "deepseek-v3"])
def test_each_pre_tokenizer_splits_text_as_llama_cpp_does(pre, tiny_llama: TinyModel, tmp_path):
    """The tiny vocabulary under another pre-tokenizer: llama.cpp applies that regex, the
    converted tokenizer.json must split identically (gpt-2 is the tiny models' own)."""
    _check_tokenizes_as_llama_cpp(tiny_llama, pre, tmp_path)


def test_deepseek_v3_s_three_regexes_split_in_turn():
    """DeepSeek-V3's pre-tokenizer is three regexes applied in turn (llama.cpp's DEEPSEEK3_LLM; the
    tiny vocabulary has no merge that tells it from Llama 3's): digits in threes, then CJK runs
    apart from the space before them, then the rest."""
    import json

    from tokenizers import Tokenizer

    from specrun.backends.mlx import byte_level_decoder

    byte_of = byte_level_decoder()
    spec = PRE_TOKENIZERS["deepseek-v3"].spec
    tokenizer = Tokenizer.from_str(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []},
                                               "pre_tokenizer": spec}))
    pieces = [bytes(byte_of[c] for c in piece).decode() for piece, _ in
              tokenizer.pre_tokenizer.pre_tokenize_str("x.y 1234 東京の")]
    assert pieces == ["x", ".y", " ", "123", "4", " ", "東京の"]  # Llama 3's: ... "4", " 東京の"


def test_the_pre_tokenizer_table_names_llama_cpp_s_names():
    assert {"gpt-2", "smollm", "qwen2", "qwen35", "llama-bpe"} <= set(PRE_TOKENIZERS)


def test_qwen2_folders_get_qwen2_s_own_tokenizer(tiny_qwen2: TinyModel, tmp_path):
    """transformers 5 builds every qwen2 folder's tokenizer with Qwen2's regex (and NFC),
    whatever tokenizer.json says: a qwen2 GGUF tokenizes as llama.cpp does when its
    pre-tokenizer is qwen2's, as real Qwen2 files' is."""
    nfc_texts = [text for text in TRICKY_TEXTS if unicodedata.is_normalized("NFC", text)]
    assert len(nfc_texts) < len(TRICKY_TEXTS)
    _check_tokenizes_as_llama_cpp(tiny_qwen2, "qwen2", tmp_path, nfc_texts)


def _check_tokenizes_as_llama_cpp(model: TinyModel, pre: str, tmp_path: Path, texts=TRICKY_TEXTS) -> None:
    """Write ``model`` with ``tokenizer.ggml.pre = pre``, convert it, compare tokenizations."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.backends.mlx import MlxBackend

    parts = (model.config, model.weights, model.tokenizer_json)
    source = write_gguf(tmp_path / f"{pre}.gguf", *parts, tokenizer_pre=pre)
    llama = LlamaCppBackend(source, n_ctx=64)
    mlx = MlxBackend(_convert(source, tmp_path / "mlx", "float16"), n_ctx=64)
    try:
        for text in texts:
            for special in (False, True):
                assert mlx.tokenize(text, special=special) == llama.tokenize(text, special=special), text
    finally:
        llama.close()
        mlx.close()


# ---- the real model: SmolLM2-135M-Instruct ----------------------------------------------
@pytest.fixture(scope="session")
def smollm2_mlx(smollm2, tmp_path_factory) -> dict[str, Path]:
    """The Q4_1 file as an MLX 4-bit folder and the F16 copy as a float16 one, built once."""
    root = tmp_path_factory.mktemp("smollm2_mlx")
    return {
        "q4": _convert(smollm2["smollm2-135m"], root / "q4", "q4"),
        "f16": _convert(smollm2["smollm2-135m-f16"], root / "f16", "float16"),
    }


@pytest.fixture(scope="module")
def smollm2_f16_pair(smollm2, smollm2_mlx):
    """The F16 copy on llama.cpp and its MLX float16 conversion."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.backends.mlx import MlxBackend

    llama = LlamaCppBackend(smollm2["smollm2-135m-f16"], n_ctx=256)
    mlx = MlxBackend(smollm2_mlx["f16"], n_ctx=256)
    yield llama, mlx
    llama.close()
    mlx.close()


def test_smollm2_tokenizes_exactly_as_llama_cpp(smollm2_f16_pair):
    llama, mlx = smollm2_f16_pair
    for text in (*TRICKY_TEXTS, CHAT_PROMPT):
        for add_bos in (False, True):
            for special in (False, True):
                expected = llama.tokenize(text, add_bos=add_bos, special=special)
                assert mlx.tokenize(text, add_bos=add_bos, special=special) == expected, text
    assert (mlx.vocab.size, mlx.vocab.bos_id, mlx.vocab.add_bos) == (llama.vocab.size, llama.vocab.bos_id, False)
    # both end on <reponame> (id 4) too, which llama.cpp takes for a repository token (specrun/fill_tokens.py)
    assert mlx.vocab.eos_ids == llama.vocab.eos_ids == {0, 2, 4}


def test_smollm2_keeps_its_chat_template_and_special_tokens(smollm2_f16_pair, smollm2_mlx):
    llama, mlx = smollm2_f16_pair
    assert mlx.chat_template() == llama.chat_template()
    assert "You are a helpful AI assistant named SmolLM" in mlx.chat_template()
    assert mlx.tokenize(CHAT_PROMPT, add_bos=False, special=True).count(2) == 1  # <|im_end|>


def test_smollm2_f16_logits_agree_with_llama_cpp(smollm2_f16_pair):
    llama, mlx = smollm2_f16_pair
    tokens = llama.tokenize(CHAT_PROMPT, add_bos=False, special=True)[:8]
    expected, got = _logits(llama, tokens), _logits(mlx, tokens)
    assert np.abs(got - expected).max() < SMOLLM2_LOGIT_TOLERANCE
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_smollm2_q4_weights_are_the_q4_1_blocks_exactly(smollm2, smollm2_mlx):
    """Every Q4_1 tensor's MLX groups dequantize to llama.cpp's values bit for bit (the
    Q8_0 embedding likewise, as 8-bit groups); q/k rows back in HF order."""
    import mlx.core as mx

    from specrun.modelkit.config import weight_names
    from specrun.modelkit.gguf_io import read_config, read_fields, read_vocab

    reader = gguf.GGUFReader(str(smollm2["smollm2-135m"]))
    fields = read_fields(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = read_config(fields, read_vocab(fields), tie_embeddings=True)
    stored = mx.load(str(smollm2_mlx["q4"] / "model.safetensors"))
    quantized = {gguf.GGMLQuantizationType.Q4_1: 4, gguf.GGMLQuantizationType.Q8_0: 8}
    seen = set()
    for hf_name in weight_names(config):
        tensor = tensors[gguf_tensor_name(hf_name)]
        bits = quantized.get(tensor.tensor_type)
        if bits is None:
            continue
        dequantized = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        expected = from_gguf_layout(config, hf_name, dequantized)
        assert _dequantized(stored, hf_name, bits).tobytes() == expected.astype(np.float32).tobytes(), hf_name
        seen.add(tensor.tensor_type)
    assert seen == set(quantized)


def test_smollm2_q4_folder_computes_what_the_f16_copy_computes(smollm2_f16_pair, smollm2_mlx):
    """The F16 copy holds the Q4_1 weights dequantized, so the exact 4-bit folder must
    agree with it (llama.cpp's own Q4_1 kernels do not: they round activations to 8 bits)."""
    from specrun.backends.mlx import MlxBackend

    llama, _ = smollm2_f16_pair
    mlx = MlxBackend(smollm2_mlx["q4"], n_ctx=256)
    try:
        tokens = llama.tokenize(CHAT_PROMPT, add_bos=False, special=True)[:8]
        expected, got = _logits(llama, tokens), _logits(mlx, tokens)
        assert np.abs(got - expected).max() < SMOLLM2_LOGIT_TOLERANCE
        assert (got.argmax(-1) == expected.argmax(-1)).all()
    finally:
        mlx.close()


def _dequantized(stored: dict, hf_name: str, bits: int) -> np.ndarray:
    """A stored MLX quantized weight as float32, computed in float32 (exact for GGML blocks)."""
    import mlx.core as mx

    module = hf_name.removesuffix(".weight")
    scales, biases = (stored[f"{module}.{part}"].astype(mx.float32) for part in ("scales", "biases"))
    return np.array(mx.dequantize(stored[hf_name], scales, biases, group_size=32, bits=bits))


# ---- bad input and the command ----------------------------------------------------------
def test_the_command_writes_the_folder_beside_the_file(tiny_qwen2: TinyModel, tmp_path):
    source = tmp_path / "tiny.gguf"
    source.write_bytes(tiny_qwen2.gguf_path.read_bytes())
    result = runner.invoke(app, ["models", "convert", str(source), "--to", "mlx", "--dtype", "q4"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "tiny-mlx"
    assert result.stdout.strip() == str(folder)
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert {path.name for path in folder.iterdir()} == expected
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny-mlx", "tiny.gguf"]  # no scratch left

    again = runner.invoke(app, ["models", "convert", str(source), "--to", "mlx", "--out", str(folder)])
    assert again.exit_code == 2
    assert str(folder) in again.stderr and "already exists" in again.stderr


def test_an_unsupported_architecture_is_one_line_and_leaves_nothing(tmp_path):
    source = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(source, "mamba")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(ModelFileError) as raised:
        convert_gguf_to_mlx(source, tmp_path / "direct", mlx_dtype="float16")
    assert "architecture 'mamba'" in raised.value.one_line()
    assert "supported architectures: llama, qwen2" in raised.value.one_line()
    result = runner.invoke(app, ["models", "convert", str(source), "--to", "mlx"])
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'mamba'" in errors[0] and "llama, qwen2" in errors[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mamba.gguf"]


def test_a_file_that_is_not_gguf_gets_the_usual_error(tmp_path):
    source = tmp_path / "notes.gguf"
    source.write_text("not a model")
    result = runner.invoke(app, ["models", "convert", str(source), "--to", "mlx"])
    assert result.exit_code == 1
    assert "is not a GGUF file" in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.gguf"]


def test_only_mlx_is_a_target_format(tiny_llama: TinyModel, tmp_path):
    result = runner.invoke(app, ["models", "convert", str(tiny_llama.gguf_path), "--to", "onnx"])
    assert result.exit_code == 2 and "use --to mlx" in result.stderr


def test_a_model_folder_stores_arrays_not_in_c_order_as_they_read(tmp_path):
    """safetensors writes an array's buffer as it lies: a transposed view must reach the file in
    the order it reads, not scrambled (a regrouped Qwen3.5 projection was)."""
    from safetensors.numpy import load_file

    from specrun.modelkit.hf_io import write_model_files

    view = np.arange(24, dtype=np.float16).reshape(4, 6).T  # (6, 4), Fortran order
    assert not view.flags["C_CONTIGUOUS"]
    folder = write_model_files(tmp_path / "m", {"w": view}, {}, "{}", {})
    np.testing.assert_array_equal(load_file(str(folder / "model.safetensors"))["w"], view)
