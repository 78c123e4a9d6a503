"""The model kit (tokenizer, GGUF and HF writers, widening) against llama.cpp, MLX and a NumPy oracle."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_factory import TinyModel, training_texts
from reference_model import ReferenceModel
from specrun.modelkit.config import ModelConfig, weight_names
from specrun.modelkit.gguf_io import from_interleaved_rope, read_gguf, to_interleaved_rope, write_gguf
from specrun.modelkit.hf_io import write_hf_folder
from specrun.modelkit.tokenizer import (
    DEMO_CHAT_TEMPLATE,
    build_tokenizer_json,
    parse_tokenizer_json,
    train_byte_bpe,
)
from specrun.modelkit.cut import derive_cut_gguf, keep_layers
from specrun.modelkit.widen import derive_xl_gguf, widen

tokenizers = pytest.importorskip("tokenizers")

PARITY_STRINGS = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\t",
    "\t\t\tx",
    "hello",
    " hello",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "class Foo(Bar):\n    \"\"\"Doc.\"\"\"\n\n    def __init__(self):\n        super().__init__()\n",
    "if x:\n\tif y:\n\t\tpass\n",
    "        deeply_indented = True",
    "x = [i ** 2 for i in range(10) if i % 3]",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT * FROM users WHERE id = 42;",
    "print(f\"{value!r:>10}\")",
    "# comment with trailing spaces   ",
    "trailing newline spaces   \n   ",
    "a  b   c    d     e",
    " " * 40,
    "\n" * 7 + "x",
    "\r\n windows \r\n line endings",
    "0",
    "12345",
    "3.14159265358979",
    "1,000,000 and 1_000_000",
    "2024-01-31T12:34:56Z",
    "0xDEADBEEF 0b1010",
    "don't won't I'm you're we've they'll he'd",
    "DON'T SHOUT IT'S LOUD",
    "it's a 'quoted' string",
    "Grüße aus München",
    "naïve café résumé",
    "日本語のテキスト",
    "中文文本，标点符号。",
    "한국어 문장",
    "Привет, мир!",
    "Καλημέρα κόσμε",
    "שלום עולם",
    "مرحبا بالعالم",
    "emoji 🙂🚀🐍",
    "👩‍💻 zero width joiner",
    "👍🏽 skin tone",
    "🇯🇵 flag",
    "∑ x² ≤ ∞",
    "α → β",
    "mixed 日本 and English 123 🙂",
    "tabs\tand\tspaces and\t\ttabs",
    "!!!???...",
    "@decorator\ndef f(): ...",
    "https://example.com/path?query=1&x=2",
    "e = mc^2 // comment /* block */",
    "    \n    \n",
    "a\u00a0non-breaking\u00a0space",
    "ﬁ ligature and ＦＵＬＬＷＩＤＴＨ",
]

GREEDY_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(",
    "The quick brown fox",
    "Once upon a time",
    "# Compute the mean\n",
    "if __name__ == \"__main__\":\n",
    "x = [1, 2, 3]\n",
    "return self.",
    "日本語の文章",
    "Hello 🙂",
    "SELECT name FROM",
    "while True:\n\t",
    "    ",
    "1 + 1 =",
    "def __repr__(self):\n        return",
    "try:\n    pass\nexcept",
    "Grüße",
    "{\"key\": [",
]

GREEDY_TOKENS = 32
COMPARED_TOKENS = 16
MIN_AGREEING_PROMPTS = 18


def hf_tokenizer(model: TinyModel):
    return tokenizers.Tokenizer.from_str(model.tokenizer_json)


def llama_cpp_greedy(llm, prompt_ids: list[int], n_new: int) -> list[int]:
    """Argmax decoding with llama.cpp, one token per eval (needs ``logits_all=True``)."""
    llm.reset()
    llm.eval(prompt_ids)
    generated = []
    for _ in range(n_new):
        next_id = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        generated.append(next_id)
        llm.eval([next_id])
    return generated


def mlx_greedy(model, prompt_ids: list[int], n_new: int) -> list[int]:
    """Argmax decoding with an mlx_lm model and its KV cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids)[None], cache=cache)  # (1, T, V)
    generated = []
    for _ in range(n_new):
        next_id = int(mx.argmax(logits[0, -1]).item())
        generated.append(next_id)
        logits = model(mx.array([[next_id]]), cache=cache)
    return generated


def open_llama(path, **kwargs):
    # One thread: with two, ggml's workers and MLX's (same process, 2 cores) starve
    # each other and a 32-token run went from 0.03 s to 5 s once MLX had run.
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(str(path), n_threads=1, n_threads_batch=1, verbose=False, **kwargs)


# -- tokenizer ---------------------------------------------------------------


def test_tokenizer_has_fixed_specials_and_adds_bos(tiny_llama: TinyModel):
    tok = hf_tokenizer(tiny_llama)
    assert [tok.token_to_id(t) for t in ("<|pad|>", "<|bos|>", "<|eos|>")] == [0, 1, 2]
    assert tok.get_vocab_size() == 512
    assert tok.encode("").ids == [1]
    assert tok.encode("abc", add_special_tokens=False).ids[0] != 1
    for text in PARITY_STRINGS:
        assert tok.decode(tok.encode(text).ids) == text


def test_tokenizer_training_is_deterministic():
    texts = training_texts()[:2]
    assert train_byte_bpe(texts, 300) == train_byte_bpe(texts, 300)


def test_tokenizer_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="at least 259"):
        train_byte_bpe(["abc"], 100)
    with pytest.raises(ValueError, match="only support"):
        train_byte_bpe(["abc abc"], 400)


def test_tokenizer_json_rebuilds_from_vocab(tiny_llama: TinyModel):
    vocab = parse_tokenizer_json(tiny_llama.tokenizer_json)
    assert vocab.special_ids == {0, 1, 2} and vocab.add_bos and vocab.bos_token_id == 1
    assert len(vocab.tokens) == 512 and len(vocab.merges) == 512 - 259
    rebuilt = tokenizers.Tokenizer.from_str(build_tokenizer_json(vocab))
    original = hf_tokenizer(tiny_llama)
    for text in PARITY_STRINGS:
        assert rebuilt.encode(text).ids == original.encode(text).ids, text


def test_llama_cpp_tokenizes_like_hf(random_model: TinyModel):
    llm = open_llama(random_model.gguf_path, vocab_only=True)
    tok = hf_tokenizer(random_model)
    assert len(PARITY_STRINGS) >= 50
    mismatches = [
        text
        for text in PARITY_STRINGS
        if llm.tokenize(text.encode(), add_bos=True, special=False) != tok.encode(text).ids
    ]
    assert mismatches == []


def test_demo_chat_template_renders_and_reaches_llama_cpp(tiny_llama: TinyModel):
    import jinja2.sandbox

    template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(DEMO_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with_cue = template.render(messages=messages, add_generation_prompt=True)
    assert with_cue == "user: hi\nassistant: hello\nassistant: "
    assert template.render(messages=messages, add_generation_prompt=False).endswith("hello\n")
    llm = open_llama(tiny_llama.gguf_path, vocab_only=True)
    assert llm.metadata["tokenizer.chat_template"] == DEMO_CHAT_TEMPLATE


# -- GGUF -----------------------------------------------------------------------


def test_rope_permutation_pairs_the_halves_of_each_head():
    n_heads, head_dim = 2, 8
    hf_rows = np.arange(n_heads * head_dim)[:, None]  # (16, 1): row i holds i
    gguf_rows = to_interleaved_rope(hf_rows, n_heads)[:, 0]
    # Head 0: dims (0, 4), (1, 5), ... become adjacent pairs; head 1 likewise, offset by 8.
    assert gguf_rows.tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert np.array_equal(from_interleaved_rope(to_interleaved_rope(hf_rows, n_heads), n_heads), hf_rows)


@pytest.mark.parametrize("dtype, atol", [("F32", 0.0), ("F16", 0.0), ("Q8_0", 0.05)])
def test_gguf_round_trip(random_model: TinyModel, tmp_path, dtype: str, atol: float):
    m = random_model
    path = write_gguf(tmp_path / "m.gguf", m.config, m.weights, m.tokenizer_json, DEMO_CHAT_TEMPLATE, dtype)
    config, weights, tokenizer_json, chat_template = read_gguf(path)
    assert config == random_model.config
    assert chat_template == DEMO_CHAT_TEMPLATE
    assert sorted(weights) == sorted(random_model.weights)
    for name, original in random_model.weights.items():
        assert weights[name].dtype == np.float32 and weights[name].shape == original.shape
        np.testing.assert_allclose(weights[name], original, rtol=0, atol=atol, err_msg=name)
    assert parse_tokenizer_json(tokenizer_json) == parse_tokenizer_json(random_model.tokenizer_json)


def test_q8_0_gguf_is_smaller_and_keeps_norms_exact(tiny_llama: TinyModel, tmp_path):
    m = tiny_llama
    path = write_gguf(tmp_path / "q8.gguf", m.config, m.weights, m.tokenizer_json, dtype="Q8_0")
    assert path.stat().st_size < 0.7 * tiny_llama.gguf_path.stat().st_size
    _, weights, _, _ = read_gguf(path)
    norm = "model.layers.0.input_layernorm.weight"
    assert np.array_equal(weights[norm], tiny_llama.weights[norm])


def test_write_gguf_rejects_bad_input(tiny_llama: TinyModel, tmp_path):
    m = tiny_llama
    with pytest.raises(ValueError, match="dtype"):
        write_gguf(tmp_path / "a.gguf", m.config, m.weights, m.tokenizer_json, dtype="Q4_K")
    short = {name: w for name, w in m.weights.items() if name != "model.norm.weight"}
    with pytest.raises(ValueError, match="lack"):
        write_gguf(tmp_path / "b.gguf", m.config, short, m.tokenizer_json)
    bigger = ModelConfig(**{**m.config.__dict__, "vocab_size": 600})
    wide_vocab = {**m.weights, "model.embed_tokens.weight": np.zeros((600, 128), np.float32),
                  "lm_head.weight": np.zeros((600, 128), np.float32)}
    with pytest.raises(ValueError, match="tokenizer has 512 tokens"):
        write_gguf(tmp_path / "c.gguf", bigger, wide_vocab, m.tokenizer_json)


# -- HF folder -------------------------------------------------------------------


def test_hf_folder_files(tiny_qwen2: TinyModel, tmp_path):
    from safetensors.numpy import load_file

    m = tiny_qwen2
    folder = write_hf_folder(tmp_path / "hf", m.config, m.weights, m.tokenizer_json, DEMO_CHAT_TEMPLATE)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["rope_theta"] == m.config.rope_theta and config["max_position_embeddings"] == 512
    tensors = load_file(str(folder / "model.safetensors"))
    assert sorted(tensors) == sorted(weight_names(m.config)) and "lm_head.weight" not in tensors
    assert all(t.dtype == np.float16 for t in tensors.values())
    bias = "model.layers.1.self_attn.k_proj.bias"
    assert np.array_equal(tensors[bias], m.weights[bias])
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    specials = (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"])
    assert specials == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert tok_config["chat_template"] == DEMO_CHAT_TEMPLATE
    assert (folder / "tokenizer.json").read_text() == m.tokenizer_json


def test_mlx_lm_loads_hf_folder(random_model: TinyModel):
    pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    model, tokenizer = mlx_lm.load(str(random_model.hf_dir))
    assert len(model.layers) == random_model.config.num_layers
    assert tokenizer.eos_token_id == random_model.config.eos_token_id
    assert tokenizer.get_vocab() == hf_tokenizer(random_model).get_vocab(with_added_tokens=True)
    messages = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "user: hi\nassistant: "


def test_mlx_lm_tokenizes_llama_folder_like_hf(tiny_llama: TinyModel):
    # Only llama: transformers 5 loads every model_type "qwen2" folder with its
    # built-in Qwen2Tokenizer, which replaces tokenizer.json's pre-tokenizer regex.
    mlx_lm = pytest.importorskip("mlx_lm")
    _, tokenizer = mlx_lm.load(str(tiny_llama.hf_dir))
    tok = hf_tokenizer(tiny_llama)
    assert [text for text in PARITY_STRINGS if tokenizer.encode(text) != tok.encode(text).ids] == []


# -- numerical parity -----------------------------------------------------------


def test_llama_cpp_f32_logits_match_reference(random_model: TinyModel):
    # llama.cpp keeps its KV cache in F16 by default (logits then differ by ~0.03);
    # with an F32 cache and F32 weights only summation order remains.
    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = llama_cpp.GGML_TYPE_F32
    llm = open_llama(random_model.gguf_f32_path, n_ctx=256, logits_all=True, type_k=f32, type_v=f32)
    reference = ReferenceModel(random_model.config, random_model.weights)
    tok = hf_tokenizer(random_model)
    for prompt in GREEDY_PROMPTS[:5]:
        ids = tok.encode(prompt).ids
        llm.reset()
        llm.eval(ids)
        logits = llm.scores[: len(ids)]  # (T, V)
        np.testing.assert_allclose(logits, reference.logits(ids), rtol=0, atol=1e-3, err_msg=prompt)


def test_mlx_float32_logits_match_reference(random_model: TinyModel):
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    model, _ = mlx_lm.load(str(random_model.hf_dir))
    reference = ReferenceModel(random_model.config, random_model.weights)
    tok = hf_tokenizer(random_model)
    for prompt in GREEDY_PROMPTS[:5]:
        ids = tok.encode(prompt).ids
        logits = np.array(model(mx.array(ids)[None])[0])  # (T, V)
        np.testing.assert_allclose(logits, reference.logits(ids), rtol=0, atol=1e-3, err_msg=prompt)



def test_greedy_parity_llama_cpp_mlx_reference(random_model: TinyModel):
    """F16 GGUF in llama.cpp, float32 weights in MLX and the float64 oracle pick the same tokens.

    A few prompts may diverge where two logits nearly tie (F16 KV cache and weights).
    """
    llm = open_llama(random_model.gguf_path, n_ctx=256, logits_all=True)
    mlx_lm = pytest.importorskip("mlx_lm")
    mlx_model, _ = mlx_lm.load(str(random_model.hf_dir))
    reference = ReferenceModel(random_model.config, random_model.weights)
    tok = hf_tokenizer(random_model)

    agreeing = 0
    distinct_continuations = set()
    for prompt in GREEDY_PROMPTS:
        ids = tok.encode(prompt).ids
        from_llama_cpp = llama_cpp_greedy(llm, ids, GREEDY_TOKENS)
        from_mlx = mlx_greedy(mlx_model, ids, GREEDY_TOKENS)
        from_reference = reference.greedy(ids, GREEDY_TOKENS)
        assert len(from_llama_cpp) == len(from_mlx) == len(from_reference) == GREEDY_TOKENS
        heads = {tuple(run[:COMPARED_TOKENS]) for run in (from_llama_cpp, from_mlx, from_reference)}
        agreeing += len(heads) == 1
        distinct_continuations.add(tuple(from_reference[:COMPARED_TOKENS]))
    assert agreeing >= MIN_AGREEING_PROMPTS
    # The random weights must make outputs depend on the prompt, or parity proves little.
    assert len(distinct_continuations) >= 15


# -- widening -------------------------------------------------------------------


@pytest.mark.parametrize("hidden, intermediate, atol", [(512, 1024, 1e-9), (192, 400, 1e-4)])
def test_widen_keeps_logits(random_model: TinyModel, hidden: int, intermediate: int, atol: float):
    config = random_model.config
    wide_config, wide_weights = widen(config, random_model.weights, hidden, intermediate)
    wide_sizes = (wide_config.hidden_size, wide_config.intermediate_size, wide_config.head_dim)
    assert wide_sizes == (hidden, intermediate, config.head_dim)
    assert wide_config.num_heads // wide_config.num_kv_heads == config.num_heads // config.num_kv_heads
    assert wide_config.rms_norm_eps == pytest.approx(config.rms_norm_eps * config.hidden_size / hidden)
    ids = hf_tokenizer(random_model).encode("def widen(x):\n    return x  # 🙂").ids
    narrow_logits = ReferenceModel(config, random_model.weights).logits(ids)
    wide_logits = ReferenceModel(wide_config, wide_weights).logits(ids)
    assert np.abs(wide_logits - narrow_logits).max() <= atol


def test_widened_half_matrices_are_the_float32_ones_cast(tiny_qwen2: TinyModel):
    """derive_xl_gguf pads an F16 file's matrices in float16 (half the memory): the values a cast
    of the float32 padding gives, norms still float32."""
    _, wide = widen(tiny_qwen2.config, tiny_qwen2.weights, 192, 400)
    _, half = widen(tiny_qwen2.config, tiny_qwen2.weights, 192, 400, np.float16)
    for name, weight in wide.items():
        expected = weight if name.endswith("norm.weight") else weight.astype(np.float16)
        assert half[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(half[name], expected, err_msg=name)


def test_widen_rejects_incompatible_sizes(tiny_qwen2: TinyModel):
    with pytest.raises(ValueError, match="shrink"):
        widen(tiny_qwen2.config, tiny_qwen2.weights, 64, 320)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        widen(tiny_qwen2.config, tiny_qwen2.weights, 200, 320)
    with pytest.raises(ValueError, match="query heads per kv head"):
        widen(tiny_qwen2.config, tiny_qwen2.weights, 160, 320)


def test_derived_xl_gguf_generates_the_same_tokens(random_model: TinyModel, tmp_path):
    xl_path = tmp_path / "xl.gguf"
    xl_config = derive_xl_gguf(random_model.gguf_path, xl_path, hidden=512, intermediate=1024, dtype="F16")
    assert read_gguf(xl_path)[0] == xl_config and xl_config.num_heads == 16
    small = open_llama(random_model.gguf_path, n_ctx=256, logits_all=True)
    xl = open_llama(xl_path, n_ctx=256, logits_all=True)
    tok = hf_tokenizer(random_model)
    for prompt in GREEDY_PROMPTS[:6]:
        ids = tok.encode(prompt).ids
        from_xl = llama_cpp_greedy(xl, ids, COMPARED_TOKENS)
        assert from_xl == llama_cpp_greedy(small, ids, COMPARED_TOKENS), prompt


# -- cutting layers out -----------------------------------------------------------


def test_a_cut_model_computes_the_model_whose_left_out_layer_adds_nothing(random_model: TinyModel):
    """Layer 0 with its attention and MLP outputs zeroed adds nothing to the residual stream, so
    the model without layer 0 must compute exactly that model's logits; the other layers keep
    their weights, renumbered."""
    config = random_model.config
    assert config.num_layers >= 2
    silenced = dict(random_model.weights)
    for proj in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        silenced[f"model.layers.0.{proj}"] = np.zeros_like(silenced[f"model.layers.0.{proj}"])
    cut_config, cut_weights = keep_layers(config, random_model.weights, tuple(range(1, config.num_layers)))
    assert cut_config.num_layers == config.num_layers - 1
    assert sorted(cut_weights) == sorted(weight_names(cut_config))
    np.testing.assert_array_equal(cut_weights["model.layers.0.mlp.up_proj.weight"],
                                  random_model.weights["model.layers.1.mlp.up_proj.weight"])
    ids = hf_tokenizer(random_model).encode("def cut(x):\n    return x").ids
    expected = ReferenceModel(config, silenced).logits(ids)
    assert np.abs(ReferenceModel(cut_config, cut_weights).logits(ids) - expected).max() <= 1e-9
    # layer 0 does add something: a cut that kept it instead would not pass
    assert np.abs(ReferenceModel(config, random_model.weights).logits(ids) - expected).max() > 1e-3


def test_keep_layers_rejects_what_is_not_a_cut(tiny_llama: TinyModel):
    config, weights = tiny_llama.config, tiny_llama.weights
    with pytest.raises(ValueError, match="at least one"):
        keep_layers(config, weights, ())
    with pytest.raises(ValueError, match="distinct and in order"):
        keep_layers(config, weights, (1, 0))
    with pytest.raises(ValueError, match="not one of the model's"):
        keep_layers(config, weights, (0, config.num_layers))


def test_a_cut_gguf_loads_in_llama_cpp_with_fewer_layers(random_model: TinyModel, tmp_path):
    cut_path = tmp_path / "cut.gguf"
    cut_config = derive_cut_gguf(random_model.gguf_f32_path, cut_path, (0,), dtype="F32")
    read_config, read_weights, _, _ = read_gguf(cut_path)
    assert read_config == cut_config and cut_config.num_layers == random_model.config.num_layers - 1
    expected = keep_layers(random_model.config, random_model.weights, tuple(range(1, random_model.config.num_layers)))[1]
    for name, weight in expected.items():
        np.testing.assert_allclose(read_weights[name], weight, atol=1e-6, err_msg=name)
    cut = open_llama(cut_path, n_ctx=256, logits_all=True)
    ids = hf_tokenizer(random_model).encode(GREEDY_PROMPTS[0]).ids
    reference = ReferenceModel(cut_config, expected).greedy(ids, COMPARED_TOKENS)
    assert llama_cpp_greedy(cut, ids, COMPARED_TOKENS) == reference
