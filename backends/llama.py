"""llama.cpp backend over llama-cpp-python's low-level ctypes API.

Why not ``llama_cpp.Llama``: it keeps its own token bookkeeping and, for
speculation, asks for logits at every position (logits_all); here a verify batch
requests logits only for the rows being verified, and rewinds go straight to the
KV memory (``llama_memory_seq_rm``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from specrun.backends.apart import run_apart
from specrun.backends.base import (
    HeldTree, HiddenSupport, HiddenTracking, TreeSupport, VocabInfo, held_tree_for, near_tie_rows,
)
from specrun.backends.llama_rpc import silence_logs
from specrun.errors import BackendUnavailableError, ContextFullError, ModelFileError
from specrun.native_order import share_cxx_runtime
from specrun.tree import TokenTree

GGUF_MAGIC = b"GGUF"
_SEQ = 0  # the one sequence id this backend uses
DEFAULT_CTX = 4096
# Root-to-leaf paths one tree pass may hold: one sequence id each, after sequence 0 (llama.cpp
# aborts on very large n_seq_max, and every sequence id costs bookkeeping in each batch).
MAX_TREE_PATHS = 64


def _import_llama_cpp():
    share_cxx_runtime()  # sentencepiece loaded first crashed llama.cpp's first model load (native_order)
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BackendUnavailableError(
            "the llama.cpp backend is not installed",
            "install it with: pip install 'specrun[llama]'",
        ) from exc
    return llama_cpp


def built_with_amx(llama_cpp) -> bool:
    """Was this llama.cpp built with its AMX matrix kernels (x86 with AMX under -march=native)?

    They crash on the first matrix product of a quantized model on some Sapphire Rapids
    machines (SIGSEGV in ggml_backend_amx_mul_mat; llama.cpp issue 20824, unfixed), this
    project's CI machine among them. tools/install_llama_cpp.sh builds without them; this
    catches a llama-cpp-python built elsewhere."""
    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def model_params_for(llama_cpp):
    """llama.cpp's default model parameters, with weights kept out of the AMX buffers where
    the library has AMX kernels (built_with_amx). That also turns off the CPU's repacked
    weights ("extra buffer types": one switch for both), a cost in speed on such a build only."""
    params = llama_cpp.llama_model_default_params()
    if built_with_amx(llama_cpp):
        params.use_extra_bufts = False
    return params


@functools.cache
def has_local_gpu() -> bool:
    """Does llama.cpp see a GPU on this machine (discrete or integrated)? Its
    ``llama_supports_gpu_offload`` also says yes for a CPU-only build with RPC."""
    from specrun.backends.llama_rpc import _Ggml

    return bool(_Ggml(_import_llama_cpp(), rpc=False).local_accelerators())

def _threads_from_environment() -> int | None:
    """$SPECRUN_THREADS where it is a count (a fixed one: never follows the load), else None."""
    configured = os.environ.get("SPECRUN_THREADS", "").strip()
    return int(configured) if configured.isdigit() and int(configured) > 0 else None


def default_threads() -> int:
    """$SPECRUN_THREADS, else every core (following the machine's load: cpu_load.py; llama.cpp's
    threads spin at barriers, so on a busy machine fewer threads than cores can be many times faster)."""
    return _threads_from_environment() or max(1, os.cpu_count() or 1)


def check_gguf_file(path: Path) -> None:
    """Raise a ModelFileError naming the problem if ``path`` is not a readable GGUF file."""
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}", "check the path or run `specrun models list`")
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, not a GGUF file", "pass the .gguf file inside it")
    if not path.is_file():  # opening a FIFO waits for a writer for ever
        raise ModelFileError(f"{path} is not a regular file (a FIFO, a socket or a device)",
                             "pass the .gguf model file itself")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror}", "check its permissions") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"{path} is not a GGUF file (it starts with {magic!r})",
            "pass a .gguf model, or download it again if it is truncated",
        )


# llama.cpp's file types (llama.h: LLAMA_FTYPE_MOSTLY_F16 = 1, _Q4_0 = 2, _Q8_0 = 7). Q4_0 is
# the 4-bit type of `--draft self:q4`: its blocks of 32 fit row lengths a K-quant's 256 does not
# (SmolLM2's 576), and llama.cpp's CPU backend repacks Q4_0 at load time for its fastest kernels.
QUANTIZE_FTYPES = {"F16": 1, "Q8_0": 7, "Q4_0": 2}


def quantize_gguf(source: Path, dest: Path, dtype: str) -> None:
    """Write ``source`` as ``dest`` in ``dtype`` (F16, Q8_0 or Q4_0) with llama.cpp's own quantizer.

    Requantizing (a Q4_1 file to F16, say) is allowed: the weights are what the file
    holds, dequantized, so the copy computes the same function up to the new rounding.
    """
    if dtype not in QUANTIZE_FTYPES:
        raise ValueError(f"dtype must be one of {sorted(QUANTIZE_FTYPES)}, got {dtype!r}")
    llama_cpp = _import_llama_cpp()
    check_gguf_file(Path(source))
    silence_logs(llama_cpp)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTIZE_FTYPES[dtype]
    params.allow_requantize = True
    params.nthread = default_threads()
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params))
    if status != 0:
        raise ModelFileError(
            f"llama.cpp could not write {Path(source).name} as {dtype} (status {status})",
            "check the file and the free disk space",
        )


# llama.cpp's graphs that change the logits after the output head where the file does not say
# otherwise (src/models/*.cpp, Oct 2026): the key whose default does it, or None where no key
# turns it off. Others do it only by a key (logit_scale, final_logit_softcapping) or a tensor.
LOGITS_CHANGED_BY_DEFAULT = {"gemma2": "final_logit_softcapping", "gemma4": "final_logit_softcapping",
                             "muse-glimmer": "final_logit_softcapping", "grok": "logit_scale",
                             "gemma3n": None, "minicpm3": None}

# ggml element types of the KV cache (ggml.h: GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1)
KV_TYPES = {"f16": 1, "f32": 0}

# The architectures whose llama.cpp graphs name every layer's input (llm_graph_result's
# t_layer_inp, set in src/models/*.cpp): asking another for one aborts the process.
LAYER_INPUT_ARCHS = (
    "llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "qwen4exp", "gemma4", "gpt-oss", "lfm2",
    "deepseek4", "bailingmoe3", "hunyuan_vl", "mimo2", "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige",
    "nemotron_h",
)
LAYER_INPUTS_VERSION = "0.3.36"  # the llama-cpp-python whose llama.cpp LAYER_INPUT_ARCHS was read from
# llama.cpp declares its layer-input extension (src/llama-ext.h) without extern "C": its symbols
# carry C++'s (Itanium) mangled names.
_SET_LAYER_INPUT = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
_GET_LAYER_INPUT = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"


def layer_input_functions(llama_cpp):
    """(set(ctx, layer, on), get(ctx, layer) -> address) for llama.cpp's layer-input extension;
    AttributeError where the library does not export it."""
    library = llama_cpp.llama_cpp._lib
    setter = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool)((_SET_LAYER_INPUT, library))
    getter = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32)((_GET_LAYER_INPUT, library))
    return setter, getter


# Recurrent and hybrid models (Mamba, Qwen3.5's Gated DeltaNet, ...): llama.cpp keeps the state
# after each of the last pass's final RS_SNAPSHOTS tokens (``n_rs_seq``), so a rejected draft of up
# to that many tokens rolls back in place; a longer or older rewind feeds the kept tokens again.
RS_SNAPSHOTS = 16
# keep_state's: the recurrent part of a sequence's state alone, left on the device
_KEPT_STATE_FLAGS = 1 | 2  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY | LLAMA_STATE_SEQ_FLAGS_ON_DEVICE


def _native_mtp_arch(path: Path) -> str | None:
    """The architecture of the GGUF at ``path`` where it carries MTP layers llama.cpp runs for
    specrun (llama_mtp.NATIVE_ARCHS); None else, or where the header does not say."""
    from specrun.backends.llama_mtp import NATIVE_ARCHS
    from specrun.modelkit.gguf_header import header_values

    try:
        values = dict(header_values(path))
    except (OSError, ValueError):
        return None
    arch = values.get("general.architecture")
    layers = values.get(f"{arch}.nextn_predict_layers", 0)
    # Each of these architectures' MTP graphs runs exactly one block: llama.cpp aborts the process
    # making an MTP context for a file with more (the NumPy layer drafts with its first instead).
    return arch if arch in NATIVE_ARCHS and layers == 1 else None


def _tree_context_params(ctx_params, tree_paths: int) -> int:
    """Ready the context for trees of up to ``tree_paths`` root-to-leaf paths (0: chains only).

    A tree needs a unified KV cache (llama.cpp refuses tokens of coupled sequences
    without one) and a sequence id per path besides sequence 0; a chains-only context
    keeps llama.cpp's single-sequence defaults.
    """
    if not 0 <= tree_paths <= MAX_TREE_PATHS:
        raise ValueError(f"tree_paths must be between 0 and {MAX_TREE_PATHS}, got {tree_paths}")
    if tree_paths:
        ctx_params.kv_unified = True
        ctx_params.n_seq_max = 1 + tree_paths
    return tree_paths


class LlamaCppBackend(HiddenTracking):
    """One GGUF model and one llama.cpp context (KV cache) for a single sequence.

    flash_attn: None keeps llama.cpp's automatic choice (on, where the device supports
    it: as fast as llama.cpp's own tools); False turns it off. On a CPU flash attention
    makes logits depend on the batch shape (measured: top-2 flips at gaps of 0.0018),
    so verified tokens can differ from plain decoding's at near-ties.
    tree_paths: the most root-to-leaf paths a token tree may have (``forward_tree``); 0, the
    default, creates a chains-only context as before.
    rpc: llama.cpp RPC servers (``HOST:PORT``) the model's layers are split over, with this
    machine's GPUs if it has any (backends/llama_rpc.py); every layer is offloaded unless
    ``gpu_layers`` says otherwise.
    kv_type: the KV cache's element type, "f16" (llama.cpp's default) or "f32". Keys and
    values written by a multi-token verify pass round differently in F16 than those
    written one token at a time (measured: a greedy flip at a top-2 gap of 0.0043 with
    a Q8_0 model). Flash attention off and F32 make greedy speculation bit-identical to
    plain decoding (``--exact``) at twice the cache memory.

    Hidden states (``track_hidden``) are llama.cpp's token embeddings: with embeddings on and
    no pooling, each output row's ``result_norm``, the output head's input. llama.cpp then
    outputs every row of a batch, so a tracked pass computes logits for every row too. Layer
    outputs (``hidden_layers``, for EAGLE-3) are the inputs of the layers after them, which
    llama.cpp copies out for every row fed (``llama_set_embeddings_layer_inp``, the extension
    its own EAGLE-3 drafting reads them with) in the architectures whose graphs name them
    (LAYER_INPUT_ARCHS); the last layer's output is not among them.
    """

    name = "llama"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        gpu_layers: int | None = None,
        n_batch: int = 512,
        flash_attn: bool | None = None,
        kv_type: str = "f16",
        tree_paths: int = 0,
        rpc: tuple[str, ...] = (),
    ) -> None:
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        llama_cpp = _import_llama_cpp()
        self._lib = llama_cpp
        self.path = Path(path)
        check_gguf_file(self.path)
        silence_logs(llama_cpp)
        llama_cpp.llama_backend_init()

        model_params = model_params_for(llama_cpp)
        # A model carrying MTP layers llama.cpp runs is loaded with them (their weights: one more
        # block, memory-mapped on a CPU), so its MTP drafter runs them natively (native_mtp).
        self._mtp_arch = _native_mtp_arch(self.path)
        model_params.load_mtp = self._mtp_arch is not None
        self._native_mtp = None
        self.rpc = rpc
        # What changes its pass costs gives it its own tuning key (sessions/tuning.model_id): the
        # servers' and the network's with --rpc, flash attention's kernels where it is chosen.
        self._devices = None  # the target's devices with --rpc, alive as long as the model
        if rpc:
            from specrun.backends.llama_rpc import target_devices

            self._devices = target_devices(llama_cpp, rpc)
            model_params.devices = ctypes.addressof(self._devices)
        if gpu_layers is None:
            gpu_layers = -1 if rpc or llama_cpp.llama_supports_gpu_offload() else 0
        model_params.n_gpu_layers = gpu_layers
        self._gpu_layers = gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self._model:
            raise ModelFileError(
                f"llama.cpp could not load {self.path} (corrupt, truncated or an unsupported architecture)",
                "download the file again or check that this llama-cpp-python version supports the model",
            )
        self._vocab_p = llama_cpp.llama_model_get_vocab(self._model)
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(self._model)
                              or llama_cpp.llama_model_is_hybrid(self._model))
        self._fed: list[int] = []  # a recurrent model's cached tokens: what a long rewind feeds again
        self._last_pass = 0  # tokens of the last chunk fed: the positions its snapshots cover
        self._rolled_back = False  # a rollback is pending until the next decode (llama.cpp: one at a time)
        self._kept_state: tuple[int, object, int] | None = None  # keep_state's: (position, buffer, size)

        if n_ctx is None:  # default: the training context, capped to keep the KV cache modest
            n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._model)
            n_ctx = min(DEFAULT_CTX, n_ctx_train) if n_ctx_train > 0 else DEFAULT_CTX
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        threads = self.n_threads = n_threads or default_threads()
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = self.n_ctx
        ctx_params.n_batch = n_batch
        ctx_params.n_ubatch = n_batch
        ctx_params.n_seq_max = 1
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        ctx_params.no_perf = True
        ctx_params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE  # token embeddings are the hidden states
        ctx_params.type_k = ctx_params.type_v = KV_TYPES[kv_type]
        # Sliding-window layers (Gemma 3: 512 tokens) get a full-size cache, as llama.cpp's C default
        # has it but its `common` tools and server do not: a smaller one overwrites cells that fell out
        # of the window, and a rewind (a rejected draft, a reused prompt) would need them again.
        ctx_params.swa_full = True
        if self.recurrent:
            ctx_params.n_rs_seq = RS_SNAPSHOTS
        self.kv_type = kv_type
        self.library_version = f"llama-cpp-python {llama_cpp.__version__}"  # what kernels it runs
        if flash_attn is not None:  # None keeps llama.cpp's automatic choice, its default
            ctx_params.flash_attn_type = (
                llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        self.flash_attn = flash_attn
        self._set_variant()
        self._ctx_params = ctx_params  # what a context re-created for trees (open_for_trees) is made with
        self._ctx = None
        # the default thread count yields cores other processes keep busy (cpu_load.py): never a
        # count the user chose (--threads, $SPECRUN_THREADS), nor where the layers run on a GPU
        self._follower = None
        if n_threads is None and threads > 1 and _threads_from_environment() is None and self.runs_on_cpu:
            from specrun.backends.cpu_load import LoadFollower

            self._follower = LoadFollower(threads)
        try:
            self._open_context(tree_paths)
        except BaseException:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab_p)
        self.vocab = self._read_vocab_info()
        self._pieces: dict[int, bytes] = {}
        self._control_texts: frozenset[str] | None = None
        self._logits_views: dict[tuple[int, int], np.ndarray] = {}  # by (buffer address, rows)
        self._hidden_views: dict[tuple[int, int], np.ndarray] = {}  # likewise, of the embeddings
        # llama_get_logits with an integer result: no ctypes pointer object per call.
        self._logits_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
            ("llama_get_logits", llama_cpp.llama_cpp._lib)
        )
        self._embeddings_address = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
            ("llama_get_embeddings_ith", llama_cpp.llama_cpp._lib)
        )
        self._first_output = 0  # the fed row of the tracked decode's first logits row
        self._every_row = False  # did the last decode output every row (embeddings on)?
        self._gguf_tensors = None  # the file's tensors by name (memory-mapped), once rows are asked for
        self._layer_states: list[np.ndarray] = []  # a tracked decode's layer outputs, chunk by chunk

    def _set_variant(self) -> None:
        """What changes its pass costs gives it its own tuning key (sessions/tuning.model_id): the
        servers' and the network's with --rpc, flash attention's kernels where it is chosen."""
        settings = ([f"rpc={','.join(self.rpc)}"] if self.rpc else []) + \
            ([f"flash={'on' if self.flash_attn else 'off'}"] if self.flash_attn is not None else [])
        if settings:
            self.variant = ";".join(settings)

    # ---- flash attention, chosen by measurement (sessions/kernels.py) --------------------
    @property
    def runs_on_cpu(self) -> bool:
        """Every layer on this machine's CPU: no GPU offload, no RPC servers."""
        return not self.rpc and (self._gpu_layers == 0 or not has_local_gpu())

    def time_flash_attn(self, depth: int, counts: Sequence[int], budget_s: float,
                        max_rounds: int = 9) -> tuple[int, dict[bool, dict[int, float]]]:
        """(the depth reached, median seconds of one pass over n tokens after it): every row an output
        as in a verify pass, for each n of ``counts``, with flash attention on (True) and off
        (False). Two scratch contexts of this model are fed alike and their passes alternated,
        so both see the same machine; this backend's own context is untouched. The prefill
        stops early (both at the same depth) once it has taken a quarter of ``budget_s``, and
        the rounds once the whole has taken ``budget_s``; at least 16 tokens of prefill and two
        rounds are always made, so a large model on a small CPU can take longer. (0, {}) where
        nothing can be timed: a recurrent or hybrid model (its cache cannot drop a pass), or a
        scratch context llama.cpp cannot create (memory). A failed pass raises ContextFullError.

        The passes run apart from the caller, on a thread that ends with them (backends/apart.py:
        a team of CPU threads left on a server's loading thread slowed every pass its slots ran);
        an interrupt stops them at the next pass."""
        if depth < 1 or not counts or min(counts) < 1 or max(counts) > self.n_batch:
            raise ValueError(f"cannot time passes of {list(counts)} tokens after {depth}")
        return run_apart(lambda stop: self._time_flash_attn(depth, counts, budget_s, max_rounds, stop))

    def _time_flash_attn(self, depth: int, counts: Sequence[int], budget_s: float, max_rounds: int,
                         stop) -> tuple[int, dict[bool, dict[int, float]]]:
        lib = self._lib
        if lib.llama_model_is_recurrent(self._model) or lib.llama_model_is_hybrid(self._model):
            return 0, {}
        flags = (True, False)
        contexts: dict[bool, object] = {}
        batch = lib.llama_batch_init(self.n_batch, 0, 1)
        try:
            for flag in flags:
                params = type(self._ctx_params).from_buffer_copy(self._ctx_params)
                params.n_ctx = depth + max(counts)
                params.n_seq_max, params.kv_unified = 1, False
                params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flag
                                          else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
                ctx = lib.llama_init_from_model(self._model, params)
                if not ctx:
                    return 0, {}
                contexts[flag] = ctx

            def decode(ctx, tokens: Sequence[int], start: int, outputs: bool) -> None:
                if stop.is_set():  # the caller was interrupted: no more passes
                    raise InterruptedError("the flash attention timing was stopped")
                batch.n_tokens = len(tokens)
                for i, token in enumerate(tokens):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
                    batch.seq_id[i][0] = _SEQ
                    batch.logits[i] = outputs or i == len(tokens) - 1
                if lib.llama_decode(ctx, batch) != 0:
                    raise ContextFullError(f"llama.cpp could not decode a timing pass of {len(tokens)} tokens",
                                           "free memory, or pass --flash-attn on or off")

            # Any ids of the vocabulary will do: what a pass costs does not depend on them.
            tokens = [(7 * i + 3) % self.n_vocab for i in range(depth + max(counts))]
            # 16 tokens first (a large model on a small CPU stops there), then 64 at a time
            started, fed = time.perf_counter(), 0
            while fed < depth and (fed == 0 or time.perf_counter() - started < budget_s / 4):
                chunk = min(16 if fed == 0 else 64, self.n_batch, depth - fed)
                for ctx in contexts.values():
                    decode(ctx, tokens[fed : fed + chunk], fed, False)
                fed += chunk
            samples = {flag: {n: [] for n in counts} for flag in flags}
            for round_number in range(max_rounds):
                for n in counts:
                    for flag in (flags if round_number % 2 == 0 else flags[::-1]):
                        memory = lib.llama_get_memory(contexts[flag])
                        began = time.perf_counter()
                        decode(contexts[flag], tokens[fed : fed + n], fed, True)
                        samples[flag][n].append(time.perf_counter() - began)
                        if not lib.llama_memory_seq_rm(memory, _SEQ, fed, -1):
                            return 0, {}  # a cache that cannot drop the pass: nothing more to time
                if round_number >= 1 and time.perf_counter() - started > budget_s:
                    break
            return fed, {flag: {n: float(np.median(times)) for n, times in by_count.items()}
                         for flag, by_count in samples.items()}
        finally:
            for ctx in contexts.values():
                lib.llama_free(ctx)
            lib.llama_batch_free(batch)

    def set_flash_attn(self, on: bool) -> None:
        """Re-create the context, empty, with flash attention on or off (a choice made by
        measurement, sessions/kernels.py); the tuning key follows. Before anything is fed only."""
        if self._n_past or self._tracking:
            raise RuntimeError("set_flash_attn re-creates the context: call it before anything is fed")
        lib = self._lib
        previous = self._ctx_params.flash_attn_type
        self._ctx_params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if on
                                            else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self._free_context()  # it holds nothing yet; two at once would need twice the cache memory
        try:
            self._open_context(self._tree_paths)
        except BaseException:
            self._ctx_params.flash_attn_type = previous
            self._open_context(self._tree_paths)  # the context it had, which fitted
            raise
        self.flash_attn = on
        self._set_variant()

    # ---- vocabulary ---------------------------------------------------------------
    def _read_vocab_info(self) -> VocabInfo:
        lib, vocab = self._lib, self._vocab_p
        bos = lib.llama_vocab_bos(vocab)
        eos_ids = frozenset(t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(vocab, t))
        return VocabInfo(
            size=self.n_vocab,
            bos_id=bos if bos >= 0 else None,
            eos_ids=eos_ids,
            add_bos=bool(lib.llama_vocab_get_add_bos(vocab)),
        )

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buffer = (self._lib.llama_token * capacity)()
        count = self._lib.llama_tokenize(self._vocab_p, data, len(data), buffer, capacity, add_bos, special)
        if count < 0:  # the buffer was too small: -count is the size needed
            capacity = -count
            buffer = (self._lib.llama_token * capacity)()
            count = self._lib.llama_tokenize(self._vocab_p, data, len(data), buffer, capacity, add_bos, special)
        return list(buffer[:count])

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buffer = ctypes.create_string_buffer(64)
            size = self._lib.llama_token_to_piece(self._vocab_p, token, buffer, 64, 0, False)
            if size < 0:
                buffer = ctypes.create_string_buffer(-size)
                size = self._lib.llama_token_to_piece(self._vocab_p, token, buffer, -size, 0, False)
            piece = buffer.raw[:size]
            self._pieces[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        return self._lib.llama_vocab_get_text(self._vocab_p, token).decode("utf-8", errors="replace")

    def fill_token_ids(self) -> dict[str, int]:
        """The fill-in-the-middle tokens llama.cpp found (the GGUF's ids, else its spellings of
        each family): "prefix", "suffix", "middle", "repo", "separator", those it found none of
        left out (sessions/infill.py)."""
        lib, vocab = self._lib, self._vocab_p
        found = {"prefix": lib.llama_vocab_fim_pre(vocab), "suffix": lib.llama_vocab_fim_suf(vocab),
                 "middle": lib.llama_vocab_fim_mid(vocab), "repo": lib.llama_vocab_fim_rep(vocab),
                 "separator": lib.llama_vocab_fim_sep(vocab)}
        return {role: int(token) for role, token in found.items() if 0 <= token < self.n_vocab}

    def control_texts(self) -> frozenset[str]:
        if self._control_texts is None:
            # llama.cpp's tokenizer reads these as tokens only with parse_special (user-defined
            # tokens it reads either way: they are text by the vocabulary's own definition).
            lib, vocab = self._lib, self._vocab_p
            special = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_UNKNOWN
            self._control_texts = frozenset(
                self.token_text(t) for t in range(self.n_vocab) if lib.llama_vocab_get_attr(vocab, t) & special
            )
        return self._control_texts

    def chat_template(self) -> str | None:
        template = self._lib.llama_model_chat_template(self._model, None)
        return template.decode("utf-8") if template else None

    def metadata(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(4096)
        size = self._lib.llama_model_meta_val_str(self._model, key.encode(), buffer, 4096)
        return buffer.value.decode("utf-8", errors="replace") if size >= 0 else None

    # ---- the KV cache ---------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self._n_past

    def forward(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        rows = self._decode(tokens, logit_rows)
        return self._output_logits(rows).copy()  # (n_rows, V): the context reuses its buffer

    def forward_argmax(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        rows = self._argmax_rows = self._decode(tokens, logit_rows)
        return self._output_logits(rows).argmax(axis=-1)

    def last_pass_ties(self, indices: Sequence[int], margin: float) -> np.ndarray:
        return near_tie_rows(self._output_logits(self._argmax_rows)[list(indices)], margin)

    def _output_logits(self, rows: list[int]) -> np.ndarray:
        """A view of the last decode's logits, one row per requested row, in the order asked.

        llama.cpp stores the outputs of the flagged batch entries contiguously in batch
        order. Views are cached by buffer address, which changes only when llama.cpp
        reallocates its output buffer.
        """
        if not rows:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        if self._every_row:  # a tracked decode output every row from _first_output on
            outputs = self._logits_buffer(len(self._hidden) - self._first_output)
            return outputs[[row - self._first_output for row in rows]]
        outputs = self._logits_buffer(len(rows))
        if all(a < b for a, b in zip(rows, rows[1:])):
            return outputs
        return outputs[np.argsort(np.argsort(rows))]  # back to the order asked for

    def _logits_buffer(self, n_rows: int) -> np.ndarray:
        """The last decode's logits (n_rows, V) as a view, in batch order."""
        key = (self._logits_address(self._ctx), n_rows)
        outputs = self._logits_views.get(key)
        if outputs is None:  # the buffer moved or grew: build (and keep) a view of it
            buffer = (ctypes.c_float * (n_rows * self.n_vocab)).from_address(key[0])
            outputs = np.frombuffer(buffer, dtype=np.float32).reshape(n_rows, self.n_vocab)
            self._logits_views[key] = outputs
        return outputs

    def _decode(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> list[int]:
        """Feed ``tokens`` in n_batch chunks (logit rows only in the last); returns the rows."""
        rows = list(logit_rows)
        if self._n_past + len(tokens) > self.n_ctx:
            raise ContextFullError(
                f"the context of {self.n_ctx} tokens is full", "shorten the prompt or raise --ctx"
            )
        if self._tracking and not self._layers:
            return self._decode_tracked(tokens, rows)
        self._hidden, self._every_row = None, False
        self._layer_states = []
        if not tokens:  # llama_decode refuses an empty batch
            pass
        elif len(tokens) <= self.n_batch:  # the common case: one chunk, no bookkeeping
            self._decode_chunk(tokens, set(rows))
        else:
            last_start = (len(tokens) - 1) // self.n_batch * self.n_batch
            if rows and min(rows) < last_start:
                raise ValueError("logit rows must fall in the last n_batch tokens of a forward")
            wanted = {row - last_start for row in rows}
            for start in range(0, len(tokens), self.n_batch):
                self._decode_chunk(tokens[start : start + self.n_batch], wanted if start == last_start else ())
        if self._tracking:  # layer outputs: every row's, whichever rows gave logits
            states = self._layer_states or [np.zeros((0, self.hidden_support.size * len(self._layers)), np.float32)]
            self._hidden = states[0] if len(states) == 1 else np.concatenate(states)
            self._layer_states = []
        return rows

    def _decode_tracked(self, tokens: Sequence[int], rows: list[int]) -> list[int]:
        """``_decode`` with embeddings on: every row of every chunk is an output (llama.cpp
        insists), so each chunk's hidden states are copied out before the next overwrites them."""
        self._hidden, self._every_row = None, True
        last_start = (len(tokens) - 1) // self.n_batch * self.n_batch if tokens else 0
        if rows and min(rows) < last_start:
            raise ValueError("logit rows must fall in the last n_batch tokens of a forward")
        states = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            self._decode_chunk(chunk, range(len(chunk)))
            states.append(self._output_hidden(len(chunk)))
        # (n_fed, H); one chunk (every step's pass) as it came: a plain step's bookkeeping is
        # what tracking costs where heads sit idle (auto with heads the policy keeps off)
        hidden = states[0] if len(states) == 1 else np.concatenate([self._output_hidden(0), *states])
        self._hidden, self._first_output = hidden, last_start
        return rows

    def _output_hidden(self, n_rows: int) -> np.ndarray:
        """A copy of the last decode's hidden states (n_rows, H): every row was an output, and
        llama.cpp keeps outputs contiguous in batch order, so row 0's pointer starts them all.
        Views are cached by buffer address, as the logits' are (``_logits_buffer``)."""
        size = self.hidden_support.size
        if not n_rows:  # nothing was decoded
            return np.zeros((0, size), np.float32)
        address = self._embeddings_address(self._ctx, 0)
        if not address:
            raise RuntimeError("llama.cpp returned no embeddings for a tracked decode")
        key = (address, n_rows)
        view = self._hidden_views.get(key)
        if view is None:
            buffer = (ctypes.c_float * (n_rows * size)).from_address(address)
            view = self._hidden_views[key] = np.frombuffer(buffer, dtype=np.float32).reshape(n_rows, size)
        return view.copy()

    def busy_now(self) -> bool:
        """Do other processes hold cores now, by the load this backend's count follows? False where
        the count is fixed (nothing is read)."""
        return self._follower is not None and self._follower.busy()

    def thread_tally(self):
        """Its passes so far and how many ran on fewer threads (cpu_load.ThreadTally); None where
        the count is not followed."""
        return None if self._follower is None else self._follower.tally()

    def follow_load(self, ctx=None) -> None:
        """Before a pass: the thread count cpu_load.LoadFollower gives (``ctx``: a context of this
        model's other than the backend's own, such as its slots', which tracks its own count)."""
        if self._follower is None:
            return
        threads = self._follower.threads()
        owner = self if ctx is None else ctx
        if threads != owner._threads_now:
            self._lib.llama_set_n_threads(owner._ctx, threads, threads)
            owner._threads_now = threads

    def _decode_chunk(self, chunk: Sequence[int], wanted) -> None:
        self._fill_batch(chunk, wanted)
        self.follow_load()
        status = self._lib.llama_decode(self._ctx, self._batch)
        if status != 0:
            raise ContextFullError(
                f"llama.cpp decode failed with status {status} at {self._n_past} cached tokens",
                "shorten the prompt or raise --ctx",
            )
        if self.recurrent:
            del self._fed[self._n_past :]
            self._fed.extend(chunk)
            self._last_pass, self._rolled_back = len(chunk), False
        self._n_past += len(chunk)
        if self._tracking and self._layers:
            self._layer_states.append(self._output_layers(len(chunk)))

    def _output_layers(self, n_rows: int) -> np.ndarray:
        """A copy of the last decode's layer outputs (n_rows, len(layers) * H): the inputs of the
        layers after them, every row fed, in batch order."""
        size = self.hidden_support.size
        states = np.empty((n_rows, size * len(self._layers)), np.float32)
        for slot, layer in enumerate(self._layers):
            address = self._layer_input(self._ctx, layer + 1)
            if not address:
                raise RuntimeError(f"llama.cpp returned no output of layer {layer} for a tracked decode")
            buffer = (ctypes.c_float * (n_rows * size)).from_address(address)
            states[:, slot * size : (slot + 1) * size] = np.frombuffer(buffer, dtype=np.float32).reshape(n_rows, size)
        return states

    def _fill_batch(self, chunk: Sequence[int], wanted) -> None:
        batch = self._batch
        batch.n_tokens = len(chunk)
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = self._n_past + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = _SEQ
            batch.logits[i] = i in wanted

    def rewind(self, n_keep: int) -> None:
        if self.recurrent:
            self._rewind_recurrent(n_keep)
            return
        # Always clear from n_keep on, even past n_past: an interrupted decode may have
        # left cells that n_past does not count.
        if not self._lib.llama_memory_seq_rm(self._memory, _SEQ, n_keep, -1):
            raise ModelFileError(
                f"{self.path.name} has a cache that cannot be rewound (recurrent or sliding-window state)",
                "use --method none with this model",
            )
        self._n_past = min(self._n_past, n_keep)

    def keep_state(self) -> None:
        """A recurrent or hybrid model: keep its recurrent state as it is now (on the device, the
        attention cache aside: llama.cpp's partial sequence state), so that a later rewind to here
        or after, past the last pass's snapshots, feeds only the tokens since. A draft model keeps
        it before it drafts: its drafts are a pass each, so a rejected one lies before the last
        pass, where without it the draft reads its whole text again. One is kept; nothing happens
        for other models."""
        if not self.recurrent or not self._n_past:  # nothing to keep: a rewind to 0 starts afresh
            self._kept_state = None
            return
        lib, flags = self._lib, _KEPT_STATE_FLAGS
        size = lib.llama_state_seq_get_size_ext(self._ctx, _SEQ, flags)
        buffer = (ctypes.c_uint8 * max(size, 1))()
        written = lib.llama_state_seq_get_data_ext(self._ctx, buffer, size, _SEQ, flags) if size else 0
        self._kept_state = (self._n_past, buffer, written) if written else None

    def _rewind_recurrent(self, n_keep: int) -> None:
        """A recurrent state cannot drop positions: dropping the last pass's final few rolls back to
        llama.cpp's snapshot of the state after the kept ones; a rewind to or after the kept state
        (keep_state) restores it and feeds the tokens since; any other starts the state again and
        feeds the kept tokens."""
        drop = self._n_past - n_keep
        if drop <= 0:
            return
        lib = self._lib
        if (drop < self._last_pass and drop <= RS_SNAPSHOTS and not self._rolled_back
                and lib.llama_memory_seq_rm(self._memory, _SEQ, n_keep, -1)):
            self._n_past, self._rolled_back = n_keep, True
            del self._fed[n_keep:]
            return
        start = 0
        kept_state = self._kept_state
        if kept_state is not None and kept_state[0] > n_keep:
            self._kept_state = kept_state = None  # the text it was kept in is gone
        if kept_state is not None:
            at, buffer, size = kept_state
            # the recurrent part back to position at - 1, then the attention cells from at dropped
            # (the hybrid's removal asks the recurrent part first, which now holds nothing past them)
            if (lib.llama_state_seq_set_data_ext(self._ctx, buffer, size, _SEQ, _KEPT_STATE_FLAGS)
                    and lib.llama_memory_seq_rm(self._memory, _SEQ, at, -1)):
                start = at
            else:
                self._kept_state = None
        kept = self._fed[start:n_keep]
        if not start:
            lib.llama_memory_seq_rm(self._memory, _SEQ, 0, -1)  # always possible: the whole sequence
        self._n_past, self._last_pass, self._rolled_back = start, 0, False
        del self._fed[start:]
        if kept:
            tracking = self._tracking
            self._tracking = False  # what is fed again was read before: its states are not asked for
            try:
                self._decode(kept, [])
            finally:
                self._tracking = tracking

    # ---- slots -----------------------------------------------------------------------
    def open_slots(self, n_slots: int, exact: bool, hidden: bool = False, layers: Sequence[int] = (),
                   tree_paths: int = 0):
        """A second context on this model holding ``n_slots`` sequences of ``n_ctx`` tokens each,
        decoded together (backends/llama_slots.LlamaSlots); ``exact``: each sequence's logits are
        the ones it gets alone, bit for bit; ``hidden``: its passes give hidden states too (heads
        drafting for the slots), where this model gives them (``slots_hidden``): the outputs of
        ``layers`` where given (ValueError naming why where it cannot), else the output head's input;
        ``tree_paths``: a slot's pass may hold a tree of that many paths (not with ``exact``)."""
        from specrun.backends.llama_slots import LlamaSlots

        hidden = hidden and self.slots_hidden
        return LlamaSlots(self, n_slots, self.n_ctx, exact=exact, hidden=hidden, layers=layers if hidden else (),
                          tree_paths=tree_paths)

    def slots_tree_problem(self, exact: bool) -> str:
        """Why slots on this model cannot hold trees ("" where they can: LlamaSlots' tree_paths, as
        many paths as this model was opened for)."""
        if self.recurrent:
            return "a recurrent or hybrid model's state cannot hold a tree's branches"
        if exact:
            return "--exact gives each sequence a cache stream of its own, which a tree's paths cannot share"
        if not self.tree_support.available:
            return self.tree_support.reason
        return ""

    @property
    def slots_hidden(self) -> bool:
        """Can slots on this model give hidden states (the output head's input)?"""
        return self.hidden_support.available

    def slot_cache_bytes(self, keeping: bool = True) -> int:
        """What a slot's sequence of ``n_ctx`` tokens holds in keys and values (every layer's, as
        the model's metadata gives their widths: an upper bound for a hybrid's attention), and a
        recurrent model's state with llama.cpp's snapshots of it (``n_rs_seq``) and, ``keeping``
        (a draft model's slot: LlamaSlots.keep), a kept copy."""
        lib, model = self._lib, self._model
        arch = self.metadata("general.architecture") or ""
        heads, kv_heads = lib.llama_model_n_head(model), lib.llama_model_n_head_kv(model)
        width = lib.llama_model_n_embd(model) // max(heads, 1)

        def length(key: str) -> int:
            value = self.metadata(f"{arch}.attention.{key}")
            return int(value) if value and value.isdigit() else width

        per_token = lib.llama_model_n_layer(model) * kv_heads * (length("key_length") + length("value_length"))
        states = 1 + RS_SNAPSHOTS + keeping  # the state, its snapshots, a draft slot's kept copy
        return per_token * (4 if self.kv_type == "f32" else 2) * self.n_ctx + self._state_bytes() * states

    def _state_bytes(self) -> int:
        """A recurrent model's state of one sequence, as llama.cpp writes it (0 for other models);
        an empty context is fed a token to have one, and emptied again."""
        if not self.recurrent:
            return 0
        flags = _KEPT_STATE_FLAGS & 1  # the recurrent part, written out
        if self._n_past:
            return int(self._lib.llama_state_seq_get_size_ext(self._ctx, _SEQ, flags))
        self._decode([0], [])
        try:
            return int(self._lib.llama_state_seq_get_size_ext(self._ctx, _SEQ, flags))
        finally:
            self.rewind(0)

    def slots_shared_bytes(self, hidden: bool, layers: Sequence[int] = ()) -> int:
        """What slots opened with ``hidden`` hold besides their sequences' caches: llama.cpp's output
        buffer for a batch whose every row is an output (embeddings on: each row's logits and its
        state, ~300 MB at a 150k vocabulary), or with ``layers`` their outputs for every row fed."""
        if not hidden:
            return 0
        rows = max(self.n_batch, 512)  # LlamaSlots' batch
        width = self._lib.llama_model_n_embd(self._model)
        if layers:
            return rows * width * len(layers) * 4
        return rows * (self.n_vocab + width) * 4

    # ---- a windowed cache --------------------------------------------------------------
    def open_window(self, sinks: int, window: int, owns: bool = False):
        """This model drafting from a second, small cache of the context's first ``sinks`` tokens
        and its last ``window`` (backends/window.py); ``owns``: closing it closes this backend."""
        from specrun.backends.llama_window import LlamaWindowCache
        from specrun.backends.window import WindowedBackend

        if self.recurrent:
            raise ModelFileError(f"{self.path.name} keeps a recurrent state, from which a window cannot drop tokens",
                                 "drop --window")
        return WindowedBackend(self, lambda cells: LlamaWindowCache(self, cells), sinks, window, owns=owns)

    # ---- token trees -----------------------------------------------------------------
    def _open_context(self, tree_paths: int) -> None:
        """Create this backend's context, empty, for chains (0) or trees of ``tree_paths`` paths;
        the context it had (if any) is freed only once the new one exists."""
        lib = self._lib
        params = type(self._ctx_params).from_buffer_copy(self._ctx_params)
        paths = _tree_context_params(params, 0 if self.recurrent else tree_paths)
        ctx = lib.llama_init_from_model(self._model, params)
        if not ctx:
            raise ModelFileError(
                f"llama.cpp could not create a context of {self.n_ctx} tokens for {self.path}",
                "lower --ctx or free memory",
            )
        if self._ctx:
            self._free_context()
        self._ctx, self._tree_paths = ctx, paths
        self._threads_now = params.n_threads  # a new context starts at the count it was made with
        self._memory = lib.llama_get_memory(ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        # a node carries the sequence ids of every path through it
        self._tree_batch = lib.llama_batch_init(self.n_batch, 0, paths + 1) if paths else None
        self._held_tree: HeldTree | None = None
        self._logits_views, self._hidden_views = {}, {}
        self._n_past = 0

    def native_mtp(self):
        """llama.cpp's MTP context against this one (llama_mtp.NativeMtp), made on first use and
        again after the context is re-created; None where the model carries no MTP layers llama.cpp
        runs for specrun, or the library cannot make the context."""
        if self._mtp_arch is None:
            return None
        if self._native_mtp is None:
            from specrun.backends.llama_mtp import TREE_SEQS, NativeMtp

            try:
                self._native_mtp = NativeMtp(self._lib, self._model, self._ctx, self._ctx_params,
                                             self._lib.llama_model_n_embd(self._model), self.n_vocab,
                                             tree_seqs=TREE_SEQS if self.tree_support.available else 0,
                                             follow_load=self.follow_load)
            except (AttributeError, RuntimeError):  # a library without the nextn extension or the context
                self._mtp_arch = None
        return self._native_mtp

    def _free_context(self) -> None:
        if self._native_mtp is not None:  # made against this context: freed first
            native, self._native_mtp = self._native_mtp, None
            native.close()
        # The handles are cleared before anything is freed: a Ctrl-C between the frees below then
        # leaks what was left, where it once freed the batch twice when close() ran after it
        # ("double free or corruption", during model load's flash-attention re-creation).
        lib = self._lib
        ctx, batch, tree_batch = self._ctx, self._batch, self._tree_batch
        self._ctx = self._batch = self._tree_batch = None
        # a recurrent model's bookkeeping was of this context's memory (its kept state on its device
        # storage: restored into another context, llama.cpp aborts)
        self._kept_state, self._fed, self._last_pass, self._rolled_back = None, [], 0, False
        if batch is not None:
            lib.llama_batch_free(batch)
        if tree_batch is not None:
            lib.llama_batch_free(tree_batch)
        lib.llama_free(ctx)

    def open_for_trees(self, tree_paths: int) -> None:
        """Re-create the context, empty, with room for trees of ``tree_paths`` paths (a unified KV
        cache, a sequence per path): llama.cpp sizes a context's sequences when it creates it, and
        whether a run verifies trees may be known only once the model is loaded (auto's lookahead
        window, from the target's stored pass costs). Before anything is fed only."""
        if self._n_past or self._tracking:
            raise RuntimeError("open_for_trees re-creates the context: call it before anything is fed")
        if tree_paths != self._tree_paths:
            self._open_context(tree_paths)  # on failure (memory), the chains context stays as it was

    @property
    def tree_support(self) -> TreeSupport:
        if self.recurrent:
            return TreeSupport(False, "a recurrent or hybrid model's state cannot hold a tree's branches")
        if not self._tree_paths:
            return TreeSupport(False, "this llama.cpp context was created for chains (tree_paths=0)", reopenable=True)
        return TreeSupport(True, max_paths=self._tree_paths)

    def forward_tree(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        """One decode for ``tokens`` and the tree: path p is sequence 1 + p, a node carries the
        ids of every path through it, so the KV mask shows each node the context and its
        ancestors only (cells of other paths hold other sequence ids)."""
        rows = self._decode_tree(tokens, tree, list(logit_rows))
        return self._output_logits(rows).copy()  # (n_rows, V): the context reuses its buffer

    def forward_tree_argmax(self, tokens: Sequence[int], tree: TokenTree, logit_rows: Sequence[int]) -> np.ndarray:
        rows = self._argmax_rows = self._decode_tree(tokens, tree, list(logit_rows))
        return self._output_logits(rows).argmax(axis=-1)

    def _decode_tree(self, tokens: Sequence[int], tree: TokenTree, rows: list[int]) -> list[int]:
        self.tree_support.check(tree)
        tokens = [int(t) for t in tokens]
        n_fed = len(tokens) + len(tree)
        if n_fed > self.n_batch:
            raise ValueError(f"a tree pass feeds {n_fed} tokens; this context's batch holds {self.n_batch}")
        if self._n_past + n_fed > self.n_ctx:
            raise ContextFullError(f"the context of {self.n_ctx} tokens is full", "shorten the prompt or raise --ctx")
        if any(not 0 <= row < n_fed for row in rows):
            raise ValueError(f"logit rows {rows} fall outside the {n_fed} tokens and nodes fed")
        lib, memory = self._lib, self._memory
        self._held_tree = self._hidden = None
        every_row = self._every_row = self._tracking and not self._layers  # embeddings on: llama.cpp outputs them all
        self._drop_tree_cells()
        if n_fed:  # llama_decode refuses an empty batch
            for path in range(len(tree.paths)):  # every path sees the context: cells shared, not copied
                lib.llama_memory_seq_cp(memory, _SEQ, 1 + path, 0, self._n_past)
            self._fill_tree_batch(tokens, tree, range(n_fed) if every_row else set(rows))
            self.follow_load()
            status = lib.llama_decode(self._ctx, self._tree_batch)
            if status != 0:
                self._drop_tree_cells()
                lib.llama_memory_seq_rm(memory, _SEQ, self._n_past, -1)
                raise ContextFullError(
                    f"llama.cpp decode of a {len(tree)}-node tree failed with status {status} at "
                    f"{self._n_past} cached tokens",
                    "shorten the prompt or raise --ctx",
                )
        if every_row:
            self._hidden, self._first_output = self._output_hidden(n_fed), 0  # (n_fed, H)
        elif self._tracking:
            self._hidden = self._output_layers(n_fed) if n_fed else np.zeros((0, self.hidden_support.size
                                                                               * len(self._layers)), np.float32)
        self._n_past += len(tokens)
        self._held_tree = HeldTree(self._n_past, tree)
        return rows

    def _fill_tree_batch(self, tokens: list[int], tree: TokenTree, wanted) -> None:
        batch, n_paths = self._tree_batch, len(tree.paths)
        batch.n_tokens = len(tokens) + len(tree)
        for i, token in enumerate(tokens):  # the committed sequence and every path
            batch.token[i] = token
            batch.pos[i] = self._n_past + i
            batch.n_seq_id[i] = 1 + n_paths
            for seq in range(1 + n_paths):
                batch.seq_id[i][seq] = seq
            batch.logits[i] = i in wanted
        start = self._n_past + len(tokens)
        for node in range(len(tree)):
            i = len(tokens) + node
            paths = np.flatnonzero(tree.path_mask[:, node]).tolist()
            batch.token[i] = tree.tokens[node]
            batch.pos[i] = start + int(tree.depth[node])
            batch.n_seq_id[i] = len(paths)
            for slot, path in enumerate(paths):
                batch.seq_id[i][slot] = 1 + path
            batch.logits[i] = i in wanted

    def keep_path(self, path: Sequence[int]) -> None:
        """Give the accepted nodes' cells to sequence 0, then free every path's cells."""
        tree = held_tree_for(self._held_tree, self._n_past, path)
        self._held_tree = None
        if path:  # the cells at these positions of a path through the last node are the path's nodes
            through = int(np.flatnonzero(tree.path_mask[:, path[-1]])[0])
            self._lib.llama_memory_seq_cp(self._memory, 1 + through, _SEQ, self._n_past, self._n_past + len(path))
        self._drop_tree_cells()
        self._n_past += len(path)

    def _drop_tree_cells(self) -> None:
        """Remove every path sequence; cells that no sequence holds any more are free again."""
        for path in range(self._tree_paths):
            self._lib.llama_memory_seq_rm(self._memory, 1 + path, 0, -1)

    # ---- hidden states ----------------------------------------------------------------
    @cached_property
    def hidden_support(self) -> HiddenSupport:
        if self._lib.llama_pooling_type(self._ctx) != self._lib.LLAMA_POOLING_TYPE_NONE:
            return HiddenSupport(False, reason="this llama.cpp context pools its embeddings")
        layers = self._lib.llama_model_n_layer(self._model)
        problem = self._layer_problem()
        return HiddenSupport(True, self._lib.llama_model_n_embd_out(self._model), layers=layers,
                             weight_bytes=int(self._lib.llama_model_size(self._model)),
                             layer_outputs=0 if problem else layers - 1, layer_reason=problem or
                             "llama.cpp gives a layer's input, so the last layer's output is not among them")

    def _layer_problem(self) -> str:
        """Why tracked passes cannot give this model's layer outputs ("" where they can)."""
        arch = self.metadata("general.architecture") or "unknown"
        if self._lib.__version__ != LAYER_INPUTS_VERSION:  # another llama.cpp may name other graphs' inputs
            return (f"layer outputs are read from llama-cpp-python {LAYER_INPUTS_VERSION}'s llama.cpp only "
                    f"(this is {self._lib.__version__})")
        if self._lib.llama_model_n_embd(self._model) != self._lib.llama_model_n_embd_out(self._model):
            return f"llama.cpp's {arch} layers are not as wide as its output head's input"
        if arch not in LAYER_INPUT_ARCHS:
            return (f"llama.cpp's {arch} graph does not name its layers' inputs "
                    f"(it does for {', '.join(LAYER_INPUT_ARCHS)})")
        if self.rpc:
            return "layer outputs are not read from RPC servers"
        try:
            self._set_layer_input, self._layer_input = layer_input_functions(self._lib)
        except AttributeError:
            return f"{self.library_version} does not export llama.cpp's llama_set_embeddings_layer_inp"
        return ""

    def track_hidden(self, on: bool) -> None:
        was = self._tracking
        super().track_hidden(on)
        if self._layers:
            if on != was:  # each call makes llama.cpp reserve its scheduler again
                for layer in self._layers:  # llama.cpp copies their inputs out for every row fed
                    self._set_layer_input(self._ctx, layer + 1, on)
        else:
            self._lib.llama_set_embeddings(self._ctx, on)  # llama.cpp then outputs every row it is fed

    @property
    def n_ctx_train(self) -> int:
        """The context the model was trained for (0 where the file does not say)."""
        return max(int(self._lib.llama_model_n_ctx_train(self._model)), 0)

    def token_embeddings(self, ids: Sequence[int]) -> np.ndarray:
        """Rows of the file's ``token_embd.weight``, dequantized (gguf's own dequantization, only
        the rows asked for: the table is memory-mapped)."""
        return self._table_rows(("token_embd.weight",), ids)

    def output_rows(self, ids: Sequence[int]) -> np.ndarray:
        """Rows of the file's ``output.weight`` (``token_embd.weight`` where the output is tied),
        dequantized as ``token_embeddings``'."""
        return self._table_rows(("output.weight", "token_embd.weight"), ids)

    def logits_beyond_rows(self) -> str:
        """What llama.cpp's graph does to this model's logits after the output rows' product (""
        nothing): scale or soft-cap them by a metadata key or by default, or add a bias or a scale
        tensor to the output matrix (read in its src/models/*.cpp, Oct 2026)."""
        arch = self.metadata("general.architecture") or ""
        defaulted = LOGITS_CHANGED_BY_DEFAULT.get(arch, "")
        for key, plain in (("logit_scale", 1.0), ("final_logit_softcapping", 0.0)):
            value = self.metadata(f"{arch}.{key}")
            if value not in (None, "") and float(value) != plain:
                return f"{arch}'s logits are changed after its output head ({arch}.{key} = {value})"
            if value in (None, "") and defaulted == key:
                return f"{arch}'s logits are changed after its output head (its {key} by default)"
        if defaulted is None:
            return f"{arch}'s logits are changed after its output head (always, in llama.cpp's graph)"
        extra = sorted(name for name in self._tensors() if name.startswith("output.") and name != "output.weight")
        return f"{arch}'s output head adds {extra[0]}" if extra else ""

    def _tensors(self) -> dict:
        """The file's tensors by name, memory-mapped (only the rows asked for are read)."""
        if self._gguf_tensors is None:
            import gguf

            self._gguf_tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(str(self.path)).tensors}
        return self._gguf_tensors

    def _table_rows(self, names: tuple[str, ...], ids: Sequence[int]) -> np.ndarray:
        """Float32 rows ``ids`` of the first of the tensors ``names`` the file holds."""
        import gguf

        tensors = self._tensors()
        table = next((tensors[name] for name in names if name in tensors), None)
        if table is None:
            raise ValueError(f"{self.path} holds no {' or '.join(names)}")
        rows = np.asarray(table.data[np.asarray(ids, dtype=np.int64)])
        return gguf.quants.dequantize(rows, table.tensor_type).astype(np.float32).reshape(len(ids), -1)

    def native_loop(self) -> NativeLoop | None:
        """llama-cpp-python's own plain loop on this file (a second copy of the model); None on
        a build with AMX kernels, where ``Llama`` would load the weights into the AMX buffers
        that crash (built_with_amx: its model parameters cannot be changed before it loads)."""
        if built_with_amx(self._lib):
            return None
        return NativeLoop(self.path, self.n_ctx, self.n_threads)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._free_context()
        if getattr(self, "_model", None):
            model, self._model = self._model, None  # cleared first, as the context's handles are
            self._lib.llama_model_free(model)

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


class NativeLoop:
    """llama-cpp-python's own plain decoding (``Llama.generate`` with its defaults, greedy) on
    a model file: the fastest plain loop a llama-cpp-python user has, which specrun's own
    plain decoding and speed-ups are also reported against (``demo``, ``bench --native``).
    It loads a second copy of the model."""

    name = "Llama.generate"

    def __init__(self, path: Path, n_ctx: int, n_threads: int) -> None:
        llama_cpp = _import_llama_cpp()
        self._lib = llama_cpp
        self._llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                    verbose=False)
        self._vocab = llama_cpp.llama_model_get_vocab(self._llm.model)

    def tokens_per_second(self, prompt_ids: Sequence[int], max_new_tokens: int) -> float:
        """Greedy decoding after ``prompt_ids``; timed from the first token (the prompt pass
        makes it) to the last, as specrun's generation is."""
        count, first, last = 0, 0.0, 0.0
        for token in self._llm.generate(list(prompt_ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                        repeat_penalty=1.0, reset=True):
            last = time.perf_counter()
            count += 1
            if count == 1:
                first = last
            if self._lib.llama_vocab_is_eog(self._vocab, token) or count == max_new_tokens:
                break
        return (count - 1) / (last - first) if count > 1 and last > first else 0.0

    def close(self) -> None:
        self._llm.close()
