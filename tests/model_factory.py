"""Tiny random-weight models in every format specrun loads, built in a second or two.

Weights are seeded and rounded to float16 once, so the F16 GGUF, the F32 GGUF and
the float32 HF folder all hold exactly the same numbers and any disagreement
between backends comes from arithmetic, not from storage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrun.modelkit.config import ModelConfig, weight_shapes
from specrun.modelkit.gguf_io import write_gguf
from specrun.modelkit.hf_io import write_hf_folder
from specrun.modelkit.tokenizer import DEMO_CHAT_TEMPLATE, train_byte_bpe

VOCAB_SIZE = 512
ARCHS = ("llama", "qwen2")

_LOGIT_SPREAD = 4.0  # std of the logits for a unit-RMS final hidden state
_SUBLAYER_GAIN = 1.5  # attention and MLP outputs comparable to the residual stream

# The first 6,000 characters of five standard-library modules (CPython 3.11.7, Python Software
# Foundation License), kept in the tests: read from the running interpreter they moved with its
# version (colorsys.py differs between 3.11.2 and 3.11.7), and every tiny model with them.
_SOURCES = Path(__file__).parent / "data" / "stdlib_excerpts"
_SOURCE_NAMES = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "colorsys.py")
_UNICODE_LINES = (
    "Grüße aus München! Ça va très bien, merci. ¿Dónde está la biblioteca?",
    "日本語のテキストも少し入れておきます。東京は大きな都市です。",
    "中文文本：今天天气很好，我们去公园散步吧。",
    "한국어 문장도 하나 있습니다. 감사합니다!",
    "Emoji: 🙂 🚀 🐍 ✨ 👍🏽 🇯🇵 — and a zero-width joiner 👩‍💻.",
    "Ελληνικά: Καλημέρα κόσμε. Русский: Привет, мир! עברית: שלום",
    "math: ∑ x² ≤ ∞, α → β, 3.14159 ≈ π, 1e-5, 0x1F, 1_000_000",
)


@dataclass(frozen=True)
class TinyModel:
    """One random model written in every format: F16 and F32 GGUF, float32 HF folder."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer_json: str
    gguf_path: Path
    gguf_f32_path: Path
    hf_dir: Path
    chat_template: str = DEMO_CHAT_TEMPLATE


def training_texts() -> list[str]:
    """A fixed few-KB corpus, the same on every Python: stdlib source plus unicode/emoji lines."""
    texts = [(_SOURCES / f"{name}.txt").read_text(encoding="utf-8") for name in _SOURCE_NAMES]
    return texts + ["\n".join(_UNICODE_LINES)] * 3


@functools.cache
def tiny_tokenizer_json(vocab_size: int = VOCAB_SIZE) -> str:
    """The shared test tokenizer, trained once per process."""
    return train_byte_bpe(training_texts(), vocab_size)


def tiny_config(arch: str) -> ModelConfig:
    """llama: multi-head attention, untied head.

    qwen2: grouped-query attention (2 query heads per kv head), biases, tied embeddings.
    """
    if arch == "llama":
        return ModelConfig(
            arch="llama", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
            num_layers=2, num_heads=4, num_kv_heads=4, rope_theta=10000.0,
            rms_norm_eps=1e-5, context_length=512, tie_embeddings=False,
        )
    if arch == "qwen2":
        return ModelConfig(
            arch="qwen2", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=320,
            num_layers=2, num_heads=4, num_kv_heads=2, rope_theta=1000000.0,
            rms_norm_eps=1e-6, context_length=512, tie_embeddings=True,
        )
    raise ValueError(f"no tiny config for {arch!r}")


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded weights scaled so activations stay O(1) and logits spread by a few units.

    Every value is float16-representable (see the module docstring).
    """
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        weights[name] = _random_tensor(rng, name, shape, config)
    return {name: value.astype(np.float16).astype(np.float32) for name, value in weights.items()}


def _random_tensor(
    rng: np.random.Generator, name: str, shape: tuple[int, ...], config: ModelConfig
) -> np.ndarray:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name.endswith(".bias"):
        return 0.1 * rng.standard_normal(shape)
    if name == "model.embed_tokens.weight":
        std = _LOGIT_SPREAD / np.sqrt(config.hidden_size) if config.tie_embeddings else 1.0
        return std * rng.standard_normal(shape)
    if name == "lm_head.weight":
        return _LOGIT_SPREAD / np.sqrt(config.hidden_size) * rng.standard_normal(shape)
    fan_in = shape[1]
    return _SUBLAYER_GAIN / np.sqrt(fan_in) * rng.standard_normal(shape)


def build_tiny_model(arch: str, folder: Path, seed: int = 0) -> TinyModel:
    """Write the tiny ``arch`` model into ``folder`` as F16 GGUF, F32 GGUF and an HF folder."""
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch)
    weights = random_weights(config, seed)
    tokenizer_json = tiny_tokenizer_json(config.vocab_size)
    parts = (config, weights, tokenizer_json, DEMO_CHAT_TEMPLATE)
    gguf_path = write_gguf(folder / f"{arch}-f16.gguf", *parts, dtype="F16")
    gguf_f32_path = write_gguf(folder / f"{arch}-f32.gguf", *parts, dtype="F32")
    hf_dir = write_hf_folder(folder / f"{arch}-hf", *parts, dtype="float32")
    return TinyModel(
        config=config,
        weights=weights,
        tokenizer_json=tokenizer_json,
        gguf_path=gguf_path,
        gguf_f32_path=gguf_f32_path,
        hf_dir=hf_dir,
    )


def perturbed_copy(model: TinyModel, folder: Path, scale: float = 0.08, seed: int = 7) -> dict[str, Path]:
    """A draft that agrees with ``model`` often but not always: its weights plus noise of
    ``scale`` times each tensor's spread, as {"llama": F16 GGUF, "mlx": float32 HF folder}."""
    rng = np.random.default_rng(seed)
    weights = {
        name: (w + scale * w.std() * rng.standard_normal(w.shape)).astype(np.float16).astype(np.float32)
        for name, w in model.weights.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    parts = (model.config, weights, model.tokenizer_json, model.chat_template)
    return {
        "llama": write_gguf(folder / "perturbed.gguf", *parts, dtype="F16"),
        "mlx": write_hf_folder(folder / "perturbed-hf", *parts, dtype="float32"),
    }


def open_exact_copies(model: TinyModel, kind: str, count: int, tree_paths: int = 8) -> list:
    """``count`` copies of a tiny model on ``kind``: "llama" (F32 weights and cache, flash
    attention off: exact), the first opened able to hold trees of ``tree_paths`` paths, or "mlx";
    the test is skipped where that backend is not installed."""
    import pytest

    if kind == "llama":
        pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
        from specrun.backends.llama import LlamaCppBackend

        def open_model(**options):
            return LlamaCppBackend(model.gguf_f32_path, n_ctx=256, kv_type="f32", flash_attn=False, **options)

        return [open_model(tree_paths=tree_paths), *(open_model() for _ in range(count - 1))]
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.backends.mlx import MlxBackend

    return [MlxBackend(model.hf_dir, n_ctx=256) for _ in range(count)]


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
REPO_TOKENS = ("<|repo_name|>", "<|file_sep|>")


def build_fim_model(folder: Path, seed: int = 3, repo: bool = False) -> TinyModel:
    """The tiny llama with Qwen2.5-Coder's fill-in-the-middle tokens added to its vocabulary
    (ids 512-514; ``repo``: its repository-level tokens too, 515-516), as F16 GGUF and a float32
    HF folder (sessions/infill.py)."""
    return build_model_with_specials(folder, FIM_TOKENS + (REPO_TOKENS if repo else ()), seed, "fim")


# A reasoning model's chat template, as Qwen3's writes its turns: an earlier answer's thinking
# written back, and the generation prompt opening the block ("<think>\n", DeepSeek-R1's way)
# unless enable_thinking is false (Qwen3's way: an empty block, closed)
THINKING_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.role == 'assistant' and message.reasoning_content %}<think>\n{{ message.reasoning_content }}"
    "\n</think>\n\n{%- endif %}{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif %}{%- endif %}"
)
THINK_TOKENS = ("<think>", "</think>")


def build_thinking_model(folder: Path, seed: int = 3) -> TinyModel:
    """The tiny llama with ``<think>`` and ``</think>`` as tokens 512 and 513 and THINKING_TEMPLATE."""
    return build_model_with_specials(folder, THINK_TOKENS, seed, "thinking", THINKING_TEMPLATE)


# gpt-oss's harmony format as its template writes it (specrun/sessions/harmony.py), cut down: the
# tools named in a developer message, an earlier call's thinking given back in ``thinking``, calls as
# messages to functions.NAME, results as the function's message, the generation prompt
# "<|start|>assistant" (the model writes its channels)
HARMONY_TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n{%- for tool in tools %}\n{{ tool.function.name }}"
    "{%- endfor %}<|end|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}<|start|>{{ message.role }}<|message|>"
    "{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>"
    "{%- endif %}<|start|>assistant to=functions.{{ message.tool_calls[0].function.name }}<|channel|>commentary "
    "json<|message|>{{ message.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'tool' %}<|start|>functions.result to=assistant<|channel|>commentary<|message|>"
    "{{ message.content | tojson }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>")


def build_harmony_model(folder: Path, seed: int = 3) -> TinyModel:
    """The tiny llama with harmony's markers as tokens 512-518 (HARMONY_TOKENS) and HARMONY_TEMPLATE."""
    return build_model_with_specials(folder, HARMONY_TOKENS, seed, "harmony", HARMONY_TEMPLATE)


def build_model_with_specials(folder: Path, added: tuple[str, ...], seed: int = 3, name: str = "specials",
                              template: str = DEMO_CHAT_TEMPLATE) -> TinyModel:
    """The tiny llama with the special tokens ``added`` to its vocabulary (ids 512 on), as F16 and
    F32 GGUF and a float32 HF folder; its config still names only the tiny vocabulary's end (2)."""
    import dataclasses

    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(tiny_tokenizer_json())
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in added])
    config = dataclasses.replace(tiny_config("llama"), vocab_size=tokenizer.get_vocab_size())
    weights = random_weights(config, seed)
    tokenizer_json = tokenizer.to_str()
    parts = (config, weights, tokenizer_json, template)
    folder.mkdir(parents=True, exist_ok=True)
    return TinyModel(
        config=config, weights=weights, tokenizer_json=tokenizer_json, chat_template=template,
        gguf_path=write_gguf(folder / f"{name}-f16.gguf", *parts, dtype="F16"),
        gguf_f32_path=write_gguf(folder / f"{name}-f32.gguf", *parts, dtype="F32"),
        hf_dir=write_hf_folder(folder / f"{name}-hf", *parts, dtype="float32"),
    )
