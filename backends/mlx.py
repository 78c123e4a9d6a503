"""MLX backend over mlx-lm: one model, its tokenizer and one prompt cache.

The model runs through mlx-lm's own module and cache objects (``make_prompt_cache``),
so every architecture mlx-lm supports works here. Three choices differ from
mlx-lm's generate loop:

- Logits leave the device only for the rows the engine asks for; tokens before the
  first requested row are fed in chunks whose logits are never evaluated (MLX is
  lazy, so the unused lm_head products are never computed), and greedy argmax is
  taken on the device so only ids cross to NumPy. ``forward_greedy`` chains several
  greedy steps on the device with a single host sync, as mlx-lm's drafting does;
  ``forward_greedy_deferred`` skips even that sync, and a target's
  ``forward_argmax_after`` queues its verify pass on the draft's ids still on the
  device, so one sync serves draft and verify (mlx-lm's loop runs the same way).
- Rewinds are exact. Caches that can drop their tail (``KVCache``) are trimmed.
  Caches that cannot (``RotatingKVCache`` for sliding-window layers, recurrent
  ``ArraysCache`` state) are restored from a checkpoint taken before each forward,
  and the tokens between the checkpoint and the rewind point are fed again: such
  models speculate losslessly, at the price of re-feeding accepted tokens. A Gated
  DeltaNet's state (Qwen3.5, Qwen3-Next) is
  rolled back within the last pass instead (backends/mlx_snapshots.py): only its recurrence
  runs again, on what the pass computed, and no token is fed.
- Vocabulary facts and token bytes come from the Hugging Face tokenizer, so text
  is rebuilt byte-exactly from ids (byte-level BPE and SentencePiece alike).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import stat
import threading
from collections.abc import Sequence
from contextlib import redirect_stdout
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from specrun.backends.base import HeldTree, HiddenSupport, HiddenTracking, TreeSupport, VocabInfo, held_tree_for
from specrun.errors import BackendUnavailableError, ContextFullError, ModelFileError, SpecrunError
from specrun.fileio import json_problem
from specrun.fill_tokens import fill_endings, turn_endings
from specrun.modelkit.mtp import tensor_files, text_config_of
from specrun.penalties import AheadShaping
from specrun.sampling import AheadSampling, SamplingSettings, gumbel_seed
from specrun.tree import TokenTree
from specrun.backends.mlx_common import MODEL_CALLS, PREFILL_CHUNK, packed_pass, packed_problem, recording_body
from specrun.backends.mlx_snapshots import SNAPSHOT_TOKENS, PassStates, Snapshotter

DEFAULT_CTX = 4096
# Tokens forward_greedy feeds with its first pass; longer inputs (a prompt) go unread first,
# since every row of a pass pays for its lm_head product.
GREEDY_JOIN_TOKENS = 2
# Checkpoints kept for caches that cannot be trimmed (one is taken before every pass): at most
# MAX_CHECKPOINTS, and no more than CHECKPOINT_BYTES of copies in all, but never fewer than
# MIN_CHECKPOINTS. A real model's checkpoint is large (Qwen3.5-27B's recurrent state ~150 MB,
# Gemma 3 27B's sliding windows ~420 MB): 64 of them held gigabytes beside the weights. Past the
# bound, older checkpoints are thinned, not dropped (checkpoint_to_drop): a rewind past the dense
# newest ones replays a stretch about as long as it rewinds, never the whole context.
MAX_CHECKPOINTS = 64
MIN_CHECKPOINTS = 4
CHECKPOINT_BYTES = 256 * 2**20
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What mlx_lm.load reads, minus model code (*.py): specrun never runs code from a model repo.
MLX_ALLOW_PATTERNS = ["*.json", "model*.safetensors", "mtp.safetensors", "tokenizer.model", "*.tiktoken", "*.txt",
                      "*.jinja"]  # mtp.safetensors: MTP layers kept beside the weights (modelkit.gguf_convert_qwen35)
# Caches whose trim() is always exact; any other cache type is checkpointed.
ALWAYS_TRIMMABLE = ("KVCache", "QuantizedKVCache", "ConcatenateKVCache")


def _import_mlx():
    """mlx.core, mlx_lm's loader and its cache module, or a one-line install hint."""
    try:
        import mlx.core as mx
        from mlx_lm import utils as lm_utils
        from mlx_lm.models import cache as lm_cache
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BackendUnavailableError(
            "the MLX backend is not installed",
            "install it with: pip install 'specrun[mlx]'",
        ) from exc
    return mx, lm_utils, lm_cache


# ---- finding and checking the model folder -----------------------------------------
def check_mlx_folder(path: Path) -> None:
    """Raise a ModelFileError naming the problem if ``path`` is not a loadable model folder."""
    if not path.exists():
        raise ModelFileError(f"model folder not found: {path}", "check the path or run `specrun models list`")
    if not path.is_dir():
        fix = "use --backend llama for GGUF files" if path.suffix == ".gguf" else "pass the model folder instead"
        raise ModelFileError(f"{path} is a file, not an MLX model folder", fix)
    try:
        with os.scandir(path) as entries:
            special = next((entry for entry in entries if _is_special(entry)), None)
    except OSError as exc:
        raise ModelFileError(f"{path} cannot be read ({exc.strerror or exc})", "check the folder's permissions") from None
    if special is not None:  # mlx-lm and the tokenizer read such a file (a FIFO) for ever
        raise ModelFileError(f"{special.path} is not a regular file (a FIFO, a socket or a device)",
                             "put the model's file itself in the folder")
    if not (path / "config.json").is_file():
        raise ModelFileError(
            f"{path} has no config.json, so it is not an MLX model folder",
            "pass a folder converted with mlx_lm.convert, or an mlx-community repo id",
        )
    if not any(path.glob("model*.safetensors")):
        raise ModelFileError(
            f"{path} has no model*.safetensors weights", "download the model again or convert it with mlx_lm.convert"
        )


def _is_special(entry: os.DirEntry) -> bool:
    try:
        mode = entry.stat().st_mode  # through links, as the hub's cache holds them
    except OSError:
        return False  # a dangling link: what reads it names it
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def resolve_model_folder(path_or_repo: str | os.PathLike) -> Path:
    """A local folder as is; a Hugging Face repo id downloaded into huggingface_hub's cache."""
    spec = str(path_or_repo)
    path = Path(spec).expanduser()
    if path.exists() or not REPO_ID.match(spec):
        check_mlx_folder(path)
        return path
    folder = _download(spec)
    check_mlx_folder(folder)
    return folder


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=MLX_ALLOW_PATTERNS))
    except Exception as exc:  # huggingface_hub raises many types; all mean "not available"
        raise ModelFileError(
            f"{repo_id} is neither a local folder nor a downloadable Hugging Face repo ({type(exc).__name__})",
            "check the path or repo id, and the network if it is a repo",
        ) from exc


def _load(folder: Path, lazy: bool = False):
    """mlx_lm.load with its failures turned into one-line ModelFileErrors."""
    _, lm_utils, _ = _import_mlx()
    _check_settings(folder)
    try:
        return lm_utils.load(str(folder), return_config=True, lazy=lazy)
    except (TypeError, AttributeError, ZeroDivisionError) as exc:  # a setting of a shape no check above knows
        raise ModelFileError(f"mlx-lm could not load {folder}: a setting it read is not what it expects "
                             f"({type(exc).__name__}: {exc})",
                             "check that this mlx-lm version supports the model, or download it again") from exc
    except (json.JSONDecodeError, RecursionError) as exc:  # a RuntimeError too: first
        raise ModelFileError(f"{folder} has an unreadable JSON file: {json_problem(exc)}",
                             "download the model again") from exc
    except RuntimeError as exc:  # mx.load on a corrupt or truncated safetensors file
        raise ModelFileError(
            f"mlx could not read the weights in {folder} (corrupt or truncated safetensors)",
            "download the model again",
        ) from exc
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise ModelFileError(
            f"mlx-lm could not load {folder}: {json_problem(exc)}",  # never Python's advice on digits
            "check that this mlx-lm version supports the model, or download it again",
        ) from exc


# A model's sizes in config.json (its text model's, where it has one): whole numbers above 0. A
# layer count of a million built a million layers before any weight was read (a hang); a head
# count of 0 divided by it; "2" for 2 failed deep inside mlx-lm.
_COUNTS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim")
_REALS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "partial_rotary_factor")  # finite (NaN decoded to nothing)
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SETTINGS_BYTES = 16 << 20


def _check_settings(folder: Path) -> None:
    """A ModelFileError naming the file and the setting where config.json (its sizes), the
    generation config (its end tokens) or the tokenizer's config (its special tokens) holds what
    mlx-lm cannot build a model from; a file that is no JSON at all is left to mlx-lm's load,
    whose error says so."""
    def bad(name: str, what: str) -> ModelFileError:
        return ModelFileError(f"{folder / name} {what}", "download the model again, or fix the file")

    config = _json_file(folder / "config.json")
    if config is not None and not isinstance(config, dict):
        raise bad("config.json", "is not a JSON object")
    if isinstance(config, dict):
        text = text_config_of(config)
        for key in _COUNTS:
            value = text.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise bad("config.json", f"gives {key} as {json.dumps(value)[:40]}, not a whole number above 0")
        for key in _REALS:
            value = text.get(key)
            if value is not None and not _finite_at_least_0(value):
                raise bad("config.json", f"gives {key} as {json.dumps(value)[:40]}, not a finite number of 0 or more")
        trained = text.get("max_position_embeddings")  # 0 in some recurrent models' configs: not said
        if trained is not None and (not isinstance(trained, int) or isinstance(trained, bool) or trained < 0):
            raise bad("config.json", f"gives max_position_embeddings as {json.dumps(trained)[:40]}, not a whole "
                      "number of 0 or more")
        layers, held = text.get("num_hidden_layers"), _weight_layers(folder)
        if isinstance(layers, int) and held and layers > held:
            raise bad("config.json", f"says the model has {layers} layers, and its weights hold {held}")
    generation = _json_file(folder / "generation_config.json")
    if generation is not None:
        if not isinstance(generation, dict):
            raise bad("generation_config.json", "is not a JSON object")
        ends = generation.get("eos_token_id")
        ids = ends if isinstance(ends, list) else [ends]
        if ends is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise bad("generation_config.json", f"gives eos_token_id as {json.dumps(ends)[:40]}, not token ids")
    tokenizer = _json_file(folder / "tokenizer_config.json")
    if tokenizer is not None:
        if not isinstance(tokenizer, dict):
            raise bad("tokenizer_config.json", "is not a JSON object")
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = tokenizer.get(key)
            if not (value is None or isinstance(value, str)
                    or (isinstance(value, dict) and isinstance(value.get("content"), str))):
                raise bad("tokenizer_config.json", f"gives {key} as {json.dumps(value)[:40]}, not a token's text")


def _finite_at_least_0(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and value >= 0
    except OverflowError:  # an integer of hundreds of digits
        return False


def _json_file(path: Path):
    """The JSON in ``path``; None where there is no such file or it does not parse (or is too large
    for a settings file): mlx-lm's load says what is wrong with it then."""
    try:
        if not path.is_file() or path.stat().st_size > _SETTINGS_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _weight_layers(folder: Path) -> int:
    """How many decoder layers the folder's weights hold (the highest ``layers.N.`` plus one), read
    from the weights' index or the safetensors headers; 0 where they cannot be read (mlx-lm's
    load says why)."""
    try:
        names = tensor_files(folder)
    except (SpecrunError, OSError, ValueError):
        return 0
    found = [int(match.group(1)) for name in names if (match := _LAYER_NAME.search(name))]
    return max(found, default=-1) + 1


# ---- a quantized copy (--draft self:q4) ----------------------------------------------
MLX_GROUP_SIZE = 64  # mlx-lm's default group length for affine 4- and 8-bit weights
_QUANTIZATION_KEYS = ("quantization", "quantization_config")


def quantize_mlx_folder(source: Path, dest: Path, bits: int, group_size: int = MLX_GROUP_SIZE) -> None:
    """Write the MLX model folder ``source`` as the folder ``dest`` with its weights quantized to
    ``bits`` (mlx-lm's affine groups of ``group_size``), the tokenizer and template files copied.

    An already quantized source is dequantized first, so the copy rounds the weights the source
    computes with. Layers whose rows do not split into whole groups keep their weights.
    """
    _, lm_utils, _ = _import_mlx()
    source, dest = Path(source), Path(dest)
    check_mlx_folder(source)
    model, _, _ = _load(source, lazy=True)  # lazy: each weight is read as it is quantized and saved
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if any(key in config for key in _QUANTIZATION_KEYS):
        model = lm_utils.dequantize_model(model)
        config = {key: value for key, value in config.items() if key not in _QUANTIZATION_KEYS}
    with redirect_stdout(io.StringIO()):  # mlx-lm prints its bits per weight to stdout
        model, config = lm_utils.quantize_model(model, config, group_size, bits)
    _widen_embeddings(model)
    lm_utils.save_model(dest, model)
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for pattern in MLX_ALLOW_PATTERNS:
        for path in source.glob(pattern):
            if not (dest / path.name).exists():  # the weights, their index and config.json are new
                shutil.copy(path, dest / path.name)


def _widen_embeddings(model) -> None:
    """Store the token embedding's floats as float32. Its dtype becomes the activations', and
    MLX's CPU quantized matmul is ~30x slower on float16 activations than on float32 (measured
    on Linux: 12 ms against 0.4 ms for a 1024x384 4-bit layer); a quantized embedding keeps
    its packed values, only its scales and biases widen (exactly)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map

    def widen(array):
        return array.astype(mx.float32) if mx.issubdtype(array.dtype, mx.floating) else array

    for _, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            module.update(tree_map(widen, module.parameters()))


def _widen_experts(model) -> None:
    """On the CPU, store a mixture of experts' float16/bfloat16 expert weights as float32: MLX's
    CPU gathers experts' products in float32 only (a converted MoE folder ended every pass in
    "[GatherMM::eval] Currently only supports float32"); mixed with half-precision activations
    the products come out in float32. Quantized experts and any on the GPU are left as they are."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device() != mx.cpu:
        return
    for _, module in model.named_modules():
        if isinstance(module, SwitchLinear) and module.weight.dtype in (mx.float16, mx.bfloat16):
            module.update({name: value.astype(mx.float32) for name, value in module.parameters().items()})


# ---- token bytes ---------------------------------------------------------------------
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted,
    in order, to U+0100 onwards.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_for_byte = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in char_for_byte:
            char_for_byte[byte] = chr(256 + shifted)
            shifted += 1
    return {char: byte for byte, char in char_for_byte.items()}


SPM_SPACE = "\u2581"  # SentencePiece's word-boundary mark
SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def decoder_kind(hf_tokenizer) -> str:
    """'byte_level', 'sentencepiece' or 'other', from the fast tokenizer's decoder."""
    decoder = hf_tokenizer.backend_tokenizer.decoder
    description = json.loads(decoder.__getstate__()) if decoder is not None else {}
    types = {description.get("type")} | {part.get("type") for part in description.get("decoders", [])}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types or "Metaspace" in types:
        return "sentencepiece"
    if any(
        part.get("type") == "Replace" and part.get("pattern", {}).get("String") == SPM_SPACE
        for part in description.get("decoders", [])
    ):
        return "sentencepiece"
    return "other"


_ENCODE_LOCK = threading.Lock()  # MlxBackend.tokenize's: one setting of the shared tokenizer at a time


class TokenBytes:
    """Exact bytes per token id; control tokens give b""."""

    def __init__(self, hf_tokenizer) -> None:
        self._hf = hf_tokenizer
        self._kind = decoder_kind(hf_tokenizer)
        self._byte_of = byte_level_decoder()
        added = hf_tokenizer.added_tokens_decoder  # {id: AddedToken}
        self._control = {i for i, token in added.items() if token.special} | set(hf_tokenizer.all_special_ids)
        self._plain_added = {i: token.content for i, token in added.items() if not token.special}
        self._cache: dict[int, bytes] = {}
        # what encode(split_special_tokens=False) reads as control tokens
        self.control_texts = frozenset(token.content for token in added.values() if token.special)

    def __call__(self, token: int) -> bytes:
        piece = self._cache.get(token)
        if piece is None:
            piece = self._cache[token] = self._compute(token)
        return piece

    def _compute(self, token: int) -> bytes:
        if token in self._control:
            return b""
        if token in self._plain_added:  # added tokens hold raw text, not the byte alphabet
            return self._plain_added[token].encode("utf-8")
        text = self._hf.convert_ids_to_tokens(token)
        if text is None:  # an id past the tokenizer (padded embedding rows)
            return b""
        if self._kind == "byte_level":  # each character stands for one byte; anything else is literal text
            return b"".join(bytes([self._byte_of[ch]]) if ch in self._byte_of else ch.encode("utf-8") for ch in text)
        if self._kind == "sentencepiece":
            match = SPM_BYTE.match(text)
            return bytes([int(match.group(1), 16)]) if match else text.replace(SPM_SPACE, " ").encode("utf-8")
        return self._hf.decode([token], skip_special_tokens=False).encode("utf-8")


# ---- greedy ids left on the device --------------------------------------------------
class DeferredIds:
    """Greedy ids (n,) still on the device, so a verify pass can be built on them unsynced.

    mlx-lm's speculative loop queues the draft's passes and the target's verify as one
    graph and syncs once; a host sync between them costs ~3% of a step on the demo pair.
    ``resolve`` evaluates the ids (if nothing has yet), copies them to NumPy once and
    runs the hooks that record them as fed (the backend's token list, a KVSequence's).
    """

    def __init__(self, array, hooks) -> None:
        self.array = array  # (n,) uint32, lazy
        self._hooks = list(hooks)
        self._ids: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def add_hook(self, hook) -> None:
        """Run ``hook(ids)`` when the ids resolve (now, if they have)."""
        if self._ids is None:
            self._hooks.append(hook)
        else:
            hook(self._ids)

    def resolve(self) -> np.ndarray:
        if self._ids is None:
            self._ids = np.array(self.array).astype(np.int64)
            hooks, self._hooks = self._hooks, []
            for hook in hooks:
                hook(self._ids)
        return self._ids


def _greedy_input(tokens: Sequence[int], n_new: int) -> list[int]:
    """The tokens a greedy extension starts from, as ints; at least one, and n_new >= 1."""
    tokens = [int(t) for t in tokens]
    if not tokens or n_new < 1:
        raise ValueError("forward_greedy needs at least one token and n_new >= 1")
    return tokens


# ---- checkpoints for caches that cannot be trimmed ---------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """The cache state before a forward at ``n_past`` tokens; None for layers that trim exactly."""

    n_past: int
    layer_states: tuple[Any, ...]
    nbytes: int = 0  # what its copies hold


def checkpoint_to_drop(positions: Sequence[int], now: int) -> int:
    """Which checkpoint to let go of (an index into ``positions``, oldest first) where too many are
    kept at ``now`` tokens: the one whose loss lengthens a replay least for how far back it lies,
    (next - previous) / age, the start of the context counting as a checkpoint (a rebuild). The
    newest two stay (the latest pass's and a read-ahead pass's); the rest thin out geometrically,
    so a rewind of d tokens replays O(d), as ``_restore`` goes to the newest one at or before it."""
    if len(positions) < 3:
        raise ValueError("the newest two checkpoints are always kept")

    def cost(index: int) -> float:
        previous = positions[index - 1] if index else 0
        return (positions[index + 1] - previous) / max(now - positions[index], 1)

    return min(range(len(positions) - 2), key=lambda index: (cost(index), index))


def _state_bytes(state) -> int:
    """The bytes of the arrays in a cache state (nested lists and tuples of arrays, or None)."""
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(item) for item in state)
    return int(getattr(state, "nbytes", 0) or 0)


# ---- token trees: one pass with a tree mask and a position per node ------------------
def shaped_on_device(mx, row, shaping: AheadShaping, counts=None):
    """``row`` (1, V) shaped as penalties.shaped_rows shapes it, on the device: float32, the bias
    added to its tokens (each named once: AheadShaping.takes), then each token ``counts`` (V,)
    counts in the window divided by the repeat penalty (multiplied where not positive), less its
    count times the frequency penalty and the presence penalty. Each step rounds to float32 as
    NumPy's does (no fused multiply-add: nothing here is compiled), so the argmax is the host's."""
    row = row.astype(mx.float32)
    if shaping.bias:
        tokens = mx.array([token for token, _ in shaping.bias])
        amounts = mx.array([amount for _, amount in shaping.bias], dtype=mx.float32)
        row = row.at[:, tokens].add(amounts[None])
    if counts is not None:
        penalties = shaping.penalties
        repeat = mx.array(penalties.repeat, dtype=mx.float32)
        frequency = mx.array(penalties.frequency, dtype=mx.float32)
        presence = mx.array(penalties.presence, dtype=mx.float32)
        penalised = mx.where(row <= 0, row * repeat, row / repeat) - (counts * frequency + presence)
        row = mx.where(counts > 0, penalised, row)
    return row


def drawn_on_device(mx, row, settings: SamplingSettings, uniform: float):
    """The token (1,) drawn from ``row`` (1, V) under ``settings``' temperature, top-k and min-p, on
    the device, by the Gumbel-max trick (sampling.AheadSampling): top-k's ties at its cut all kept,
    and min-p's tokens those within log(min-p) of the top, before or after the temperature as
    the settings' order has it, as sampling.probabilities keeps them (the two commute: each keeps
    the likeliest tokens, min-p by their distance from the top, which top-k keeps); the noise
    MLX's, keyed by ``uniform``."""
    logits = row[0].astype(mx.float32)
    size = logits.shape[-1]
    if 0 < settings.top_k < size:
        kth = mx.partition(logits, size - settings.top_k)[size - settings.top_k]
        logits = mx.where(logits >= kth, logits, -mx.inf)
    min_p_first = settings.samplers.index("min_p") < settings.samplers.index("temperature")
    if settings.min_p > 0.0 and min_p_first:
        logits = mx.where(logits - mx.max(logits) >= math.log(settings.min_p), logits, -mx.inf)
    scaled = logits / settings.temperature
    if settings.min_p > 0.0 and not min_p_first:
        scaled = mx.where(scaled - mx.max(scaled) >= math.log(settings.min_p), scaled, -mx.inf)
    noise = mx.random.gumbel(shape=(size,), key=mx.random.key(gumbel_seed(uniform)))
    return mx.argmax(scaled + noise, axis=-1).reshape(1)


def _tree_layout(mx, start: int, n_chain: int, tree: TokenTree):
    """The mask (L, start + L) and positions (L,) of a pass feeding ``n_chain`` chain tokens
    and then the tree's nodes after ``start`` cached tokens (L = n_chain + len(tree))."""
    n_fed = n_chain + len(tree)
    visible = np.zeros((n_fed, start + n_fed), dtype=bool)
    visible[:, :start] = True  # the cache
    visible[:, start : start + n_chain] = np.tri(n_fed, n_chain, dtype=bool)  # causal chain; nodes see it all
    visible[n_chain:, start + n_chain :] = tree.ancestor_mask  # a node sees itself and its ancestors
    positions = start + np.concatenate([np.arange(n_chain), n_chain + tree.depth])
    return mx.array(visible), positions


# ---- hidden states: the model split into body and output head -------------------------
SPLIT_PROBE = [[0, 1, 2, 3]]  # (1, 4) token ids the split is checked on


@dataclass(frozen=True)
class ModelSplit:
    """An mlx-lm model as its body and its output head: ``head(body(inputs, cache=c))`` is
    ``model(inputs, cache=c)``, and the body's (1, T, H) output is the head's input."""

    body: Any
    head: Any
    size: int  # H
    linear: Any = None  # the head's linear map (``lm_head`` or the tied embedding's), before any soft-capping
    cap: float = 0.0  # the final soft-cap's (0: none)


def split_model(mx, lm_cache, model) -> ModelSplit:
    """mlx-lm's usual layout: ``model.model`` returns the final-normed hidden states and the
    head is ``lm_head`` (a multimodal wrapper's ``language_model.lm_head``) or the tied
    ``embed_tokens.as_linear``, then any final logit
    soft-capping. Checked on a few tokens against ``model`` itself; ValueError naming the
    architecture where no candidate reproduces its logits."""
    arch = getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]
    body = getattr(model, "model", None)
    embeddings = getattr(body, "embed_tokens", None)
    # a multimodal wrapper (Qwen3.5's) keeps its text model's head under language_model
    text_head = getattr(getattr(model, "language_model", None), "lm_head", None)
    candidates = (getattr(model, "lm_head", None), text_head, getattr(embeddings, "as_linear", None))
    linears = [linear for linear in candidates if linear is not None]
    if body is None or not linears:
        raise ValueError(f"mlx-lm's {arch} model has no .model body and output head to split")
    cap = getattr(model, "final_logit_softcapping", None) or getattr(
        getattr(model, "args", None), "final_logit_softcapping", None
    )
    probe = mx.array(SPLIT_PROBE)
    expected = model(probe, cache=lm_cache.make_prompt_cache(model))  # (1, 4, V)
    try:
        hidden = body(probe, cache=lm_cache.make_prompt_cache(model))  # (1, 4, H)
    except Exception as exc:  # a body with another call signature
        raise ValueError(f"mlx-lm's {arch} body cannot be run on its own ({type(exc).__name__})") from exc
    for linear in linears:
        head = linear if not cap else (lambda h, linear=linear: mx.tanh(linear(h) / cap) * cap)
        logits = head(hidden)
        if logits.shape == expected.shape and mx.allclose(logits, expected, rtol=1e-4, atol=1e-4).item():
            return ModelSplit(body, head, int(hidden.shape[-1]), linear, float(cap or 0.0))
    raise ValueError(f"mlx-lm's {arch} model does not give its logits as lm_head (or tied embeddings) "
                     "of its body's output")


class MlxBackend(HiddenTracking):
    """One mlx-lm model and one prompt cache for a single sequence.

    Hidden states (``track_hidden``): a tracked pass runs the model as body and head
    (``split_model``) and keeps the body's output, the head's input, for every row fed.
    """

    name = "mlx"
    # Roll a Gated DeltaNet's state back within the last pass where the model allows it
    # (backends/mlx_snapshots.py); False: every rewind of such a cache replays (benchmarks compare).
    snapshots = True

    def __init__(self, path_or_repo: str | os.PathLike, n_ctx: int | None = None) -> None:
        """Load a local MLX folder or a Hugging Face repo id (downloaded into huggingface_hub's cache)."""
        folder = resolve_model_folder(path_or_repo)
        model, tokenizer, config = _load(folder)
        self.path = folder
        self._setup(model, tokenizer, config, n_ctx)

    @classmethod
    def from_loaded(cls, model, tokenizer, config: dict | None = None, n_ctx: int | None = None) -> MlxBackend:
        """Wrap an already loaded mlx-lm model and TokenizerWrapper (weights are shared, not copied)."""
        backend = cls.__new__(cls)
        backend.path = Path("<loaded model>")
        backend._setup(model, tokenizer, config or {}, n_ctx)
        return backend

    def _setup(self, model, tokenizer, config: dict, n_ctx: int | None) -> None:
        self._mx, _, self._lm_cache = _import_mlx()
        self.model = model
        self.tokenizer = tokenizer
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # the Hugging Face tokenizer inside the wrapper
        text = text_config_of(config)  # qwen3_5's
        trained = self.n_ctx_train = int(config.get("max_position_embeddings") or text.get("max_position_embeddings")
                                         or 0)  # 0: not said
        self.n_ctx = n_ctx or (min(DEFAULT_CTX, trained) if trained > 0 else DEFAULT_CTX)
        self.vocab = self._read_vocab_info()
        self._token_bytes = TokenBytes(self._hf)
        self._tokens: list[int] = []  # what the cache holds, for replays after a checkpoint restore
        self._deferred: DeferredIds | None = None  # greedy ids queued but not yet in _tokens
        self._held_tree: HeldTree | None = None  # after forward_tree, until keep_path
        self._held_kv: list = []  # per layer: the held nodes' (keys, values), each (B, H, n, D)
        self._pass_hidden: list | None = None  # during a tracked pass: (T, H) per model call
        self.shares_layers = False  # a layer draft's layers are the target's (layer_draft)
        self._mtp_layers: dict[int, tuple] = {}  # id(heads) -> (heads, its MLX layer): mtp_layer's one copy
        _widen_experts(model)
        self._new_cache()

    # ---- vocabulary ---------------------------------------------------------------
    def _read_vocab_info(self) -> VocabInfo:
        hf = self._hf
        bos = hf.bos_token_id
        with_specials = hf.encode("a", add_special_tokens=True)
        without = hf.encode("a", add_special_tokens=False)
        add_bos = bos is not None and with_specials[:1] == [bos] and without[:1] != [bos]
        eos_ids = set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        if hf.eos_token_id is not None:
            eos_ids.add(hf.eos_token_id)
        # a code model's repository, file-separator and padding tokens end generation, as llama.cpp
        # ends it there (a fill that wrote one began an invented next file)
        added = hf.get_added_vocab()  # {text: id}: the tokens added to the vocabulary, specials among them
        eos_ids |= fill_endings(added.get)
        # and its end-of-turn tokens found by their text, as llama.cpp finds them (a config naming
        # only the end of text left an MLX answer running past the end of its turn)
        eos_ids |= {token for token in turn_endings(hf.get_vocab()) if token < len(hf)}
        return VocabInfo(size=len(hf), bos_id=bos, eos_ids=frozenset(eos_ids), add_bos=add_bos)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; special-token text becomes those tokens only with ``special``.
        Locked: transformers sets ``split_special_tokens`` on the tokenizer it shares, then
        encodes, so two threads (a server's /tokenize beside its worker, slots) swapped each
        other's setting (87 of 3,000 encodes read quoted control-token text as the token)."""
        with _ENCODE_LOCK:
            return list(self._hf.encode(text, add_special_tokens=add_bos, split_special_tokens=not special))

    def token_bytes(self, token: int) -> bytes:
        return self._token_bytes(token)

    def token_text(self, token: int) -> str:
        return self._hf.convert_ids_to_tokens(token) or ""

    def control_texts(self) -> frozenset[str]:
        return self._token_bytes.control_texts

    def native_loop(self) -> None:
        """No native plain loop is compared on MLX yet (mlx_lm.generate's stream would be it)."""
        return None

    def chat_template(self) -> str | None:
        template = getattr(self._hf, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one is for chat
            template = template.get("default")
        return template or None

    # ---- the cache ------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        self._settle()
        return len(self._tokens)

    def _settle(self) -> None:
        """Resolve queued greedy ids before anything else reads or moves the cache."""
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            deferred.resolve()

    @property
    def needs_checkpoints(self) -> bool:
        """True when some layer's cache cannot always be trimmed (sliding window, recurrent state)."""
        return self._needs_checkpoints

    def _new_cache(self) -> None:
        self._deferred = None
        # forward_argmax_ahead's queued pass after the last id fed: row (1, V), argmax (1,), hidden (1, H) or
        # None, and the penalties' window counts (V,) its row was shaped by or None
        self._ahead = None
        self._cache = self._lm_cache.make_prompt_cache(self.model)
        self._needs_checkpoints = any(type(layer).__name__ not in ALWAYS_TRIMMABLE for layer in self._cache)
        self._checkpoints: list[Checkpoint] = []  # oldest first
        self._pass_states = None  # PassStates: what the passes since the newest checkpoint kept for a rollback
        self._tokens.clear()

    def forward(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        mx = self._mx
        logits = self._pass(self._forward_rows, tokens, list(logit_rows), lambda picked: picked.astype(mx.float32))
        return np.zeros((0, self.vocab.size), np.float32) if logits is None else np.array(logits)  # (R, V)

    def forward_argmax(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        ids = self._pass(self._forward_rows, tokens, list(logit_rows), self._kept_argmax)
        return np.zeros((0,), np.int64) if ids is None else np.array(ids).astype(np.int64)  # (R,): only ids cross

    def _kept_argmax(self, picked):
        """The argmax of the rows ``picked`` (R, V), kept on the device for ``last_pass_ties``."""
        self._last_picked = picked
        return self._mx.argmax(picked, axis=-1)

    def last_pass_ties(self, indices: Sequence[int], margin: float) -> np.ndarray:
        """Computed on the device; only one flag a row crosses."""
        mx = self._mx
        rows = self._last_picked[mx.array(list(indices))].astype(mx.float32) if len(indices) else None
        if rows is None:
            return np.zeros((0,), dtype=bool)
        top = mx.max(rows, axis=-1, keepdims=True)
        return np.array(mx.sum(rows >= top - margin, axis=-1) > 1)

    def forward_greedy(self, tokens: Sequence[int], n_new: int) -> np.ndarray:
        """Feed ``tokens``, then extend them greedily by ``n_new`` ids (n_new,) with one host sync.

        Each id is fed back as a device array, so the n_new forwards queue up without
        waiting on Python (mlx-lm drafts the same way). Up to GREEDY_JOIN_TOKENS
        tokens (a drafter's catch-up: its last draft and the bonus token) go in with
        the first greedy pass rather than in a pass of their own: the extra logits rows
        cost less than a separate forward and its host sync. The cache ends as n_new
        successive ``forward_argmax`` calls leave it: ``tokens`` plus the first
        n_new - 1 ids. Caches that need checkpoints and cannot roll back within passes take
        a token at a time instead.
        """
        self._check_untracked("forward_greedy")
        if not self._rolls_back:
            return self._greedy_one_by_one(_greedy_input(tokens, n_new), n_new)
        return self.forward_greedy_deferred(tokens, n_new).resolve()

    @property
    def can_defer(self) -> bool:
        """Whether ``forward_greedy_deferred`` works here: a cache that can be cut, or a hybrid
        whose passes keep what a rollback within them reads (not a sliding window's, not Mamba's)."""
        return self._rolls_back

    @property
    def _rolls_back(self) -> bool:
        """A rewind into the passes since the last checkpoint feeds nothing again: every cache
        can be cut, or the recurrent ones roll back by what the passes kept (mlx_snapshots.py)."""
        return not self.needs_checkpoints or (self.snapshots and self._snapshotter is not None)

    def forward_greedy_deferred(self, tokens: Sequence[int], n_new: int) -> DeferredIds:
        """``forward_greedy`` without its host sync: the ids stay on the device until resolved,
        by a target's ``forward_argmax_after`` or by the next use of this backend."""
        tokens = _greedy_input(tokens, n_new)
        self._check_untracked("forward_greedy_deferred")
        if not self._rolls_back:
            raise ValueError("a cache that needs checkpoints and keeps no states cannot defer its greedy ids")
        self._ahead = None
        self._check_room(len(tokens) + n_new - 1)
        if self.needs_checkpoints:  # one for all the passes below: a rewind into them rolls back
            self._checkpoint()
        mx = self._mx
        joined = len(tokens) if len(tokens) <= GREEDY_JOIN_TOKENS else 1
        self._feed_unread(tokens[:-joined])
        step_input = mx.array(tokens[-joined:])  # (J,), then (1,)
        ids = []
        for _ in range(n_new):
            logits = self._run(step_input[None])  # (1, J or 1, V)
            step_input = mx.argmax(self._fit_vocab(logits[0, -1:]), axis=-1)  # (1,), left on the device
            mx.async_eval(step_input)
            ids.append(step_input)
        self._tokens.extend(tokens[-joined:])
        deferred = DeferredIds(mx.concatenate(ids), [lambda out: self._tokens.extend(out[:-1].tolist())])
        self._deferred = deferred
        return deferred

    def forward_argmax_after(self, tokens: Sequence[int], deferred: DeferredIds) -> tuple[np.ndarray, np.ndarray]:
        """Feed ``tokens`` and then a draft's deferred ids in one pass: the argmax at every fed
        row (len(tokens) + n,) and the ids (n,), from one host sync for both models."""
        tokens = [int(t) for t in tokens]
        self._check_untracked("forward_argmax_after")
        self._check_room(len(tokens) + len(deferred))
        if not self._rolls_back:  # replays after a restore need the ids on the host first
            return self._argmax_after_resolved(tokens, deferred)
        mx = self._mx
        self._ahead = None
        if self.needs_checkpoints:
            self._checkpoint()
        fed = mx.concatenate([mx.array(tokens, dtype=deferred.array.dtype), deferred.array])  # (T + n,)
        logits = self._run(fed[None])  # (1, T + n, V)
        argmax = self._kept_argmax(self._fit_vocab(logits[0]))  # (T + n,)
        mx.eval(argmax, deferred.array)
        ids = deferred.resolve()
        self._tokens.extend([*tokens, *ids.tolist()])
        return np.array(argmax).astype(np.int64), ids

    def _argmax_after_resolved(self, tokens: list[int], deferred: DeferredIds) -> tuple[np.ndarray, np.ndarray]:
        """``forward_argmax_after`` with the draft's ids brought to the host first, fed as tokens."""
        ids = deferred.resolve()
        fed = [*tokens, *ids.tolist()]
        return self.forward_argmax(fed, range(len(fed))), ids

    @property
    def reads_ahead(self) -> bool:
        """Whether ``forward_argmax_ahead`` works here (tracked or not; not inside another pass)."""
        return self._pass_hidden is None

    @property
    def shapes_ahead(self) -> bool:
        """Whether ``forward_argmax_ahead`` shapes its rows by penalties and a bias on the device."""
        return True

    @property
    def samples_ahead(self) -> bool:
        """Whether ``forward_argmax_ahead`` draws its tokens on the device (``drawn_on_device``)."""
        return True

    def forward_argmax_ahead(self, token: int | None, ahead: bool = True, shaping: AheadShaping | None = None,
                             drawn: AheadSampling | None = None) -> tuple[int, bool]:
        """A plain greedy step that reads one token ahead, as mlx-lm's own loop does: feed ``token``
        (None: the id the last call returned, which it fed already) and return the argmax after
        it, computed as ``forward_argmax``'s one-token pass computes it, and whether that id was
        fed too (``ahead``, where the context has room), with the argmax after it queued on the
        device: the next call's pass then runs while the host handles this id (plain decoding ran
        0.94x mlx-lm's without it). ``n_past`` counts a fed id; any other pass or rewind drops the
        queued argmax. While tracking, the hidden state of the token fed (``hidden_rows``) is
        queued with each pass and read with its id, so a head drafter's plain steps read ahead too.
        ``shaping``: each argmax is taken after penalties and a bias (``shaped_on_device``), the
        queued row's window counting the id this step picks, still on the device, and kept with
        it (a step that continues it counts nothing again: a whole text's window costs once).
        ``drawn``: each token drawn under its settings from a uniform ``drawn.draw`` gives, this
        step's (where not queued) before the queued one's, instead of the argmax."""
        mx = self._mx
        self._hidden = None
        if token is None:
            if self._ahead is None:
                raise ValueError("no id was read ahead to continue from")
            row, current, hidden, counts = self._ahead  # counts: the window its row was shaped by
        else:
            self._check_room(1)
            counts = self._window_counts(shaping)
            row, current, hidden, _ = self._ahead_pass(mx.array([int(token)]), int(token), shaping, counts, drawn)
        self._ahead = None
        fed = ahead and self.n_past + 1 < self.n_ctx  # room for the id and the token after it
        if fed and counts is not None:  # the queued row's window: this one's, the id picked in, one pushed out
            counts = counts.at[current].add(1.0)
            leaving = shaping.leaving
            if leaving is not None and 0 <= leaving < self.vocab.size:  # as _window_counts counts
                counts = counts.at[leaving].add(-1.0)
        # The queued pass's cache slot is counted (its id unknown: -1) before the host waits, so a
        # Ctrl-C in that wait leaves n_past equal to what every layer holds, for the rewind after.
        queued = self._ahead_pass(current, -1, shaping, counts, drawn) if fed else None
        self._last_picked = row
        value = int(current.item())  # the host waits for this pass only; the queued one runs on
        if hidden is not None:
            self._hidden = np.array(hidden)  # (1, H) float32, evaluated with the pass
        if fed:
            self._tokens[-1] = value
            self._ahead = queued
        return value, fed

    def _window_counts(self, shaping: AheadShaping | None):
        """(V,) float32 on the device: how often each token occurs in the penalties' window of the
        text a shaped row follows (None where no penalty applies)."""
        if shaping is None or not shaping.penalties.on:
            return None
        mx = self._mx
        size = self.vocab.size
        window = [int(token) for token in shaping.window if 0 <= token < size]
        counts = mx.zeros((size,), mx.float32)
        return counts.at[mx.array(window)].add(1.0) if window else counts

    def _ahead_pass(self, token, host_id: int, shaping: AheadShaping | None = None, counts=None,
                    drawn: AheadSampling | None = None):
        """One token (a (1,) array, perhaps still lazy; ``host_id`` as the token list records it)
        fed: its row (1, V) (shaped, where ``shaping`` says: by ``counts``, the window's), argmax
        (1,) (or the token ``drawn`` draws from it), while tracking hidden state (1, H) (else
        None), and ``counts``; queued."""
        if self.needs_checkpoints:
            self._checkpoint()
        self._pass_hidden = [] if self._tracking else None
        try:
            with MODEL_CALLS:
                logits = self._run_model(token[None])  # (1, 1, V)
            # cast here, inside the queued graph: a cast made after the next pass is queued
            # would wait for that pass too (a device runs its queue in order)
            hidden = self._pass_hidden[0].astype(self._mx.float32) if self._pass_hidden else None
        finally:
            self._pass_hidden = None
        self._tokens.append(host_id)  # every layer's cache moved on as the pass was built
        row = self._fit_vocab(logits[0, -1:])
        if shaping is not None:
            row = shaped_on_device(self._mx, row, shaping, counts)
        if drawn is None:
            current = self._mx.argmax(row, axis=-1)
        else:
            current = drawn_on_device(self._mx, row, drawn.settings, drawn.draw())
        self._mx.async_eval(current, self._cache_state(), *([] if hidden is None else [hidden]))
        return row, current, hidden, counts

    def _greedy_one_by_one(self, tokens: list[int], n_new: int) -> np.ndarray:
        ids = [int(self.forward_argmax(tokens, [len(tokens) - 1])[0])]
        while len(ids) < n_new:
            ids.append(int(self.forward_argmax(ids[-1:], [0])[0]))
        return np.array(ids, dtype=np.int64)

    def _check_room(self, n_tokens: int) -> None:
        if self.n_past + n_tokens > self.n_ctx:
            raise ContextFullError(f"the context of {self.n_ctx} tokens is full", "shorten the prompt or raise --ctx")

    def _forward_rows(self, tokens: Sequence[int], rows: list[int], reduce):
        """Feed ``tokens``; ``reduce`` of the (R, V) logits at ``rows``, evaluated on the device.

        Tokens before the first row and after the last are fed in chunks whose
        logits are never evaluated; the span holding the rows goes in one pass.
        Returns None when no rows are asked for.
        """
        tokens = [int(t) for t in tokens]
        self._check_room(len(tokens))
        if any(not 0 <= row < len(tokens) for row in rows):
            raise ValueError(f"logit rows {rows} fall outside the {len(tokens)} tokens fed")
        if tokens and self.needs_checkpoints:
            self._checkpoint()
        if not rows:
            self._feed_unread(tokens)
            return None
        first, last = min(rows), max(rows)
        self._feed_unread(tokens[:first])
        logits = self._step(tokens[first : last + 1])  # (1, span, V)
        picked = self._fit_vocab(logits[0, self._mx.array([row - first for row in rows])])  # (R, V)
        result = reduce(picked)
        self._mx.eval(result, self._cache_state())
        self._feed_unread(tokens[last + 1 :])
        return result

    def _step(self, tokens: list[int]):
        """Run the model over ``tokens`` at the cache's position; lazy (1, T, V) logits."""
        logits = self._run(self._mx.array(tokens)[None])
        self._tokens.extend(tokens)
        return logits

    def _run(self, inputs):
        """The model on ``inputs`` (1, T) at the cache: lazy (1, T, V) logits. In a tracked
        pass it runs as body and head, and the body's (T, H) output joins the pass's."""
        self._ahead = None
        states = self._pass_states
        with MODEL_CALLS:
            if states is None or states.count < 0:
                return self._run_model(inputs)
            if states.count + inputs.shape[1] > SNAPSHOT_TOKENS:  # a prompt's chunk: rewinds into it replay
                states.drop()
                return self._run_model(inputs)
            return self._snapshotter.record(lambda: self._run_model(inputs), states, inputs.shape[1])

    def _run_model(self, inputs):
        if self._pass_hidden is None:
            return self.model(inputs, cache=self._cache)
        split = self._split
        if not self._layers:
            hidden = split.body(inputs, cache=self._cache)  # (1, T, H)
            self._pass_hidden.append(hidden[0])
            return split.head(hidden)
        sink = self._layer_sink
        sink.clear()
        hidden = self._layer_body(inputs, cache=self._cache)
        outputs = dict(sink)
        sink.clear()
        self._pass_hidden.append(self._mx.concatenate([outputs[layer][0] for layer in self._layers], axis=-1))
        return split.head(hidden)

    def _feed_unread(self, tokens: list[int]) -> None:
        """Feed tokens whose logits nobody reads, evaluating only the cache."""
        for start in range(0, len(tokens), PREFILL_CHUNK):
            self._step(tokens[start : start + PREFILL_CHUNK])
            self._mx.eval(self._cache_state())

    def _cache_state(self) -> list:
        """What a pass evaluates besides its result: every layer's cache, and in a tracked pass
        the hidden states so far (evaluated with the graph they share)."""
        states = [layer.state for layer in self._cache]
        if self._pass_states is not None and self._pass_states.count > 0:
            states += self._pass_states.arrays()  # kept past the pass: evaluated with it
        return states if self._pass_hidden is None else states + self._pass_hidden

    def _fit_vocab(self, logits):
        """(R, V_model) → (R, V_tokenizer): drop padded embedding rows, or mask ids the model lacks."""
        width, size = logits.shape[-1], self.vocab.size
        if width > size:
            return logits[:, :size]
        if width < size:
            mx = self._mx
            return mx.concatenate([logits, mx.full((logits.shape[0], size - width), -mx.inf, logits.dtype)], axis=1)
        return logits

    # ---- rewinds --------------------------------------------------------------------
    def rewind(self, n_keep: int) -> None:
        if n_keep >= self.n_past:
            return
        self._ahead = None
        if self.needs_checkpoints:
            self._restore(n_keep)
            return
        for layer in self._cache:  # every layer holds n_past tokens, so each drops exactly this many
            layer.trim(self.n_past - n_keep)
        del self._tokens[n_keep:]

    def _checkpoint(self) -> None:
        """Remember the state of every layer that trim() cannot roll back."""
        copy, recurrent = self._copy_arrays, self._lm_cache.ArraysCache
        states = tuple(
            None if type(layer).__name__ in ALWAYS_TRIMMABLE
            # recurrent state is replaced on every pass, never written into: its arrays are held
            # as they are (a new list), a copy's kernels saved each pass
            else (list(layer.cache), *layer.state[1:]) if isinstance(layer, recurrent)
            else copy(layer.state)
            for layer in self._cache
        )
        checkpoints = self._checkpoints
        checkpoints.append(Checkpoint(self.n_past, states, _state_bytes(states)))
        self._pass_states = PassStates(self.n_past) if self.snapshots and self._snapshotter is not None else None

        def over(share: float) -> bool:
            return len(checkpoints) > MIN_CHECKPOINTS and (
                len(checkpoints) > share * MAX_CHECKPOINTS or sum(c.nbytes for c in checkpoints) > share * CHECKPOINT_BYTES)

        if over(1.0):  # thinned to three quarters of the bound at once: a thinning every few passes, not each
            while over(0.75):
                del checkpoints[checkpoint_to_drop([c.n_past for c in checkpoints], self.n_past)]

    @cached_property
    def _snapshotter(self) -> Snapshotter | None:
        """What keeps this model's recurrent states token by token, None where it cannot (no such
        cache, a sliding window's beside it, another recurrent layer than a Gated DeltaNet): its
        rewinds replay from checkpoints, as every model's do with ``snapshots`` off."""
        if not self.needs_checkpoints:
            return None
        try:
            with MODEL_CALLS:
                return Snapshotter.for_model(self._mx, self._lm_cache, self.model)
        except Exception:  # noqa: BLE001 - an mlx-lm model laid out otherwise: replay is always exact
            return None

    def _restore_kept_states(self, n_keep: int) -> bool:
        """Rewind into the passes since the newest checkpoint by what they kept: recurrent caches
        set to their state after ``n_keep`` tokens (the recurrence run again over those rows),
        the others trimmed, nothing fed. False where nothing is kept for ``n_keep`` (before or at
        the checkpoint, a long pass)."""
        states = self._pass_states
        if states is None or states.count < 0 or states.start + states.count != self.n_past:
            return False
        kept = n_keep - states.start
        if not 1 <= kept <= states.count:
            return False
        recurrent = set(self._snapshotter.recurrent)
        for index, layer in enumerate(self._cache):
            if index in recurrent:
                layer.cache = self._snapshotter.cache_state(states, index, kept)
            else:
                layer.trim(self.n_past - n_keep)
        del self._tokens[n_keep:]
        states.cut(kept)
        # computed now, on this thread's stream, as a replay's states were: not left to the next pass
        self._mx.async_eval([self._cache[index].cache for index in recurrent])
        return True

    def _restore(self, n_keep: int) -> None:
        """Go back to the newest checkpoint at or before ``n_keep``, then feed the tokens after it
        again; within the passes since the newest checkpoint, to their kept states where kept."""
        if self._restore_kept_states(n_keep):
            return
        self._pass_states = None
        while self._checkpoints and self._checkpoints[-1].n_past > n_keep:
            self._checkpoints.pop()
        kept_tokens = self._tokens[:n_keep]
        if not self._checkpoints:  # older than every checkpoint: rebuild from the start
            self._new_cache()
            replay_from = 0
        else:
            checkpoint = self._checkpoints.pop()  # the replay below checkpoints this position again
            for layer, state in zip(self._cache, checkpoint.layer_states):
                if state is None:
                    layer.trim(self.n_past - checkpoint.n_past)
                else:
                    layer.state = state  # the checkpoint is consumed, so its copies can go live
            replay_from = checkpoint.n_past
            del self._tokens[replay_from:]
        if n_keep > replay_from:
            self._forward_rows(kept_tokens[replay_from:], [], reduce=None)

    def _copy_arrays(self, state):
        """A copy of a cache state whose arrays later in-place cache updates cannot change."""
        if isinstance(state, (list, tuple)):
            return type(state)(self._copy_arrays(item) for item in state)
        if isinstance(state, self._mx.array):
            return self._mx.array(state)
        return state

    # ---- token trees ------------------------------------------------------------------
    @cached_property
    def tree_support(self) -> TreeSupport:
        """Trees need a packed pass (backends/mlx_common.packed_problem): a tree mask from
        ``make_mask`` over plain KVCache layers (nodes gathered out and back) and RoPE modules
        that take one offset per batch row."""
        problem = packed_problem(self.model, self._cache, "a tree")
        return TreeSupport(False, problem) if problem else TreeSupport(True)

    def forward_tree(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        """One pass for the tokens and the tree: ``make_mask`` shows each node the context and
        its ancestors, RoPE places it at n_past + depth. The nodes' keys and values are then
        gathered out of the cache and held for ``keep_path``, so the cache itself only ever
        holds committed tokens."""
        mx = self._mx
        logits = self._pass(self._forward_tree, tokens, tree, list(logit_rows),
                            lambda picked: picked.astype(mx.float32))
        return np.zeros((0, self.vocab.size), np.float32) if logits is None else np.array(logits)  # (R, V)

    def forward_tree_argmax(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        ids = self._pass(self._forward_tree, tokens, tree, list(logit_rows), self._kept_argmax)
        return np.zeros((0,), np.int64) if ids is None else np.array(ids).astype(np.int64)  # (R,): only ids cross

    def _forward_tree(self, tokens: Sequence[int], tree: TokenTree, rows: list[int], reduce):
        """``reduce`` of the (R, V) logits at ``rows``, evaluated; None when no rows are asked for."""
        self.tree_support.check(tree)
        tokens = [int(t) for t in tokens]
        n_fed = len(tokens) + len(tree)
        self._check_room(n_fed)
        if any(not 0 <= row < n_fed for row in rows):
            raise ValueError(f"logit rows {rows} fall outside the {n_fed} tokens and nodes fed")
        self._held_tree = None
        split = min([len(tokens), *rows])  # tokens before the first row asked for go unread
        self._feed_unread(tokens[:split])
        chain = tokens[split:]
        mx, start = self._mx, self.n_past
        ids = [*chain, *tree.tokens]
        if not ids:
            self._held_tree, self._held_kv = HeldTree(start, tree), []
            return None
        try:
            mask, positions = _tree_layout(mx, start, len(chain), tree)
            with packed_pass(self.model, self._cache, mask, mx.array(positions)):
                logits = self._run(mx.array(ids)[None])  # (1, C + n, V)
            slots = mx.array(np.arange(start + len(chain), start + len(ids)))  # (n,) the nodes' cache slots
            held = [(layer.keys[..., slots, :], layer.values[..., slots, :]) for layer in self._cache] if tree else []
            result = reduce(self._fit_vocab(logits[0, mx.array([row - split for row in rows])])) if rows else None
            mx.eval(result, held, self._cache_state())
        except BaseException:
            for layer in self._cache:  # Ctrl-C or a failure mid-pass: back to the tokens before it
                layer.trim(layer.offset - start)
            raise
        for layer in self._cache:  # the nodes leave the cache: it holds the committed tokens only
            layer.trim(len(tree))
        self._tokens.extend(chain)
        self._held_tree, self._held_kv = HeldTree(self.n_past, tree), held
        return result

    def keep_path(self, path: Sequence[int]) -> None:
        """Append the accepted nodes' held keys and values, in path order, to every layer's cache."""
        tree = held_tree_for(self._held_tree, self.n_past, path)
        held, self._held_tree, self._held_kv = self._held_kv, None, []
        if not path:
            return
        mx, picked = self._mx, self._mx.array(list(path))
        for layer_cache, (keys, values) in zip(self._cache, held):
            layer_cache.update_and_fetch(keys[..., picked, :], values[..., picked, :])
        mx.eval(self._cache_state())
        self._tokens.extend(tree.tokens[node] for node in path)

    # ---- hidden states ----------------------------------------------------------------
    @cached_property
    def hidden_support(self) -> HiddenSupport:
        """Available where ``split_model`` finds the body and head (checked on first use)."""
        try:
            self._split = split_model(self._mx, self._lm_cache, self.model)
        except ValueError as exc:
            return HiddenSupport(False, reason=str(exc))
        from mlx.utils import tree_flatten

        weights = sum(array.nbytes for _, array in tree_flatten(self.model.parameters()))
        size = self._split.size
        problem = self._layer_problem(size)
        return HiddenSupport(True, size, layers=self.n_layers, weight_bytes=int(weights),
                             layer_outputs=0 if problem else self.n_layers, layer_reason=problem)

    def _layer_problem(self, size: int) -> str:
        """Why tracked passes cannot give this model's layer outputs ("" where they can): its body
        keeps them in a ``layers`` list it calls in order, each returning the (1, T, H) residual
        stream, checked on a few tokens."""
        arch = getattr(self.model, "model_type", None) or type(self.model).__module__.rsplit(".", 1)[-1]
        body = self._split.body
        if not isinstance(getattr(body, "layers", None), list):
            return f"mlx-lm's {arch} body keeps no layers list"
        sink: list = []
        try:
            recorded = recording_body(body, range(len(body.layers)), sink)
            recorded(self._mx.array(SPLIT_PROBE), cache=self._lm_cache.make_prompt_cache(self.model))
        except Exception as exc:  # a body that reads its layers some other way
            return f"mlx-lm's {arch} body cannot run with its layers watched ({type(exc).__name__})"
        shapes = {tuple(getattr(out, "shape", ())) for _, out in sink}
        if [index for index, _ in sink] != list(range(len(body.layers))) or shapes != {(1, len(SPLIT_PROBE[0]), size)}:
            return f"mlx-lm's {arch} layers do not each return the {size}-wide residual stream"
        return ""

    def mtp_layer(self, heads):
        """``heads``' layer in MLX arrays (backends/mtp_mlx.py): a real vocabulary's head and a real
        layer's experts run in MLX rather than NumPy, the model's own embedding and head serving
        where the layer shares them."""
        from specrun.backends.mtp_mlx import MlxMtpLayer

        held = self._mtp_layers
        if id(heads) in held:  # one copy of a layer's weights, however many drafters (a server's slots) use it
            return held[id(heads)][1]
        if not self.hidden_support.available:
            layer = MlxMtpLayer(heads)
        else:
            split = self._split
            layer = MlxMtpLayer(heads, target_embed=getattr(split.body, "embed_tokens", None), target_head=split.head)
        self._mtp_layers = {**held, id(heads): (heads, layer)}  # the heads kept alive: their id stays theirs
        return layer

    def token_embeddings(self, ids: Sequence[int]) -> np.ndarray:
        """Rows of the body's ``embed_tokens`` (dequantized where the table is quantized)."""
        embeddings = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        if embeddings is None:
            raise ValueError("this mlx-lm model keeps no model.embed_tokens")
        mx = self._mx
        with MODEL_CALLS:  # a slot's heads may ask on their own thread while the slots' runner decodes
            return np.array(embeddings(mx.array(list(ids))).astype(mx.float32))

    def output_rows(self, ids: Sequence[int]) -> np.ndarray:
        """Rows of the output head's linear map (the tied embedding's rows where it is tied),
        dequantized where quantized."""
        support = self.hidden_support
        if not support.available:
            raise ValueError(f"this model's output head cannot be read: {support.reason}")
        linear, mx = self._split.linear, self._mx
        picked = mx.array(np.asarray(ids, dtype=np.int32))
        with MODEL_CALLS:
            if getattr(linear, "__self__", None) is not None:  # embed_tokens.as_linear: the embedding's rows
                rows = linear.__self__(picked)
            elif hasattr(linear, "scales"):  # a QuantizedLinear
                rows = mx.dequantize(linear.weight[picked], linear.scales[picked],
                                     linear["biases"][picked] if "biases" in linear else None,
                                     group_size=linear.group_size, bits=linear.bits,
                                     **({"mode": linear.mode} if hasattr(linear, "mode") else {}))
            elif hasattr(linear, "weight"):
                rows = linear.weight[picked]
            else:
                raise ValueError(f"this model's output head ({type(linear).__name__}) keeps no rows to read")
            return np.array(rows.astype(mx.float32))

    def logits_beyond_rows(self) -> str:
        """A final soft-cap or an output bias ("" neither; a model whose head is neither those nor a
        plain linear map gives no hidden states at all: split_model)."""
        if not self.hidden_support.available:
            return self.hidden_support.reason
        split = self._split
        if split.cap:
            return f"its logits are soft-capped at {split.cap:g} after its output head"
        if "bias" in getattr(split.linear, "__self__", split.linear):
            return "its output head adds a bias"
        return ""

    def _choose_layers(self, layers: tuple[int, ...]) -> None:
        self._layer_sink: list = []
        self._layer_body = recording_body(self._split.body, layers, self._layer_sink) if layers else None

    def _pass(self, run, *args):
        """``run(*args)`` as one pass: while tracking, the hidden states of every row it feeds
        (chunks fed unread included) become the last pass's."""
        self._hidden = None
        if not self._tracking:
            return run(*args)
        self._pass_hidden = []
        try:
            result = run(*args)
            mx = self._mx
            width = self._split.size * max(len(self._layers), 1)
            fed = mx.concatenate(self._pass_hidden) if self._pass_hidden else mx.zeros((0, width))
            self._hidden = np.array(fed.astype(mx.float32))  # (n_fed, H)
        finally:
            self._pass_hidden = None
        return result

    def _check_untracked(self, method: str) -> None:
        if self._tracking:
            raise ValueError(f"{method} gives no hidden states: use forward_argmax while tracking")

    # ---- the target's own layers as its draft (--draft self:layers=N) ------------------
    @property
    def n_layers(self) -> int:
        return len(self.model.layers)

    def open_window(self, sinks: int, window: int, owns: bool = False):
        """This model drafting from a second, small cache of the context's first ``sinks`` tokens
        and its last ``window`` (backends/window.py, backends/mlx_window.py)."""
        from specrun.backends.mlx_window import MlxWindowCache
        from specrun.backends.window import WindowedBackend

        return WindowedBackend(self, lambda cells: MlxWindowCache(self, cells), sinks, window, owns=owns)

    def layer_draft(self, kept: Sequence[int]) -> MlxBackend:
        """A backend running only layers ``kept`` of this model, then its final norm and output
        head, on a cache of its own: the layers are this model's objects (weights shared, not
        copied). mlx-lm's models run ``model.model.layers`` in order; the view is a shallow copy
        of the model and its body with that list cut, checked on a few tokens to run at all."""
        import copy

        arch = getattr(self.model, "model_type", None) or type(self.model).__module__.rsplit(".", 1)[-1]
        fix = "use --draft self:q4 or a draft model"
        body = getattr(self.model, "model", None)
        if body is None or not isinstance(getattr(body, "layers", None), list):
            raise ModelFileError(f"mlx-lm's {arch} model keeps no .model.layers list to draft with a part of", fix)
        # Bodies that mix attention kinds choose each layer's mask and cache by its place in the
        # list (gemma3's sliding pattern, llama's fa_idx/swa_idx): a cut list would shift them.
        kinds = set(getattr(body, "layer_types", None) or ())
        if len(kinds) > 1 or getattr(body, "swa_idx", None) is not None or hasattr(body, "sliding_window_pattern"):
            raise ModelFileError(f"mlx-lm's {arch} model mixes sliding-window and full attention by layer position, "
                                 "so a part of its layers cannot run apart", fix)
        try:
            view_body = copy.copy(body)
            view_body.layers = [body.layers[index] for index in kept]
            view = copy.copy(self.model)
            view.model = view_body  # a wrapper whose .model is a property (Qwen3.5's) refuses it
            self._mx.eval(view(self._mx.array(SPLIT_PROBE), cache=self._lm_cache.make_prompt_cache(view)))  # (1, 4, V)
        except Exception as exc:  # a body that indexes its layers some other way
            raise ModelFileError(f"mlx-lm's {arch} model cannot run a part of its layers ({type(exc).__name__})",
                                 fix) from exc
        draft = MlxBackend.from_loaded(view, self.tokenizer, n_ctx=self.n_ctx)
        draft.path = self.path
        draft.variant = "layers=" + ",".join(map(str, kept))  # its own tuning key (sessions/tuning.model_id)
        draft.shares_layers = True  # the target's own: its weights must never change (no online learning)
        return draft

    # ---- slots -----------------------------------------------------------------------
    def slots_problem(self) -> str | None:
        """Why this model cannot decode several sequences together (its caches, its RoPE); None
        where it can."""
        from specrun.backends.mlx_slots import slots_problem

        return slots_problem(self)

    def open_slots(self, n_slots: int, exact: bool, hidden: bool = False,  # noqa: ARG002 - no --exact on MLX
                   layers: Sequence[int] = (), tree_paths: int = 0):
        """``n_slots`` sequences of ``n_ctx`` tokens each in one cache on this model's weights,
        decoded together (backends/mlx_slots.MlxSlots); ``hidden``: its passes give hidden states
        too (``layers``' outputs where given), where this model gives them (``slots_hidden``);
        ``tree_paths``: a slot's pass may hold a tree (any number of paths), where
        ``slots_tree_problem`` says nothing."""
        from specrun.backends.mlx_slots import MlxSlots

        return MlxSlots(self, n_slots, self.n_ctx, hidden=hidden, layers=layers,
                        trees=bool(tree_paths) and not self.slots_tree_problem(exact))

    def slots_tree_problem(self, exact: bool) -> str:  # noqa: ARG002 - no --exact on MLX
        """Why slots on this model cannot hold trees ("" where they can): a packed pass holds them
        where it holds the slots (a sliding-window layer's too: the mask keeps its window, where a
        lone sequence's RotatingKVCache cannot hold a tree), but not a recurrent state's branches."""
        from specrun.backends.mlx_slots import recurrent_mixers, slots_problem

        if recurrent_mixers(self):
            return "a recurrent or hybrid model's state cannot hold a tree's branches"
        return slots_problem(self) or ""

    @property
    def slots_hidden(self) -> bool:
        """Can slots on this model give hidden states (its body split from its head)?"""
        return self.hidden_support.available

    def slot_cache_bytes(self, keeping: bool = True) -> int:
        """What a slot's sequence of ``n_ctx`` tokens holds in keys and values: every layer's
        width per token, read off a one-token pass on a cache of its own; a recurrent layer's state
        twice (the slot's, the one before its last pass: mlx_slots.py), three times ``keeping`` (a
        draft model's slot keeps one more)."""
        mx = self._mx
        cache = self._lm_cache.make_prompt_cache(self.model)
        with MODEL_CALLS:
            self.model(mx.array([[0]]), cache=cache)
        recurrent = [array for layer in cache if isinstance(layer, self._lm_cache.ArraysCache)
                     for array in layer.cache if array is not None]
        attention = [layer for layer in cache if not isinstance(layer, self._lm_cache.ArraysCache)]
        mx.eval([layer.state for layer in attention] + recurrent)
        per_token = 0
        for layer in attention:
            keys, values = layer.state[:2]
            per_token += keys.shape[1] * keys.shape[-1] * keys.itemsize + values.shape[1] * values.shape[-1] * values.itemsize
        return per_token * self.n_ctx + (2 + keeping) * sum(array.nbytes for array in recurrent)

    def online_trainer(self, learning_rate: float, seed: int = 0):
        """A trainer of LoRA adapters for this model as a draft (backends/mlx_lora.py). Not for a
        layer draft (``shares_layers``): its layers are the target's."""
        from .mlx_lora import LoraTrainer

        self._check_own_layers()
        return LoraTrainer(self.model, learning_rate, seed)

    def adapt(self, weights: dict) -> None:
        """Draft with what a LoraTrainer published (float maps fused, quantized ones' adapters)."""
        from .mlx_lora import load_published

        self._check_own_layers()
        load_published(self.model, weights)

    def _check_own_layers(self) -> None:
        if self.shares_layers:
            raise ValueError("a layer draft runs the target's own layers, whose weights must not change")

    def close(self) -> None:
        self._deferred = None
        self._ahead = None
        self._mtp_layers = {}
        self._cache = []
        self._checkpoints.clear()
        self._pass_states = None
        self._tokens.clear()
