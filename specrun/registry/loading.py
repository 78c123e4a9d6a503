"""From model names on the command line to loaded, compatible backends."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specrun.backends.base import Backend
from specrun.registry.compat import check_compatible
from specrun.errors import ModelFileError, RegistryError, UsageError
from specrun.fileio import same_file
from specrun.registry.catalog import ModelEntry, load_registry
from specrun.registry.hub import PairCheck

BACKENDS = ("auto", "llama", "mlx")
DEFAULT_TARGET = "demo-target"
DEFAULT_DRAFT = "demo-draft"


MAX_GPU_LAYERS = 100_000
MAX_WINDOW = 1 << 20
MAX_SINKS = 1024


@dataclass(frozen=True)
class LoadOptions:
    backend: str = "auto"
    n_ctx: int | None = None  # None: the model's training context, at most 4096
    threads: int | None = None
    gpu_layers: int | None = None
    registry: Path | None = None
    kv_type: str | None = None  # llama.cpp's KV cache: f16 or f32; None: f16 (its default), f32 when exact
    # llama.cpp's flash attention: on or off; None: measured on a CPU (sessions/kernels.py), else llama.cpp's
    # choice; off when exact
    flash_attn: str | None = None
    exact: bool = False  # the settings under which greedy speculation is bit-identical to plain decoding
    tree_paths: int = 0  # llama.cpp: root-to-leaf paths a tree pass may hold (0: chains only); the target's
    # llama.cpp RPC servers (HOST:PORT) the target's layers run on; drafts stay on this machine
    rpc: tuple[str, ...] = ()
    # the draft reads a windowed cache (backends/window.py): this many recent tokens (0: its full
    # cache alone; None: the full cache, which auto holds a window beside, or DEFAULT_WINDOW for
    # --draft self:window) and ``sinks`` first ones (None: SINKS)
    window: int | None = None
    sinks: int | None = None

    def __post_init__(self) -> None:
        if self.gpu_layers is not None and not -1 <= self.gpu_layers <= MAX_GPU_LAYERS:
            raise UsageError(
                f"--gpu-layers must be between -1 (all) and {MAX_GPU_LAYERS}, got {self.gpu_layers}",
                "pass a layer count, -1 for all, or leave it out (all)",
            )
        if self.window is not None and not 0 <= self.window <= MAX_WINDOW:
            raise UsageError(f"--window must be between 0 (the full cache) and {MAX_WINDOW} tokens, got {self.window}",
                             "pass the recent tokens the draft's cache keeps (512, say), or leave --window out")
        if self.sinks is not None and not 0 <= self.sinks <= MAX_SINKS:
            raise UsageError(f"--sinks must be between 0 and {MAX_SINKS}, got {self.sinks}",
                             "pass the first tokens a windowed cache keeps (4, StreamingLLM's), or leave it out")
        # sinks without any window given are refused by the commands (cli/common.check_window_use, which
        # knows --draft self:window keeps one of its own); given here alone, they size nothing
        if self.sinks is not None and self.window == 0:
            raise UsageError("--sinks sizes a windowed draft cache, and there is none",
                             "pass --window N (or --draft self:window), or drop --sinks")
        if self.rpc and self.gpu_layers == 0:
            raise UsageError("--gpu-layers 0 keeps every layer on this machine, so --rpc would send none",
                             "leave --gpu-layers out (all layers go to the servers) or pass a layer count")

    @property
    def llama_kv_type(self) -> str:
        return self.kv_type or ("f32" if self.exact else "f16")

    @property
    def llama_flash_attn(self) -> bool | None:
        """On (True), off (False) or llama.cpp's automatic choice (None, on where the device has it)."""
        if self.exact or self.flash_attn == "off":
            return False
        return True if self.flash_attn == "on" else None


def resolve_gguf(spec: str, entries: dict[str, ModelEntry]) -> Path:
    """The GGUF file to load for ``spec``: a .gguf path, an alias, or a Hub id (owner/name/FILE.gguf).

    Hub files are downloaded into the Hugging Face cache on first use (the first part
    of a split GGUF is returned, with the others beside it).
    """
    from specrun.registry.catalog import entry_for

    entry = entry_for(spec, entries)
    if entry.builtin:
        from specrun.modelkit.builtin import builtin_gguf

        return builtin_gguf(entry.builtin)
    if entry.gguf_path:
        return Path(entry.gguf_path).expanduser()
    if entry.gguf_repo:
        from specrun.registry.hub import cached_gguf

        return cached_gguf(entry)
    raise RegistryError(
        f"{spec!r} has no GGUF file ({entry.origin})",
        "use --backend mlx, or name a GGUF: a .gguf path, an alias with gguf_file, or owner/name/FILE.gguf",
    )


def resolve_mlx(spec: str, entries: dict[str, ModelEntry]) -> str:
    """The MLX folder to load for ``spec`` (a path, an alias, or owner/name), downloading a Hub repo."""
    from specrun.registry.catalog import entry_for

    path = Path(spec).expanduser()
    if path.exists() or (spec not in entries and spec.startswith(("/", ".", "~"))):
        return str(path)  # MlxBackend names what is wrong with a missing or non-MLX path
    entry = entry_for(spec, entries)
    if entry.builtin:
        from specrun.modelkit.builtin import builtin_mlx_dir

        return str(builtin_mlx_dir(entry.builtin))
    if entry.mlx_path:
        return str(Path(entry.mlx_path).expanduser())
    if entry.mlx_repo:
        from specrun.registry.hub import cached_mlx

        return str(cached_mlx(entry))
    raise RegistryError(
        f"{spec!r} has no MLX source ({entry.origin})", "use --backend llama, or add mlx_repo/mlx_path to its alias"
    )


def prompts_as_chat(spec: str, registry: Path | None, target: Backend, chat: bool | None) -> bool:
    """Does a one-shot prompt go to ``target`` as a user message in its chat template?
    ``chat`` when the user said; else yes when the model has a template, unless the
    registry marks it as a completion model (the demo pair: Python source, not chat)."""
    if chat is not None:
        return chat
    from specrun.registry.catalog import entry_for

    entries = load_registry(registry)
    completion = spec in entries and entry_for(spec, entries).completion
    return not completion and target.chat_template() is not None


def resolve_self_draft(spec: str, entries: dict[str, ModelEntry], target_spec: str | None, backend: str) -> Path:
    """The quantized copy of the target that ``spec`` (``self:q4``) names, derived on first use."""
    from specrun.modelkit.selfdraft import (
        LayerDraft, WindowDraft, parse_self_draft, self_draft_gguf, self_draft_mlx_dir
    )

    kind = parse_self_draft(spec)
    if isinstance(kind, (LayerDraft, WindowDraft)):  # no file: the loaded target itself (open_draft)
        raise UsageError(f"--draft {spec} is part of the loaded target, not a model of its own",
                         "pass it as the draft of a target (--target MODEL --draft ...)")
    if target_spec is None:
        raise UsageError(f"--draft {spec} is a copy of the target, and no target was named", "pass --target MODEL")
    if backend == "mlx":
        return self_draft_mlx_dir(Path(resolve_mlx(target_spec, entries)), kind, target_spec)
    return self_draft_gguf(resolve_gguf(target_spec, entries), kind, target_spec)


def open_layer_draft(target: Backend, spec: str, target_spec: str | None = None) -> Backend:
    """``--draft self:layers=…``: some of the loaded target's own layers as its draft (MLX only:
    llama.cpp's API runs a model whole). Bare ``self:layers``: the layers `specrun tune` chose
    for this target on this machine (``target_spec`` names the target in the error without them)."""
    from specrun.modelkit.layer_choice import tuned_layers
    from specrun.modelkit.selfdraft import parse_self_draft

    layers = parse_self_draft(spec)
    check_layer_target(target, spec)
    if layers.tuned:
        kept = tuned_layers(Path(target.path), target.n_layers, target_spec or str(target.path))
    else:
        kept = layers.kept(target.n_layers)
    return target.layer_draft(kept)


def check_layer_target(target: Backend, spec: str) -> None:
    """Refuse a layer draft of a target whose backend runs a model whole (llama.cpp)."""
    if target.name != "mlx":
        raise _layer_draft_refused(spec)


def _requested_backend(options: LoadOptions) -> str:
    """--backend, except that auto means llama.cpp for a target sent to RPC servers (--rpc is llama.cpp's)."""
    return "llama" if options.rpc and options.backend == "auto" else options.backend


def _layer_draft_refused(spec: str) -> UsageError:
    return UsageError(f"--draft {spec} runs part of the target's layers, which llama.cpp's API cannot do",
                      "pass --backend mlx with an MLX target, or use --draft self:q4")


def check_layer_backend(target_spec: str, draft_spec: str | None, options: LoadOptions,
                        entries: dict[str, ModelEntry]) -> None:
    """Refuse a layer draft before the target loads where the target would load on llama.cpp."""
    from specrun.modelkit.selfdraft import is_layer_draft

    if is_layer_draft(draft_spec):
        if choose_backend(_requested_backend(options), target_spec, entries) != "mlx":
            raise _layer_draft_refused(draft_spec)


def check_layer_draft_pair(verdict: PairCheck, draft_spec: str, target: ModelEntry) -> PairCheck:
    """``models check``'s ``verdict`` on a layer draft of ``target``: it runs on MLX only, so a
    target without an MLX source cannot have one (a problem), and one with both runs it only
    under ``--backend mlx`` where auto would choose llama.cpp (a note)."""
    from specrun.modelkit.selfdraft import is_layer_draft

    if not is_layer_draft(draft_spec):
        return verdict
    if target.builtin or target.mlx_path or target.mlx_repo:
        note = f"{draft_spec} runs on the MLX backend only: pass --backend mlx where auto would choose llama.cpp"
        return dataclasses.replace(verdict, notes=[*verdict.notes, note])
    problem = (f"{draft_spec} runs part of the target's layers, which needs an MLX target (llama.cpp's API runs a "
               f"model whole), and {target.alias} has no MLX source: name an MLX folder, or an alias with "
               "mlx_repo or mlx_path")
    return dataclasses.replace(verdict, problems=[*verdict.problems, problem])


def check_draft_spec(spec: str | None) -> None:
    """Refuse a malformed ``self:`` draft before anything is loaded."""
    from specrun.modelkit.selfdraft import is_self_draft, parse_self_draft

    if is_self_draft(spec):
        parse_self_draft(spec)


def draft_entry_for(draft_spec: str, target_entry: ModelEntry, entries: dict[str, ModelEntry]) -> ModelEntry:
    """The registry entry a draft's vocabulary is read from: a ``self:`` draft's is its target's."""
    from specrun.modelkit.selfdraft import is_self_draft, parse_self_draft
    from specrun.registry.catalog import entry_for

    if is_self_draft(draft_spec):
        parse_self_draft(draft_spec)
        return dataclasses.replace(target_entry, alias=draft_spec)
    return entry_for(draft_spec, entries)


def open_backend(
    spec: str, options: LoadOptions, entries: dict[str, ModelEntry] | None = None, *, target_spec: str | None = None,
    split: bool = False,
) -> Backend:
    """Load one model on the chosen backend. A model derived on first use (the demo pair, a
    ``self:`` draft) that no longer loads was damaged after it was written: it is derived
    again, once. ``target_spec``: the target a ``self:`` draft is a copy of. ``split``: a pair's
    target, which in processes mlx.launch started is split over them (backends/mlx_distributed.py)."""
    from specrun.modelkit.selfdraft import is_self_draft

    entries = entries if entries is not None else load_registry(options.registry)
    self_draft = is_self_draft(spec)
    backend = choose_backend(_requested_backend(options), target_spec if self_draft else spec, entries)
    if backend == "mlx" and options.rpc:
        raise UsageError("--rpc sends the target to llama.cpp RPC servers, which the MLX backend cannot use",
                         "pass --backend llama (or leave --backend out) with a GGUF target, or drop --rpc")
    if backend == "mlx" and options.kv_type == "f32":
        raise UsageError(
            f"--kv-type {options.kv_type} applies to the llama.cpp backend only",
            "drop --kv-type, or pass --backend llama",
        )
    if backend == "mlx" and options.flash_attn is not None:
        raise UsageError(
            f"--flash-attn {options.flash_attn} applies to the llama.cpp backend only",
            "drop --flash-attn, or pass --backend llama",
        )
    resolve = resolve_mlx if backend == "mlx" else resolve_gguf
    if self_draft:
        resolve = functools.partial(resolve_self_draft, target_spec=target_spec, backend=backend)
    path = resolve(spec, entries)
    _check_context(path, options.n_ctx, spec)
    if backend != "mlx" and target_spec is None:  # a draft's passes never make an answer inexact
        _check_latent_attention(path, options)
    if split and not self_draft:
        from specrun.backends.mlx_distributed import launched, open_distributed_target

        if launched() and backend != "mlx":
            raise UsageError("mlx.launch started this process, and it splits MLX targets only",
                             "pass --backend mlx with an MLX model, or run without mlx.launch")
        if launched():
            return open_distributed_target(path, options.n_ctx)
    try:
        return _load(backend, path, options)
    except ModelFileError:
        from specrun.modelkit.demo import forget_derived

        if not forget_derived(Path(path)):
            raise
    return _load(backend, resolve(spec, entries), options)


def _check_latent_attention(path: str | Path, options: LoadOptions) -> None:
    """Refuse --exact where llama.cpp's latent attention (``deepseek2``: DeepSeek's MLA, GLM-4.7-Flash)
    cannot keep it: measured on a 1,024-wide model of that layout, its multi-token passes round
    differently from single steps even with an F32 cache and flash attention off (logits ~0.03
    apart at every step), so speculation there cannot be bit-identical to plain decoding."""
    from specrun.modelkit.gguf_header import header_values

    if not options.exact:
        return
    try:
        arch = dict(header_values(Path(path))).get("general.architecture")
    except (OSError, ValueError):
        return
    if arch == "deepseek2":
        raise UsageError(f"--exact cannot hold on {Path(path).name}: llama.cpp's latent attention (deepseek2) rounds "
                         f"a multi-token pass differently from single steps even with an F32 cache",
                         "drop --exact (greedy output then matches plain decoding but at near-ties, of the output "
                         "or of the experts' router)")


def _check_context(path: str | Path, n_ctx: int | None, spec: str) -> None:
    """Refuse a --ctx past the model's training context (its output degrades there), naming the
    model as the user did (``spec``), not the file it resolved to in specrun's cache."""
    if n_ctx is None:
        return
    from specrun.registry.hub import training_context

    trained = training_context(Path(path))
    if trained is not None and n_ctx > trained:
        raise UsageError(
            f"--ctx {n_ctx} is more than the {trained:,} tokens {spec} was trained with",
            f"pass --ctx {trained} or less",
        )


def _load(backend: str, path: str | Path, options: LoadOptions) -> Backend:
    if backend == "mlx":
        from specrun.backends.mlx import MlxBackend

        return MlxBackend(path, n_ctx=options.n_ctx)
    from specrun.backends.llama import LlamaCppBackend

    return LlamaCppBackend(
        path,
        n_ctx=options.n_ctx,
        n_threads=options.threads,
        gpu_layers=options.gpu_layers,
        kv_type=options.llama_kv_type,
        flash_attn=options.llama_flash_attn,
        tree_paths=options.tree_paths,
        rpc=options.rpc,
    )


def choose_backend(requested: str, spec: str | None = None, entries: dict[str, ModelEntry] | None = None) -> str:
    """'llama' or 'mlx' for ``spec``; an explicit choice must be installed.

    auto: MLX when the model has an MLX source and either this is Apple Silicon
    or the model has no GGUF source; llama.cpp otherwise. An uninstalled backend
    is skipped by auto and refused when asked for by name.
    """
    import importlib.util
    import platform

    from specrun.errors import BackendUnavailableError

    modules = {"llama": "llama_cpp", "mlx": "mlx_lm"}
    if requested not in BACKENDS:
        raise UsageError(f"unknown backend {requested!r}", f"use one of: {', '.join(BACKENDS)}")
    installed = {name for name, module in modules.items() if importlib.util.find_spec(module) is not None}
    if requested != "auto":
        if requested not in installed:
            raise BackendUnavailableError(
                f"the {requested} backend is not installed", f"install it with: pip install 'specrun[{requested}]'"
            )
        return requested
    has_mlx, has_gguf = _model_sources(spec, entries or {}) if spec is not None else (False, True)
    apple_silicon = platform.system() == "Darwin" and platform.machine() == "arm64"
    order = ("mlx", "llama") if has_mlx and (apple_silicon or not has_gguf) else ("llama", "mlx")
    sources = {"mlx": has_mlx, "llama": has_gguf}
    usable = [name for name in order if name in installed and sources[name]]
    if not usable:
        raise BackendUnavailableError(
            f"the {order[0]} backend this model needs is not installed",
            f"install it with: pip install 'specrun[{order[0]}]'",
        )
    return usable[0]


def _model_sources(spec: str, entries: dict[str, ModelEntry]) -> tuple[bool, bool]:
    """(has an MLX source, has a GGUF source), without downloading or deriving anything."""
    from specrun.registry.catalog import entry_for

    try:
        entry = entry_for(spec, entries)
    except RegistryError:
        return False, True  # unknown: the llama.cpp path reports it
    from specrun.modelkit.builtin import builtin_has_mlx

    has_mlx = bool((entry.builtin and builtin_has_mlx(entry.builtin)) or entry.mlx_path or entry.mlx_repo)
    has_gguf = bool(entry.builtin or entry.gguf_path or entry.gguf_repo)
    return has_mlx, has_gguf


def suggested_draft(target_spec: str, registry: Path | None = None) -> str | None:
    """The first draft models.toml suggests for this target, if it is an alias with one."""
    entry = load_registry(registry).get(target_spec)
    return entry.drafts[0] if entry is not None and entry.drafts else None


def choose_pair(target: str | None, draft: str | None, registry: Path | None = None) -> tuple[str, str | None]:
    """The models to use: the demo pair when no target is named; for a named target
    without --draft, the draft its registry entry suggests (None when there is none)."""
    check_draft_spec(draft)
    if target is None:
        return DEFAULT_TARGET, draft or DEFAULT_DRAFT
    return target, draft or suggested_draft(target, registry)


def open_pair(
    target_spec: str, draft_spec: str | None, options: LoadOptions, on_note: Callable[[str], None] | None = None
) -> tuple[Backend, Backend | None]:
    """Load the target and (if given) the draft, refusing a draft with another vocabulary.
    A ``self:`` draft is a quantized copy of the target (modelkit/selfdraft.py), or the target
    itself. ``on_note``: open_draft's."""
    check_draft_spec(draft_spec)
    entries = load_registry(options.registry)
    check_layer_backend(target_spec, draft_spec, options, entries)
    target = open_backend(target_spec, options, entries, split=True)
    if draft_spec is None:
        return target, None
    try:
        return target, open_draft(target, target_spec, draft_spec, options, entries, on_note)
    except BaseException:
        target.close()
        raise


def open_draft(
    target: Backend, target_spec: str, draft_spec: str, options: LoadOptions,
    entries: dict[str, ModelEntry] | None = None, on_note: Callable[[str], None] | None = None,
) -> Backend:
    """The draft for the loaded ``target``: some of its own layers (``self:layers=``), itself with
    a windowed cache (``self:window``), or a model on the target's backend, refused when its
    vocabulary is another, with a windowed cache where --window asks for one. ``on_note`` hears why
    a window asked for was not made (the draft then reads its full cache); None: stderr."""
    from specrun.modelkit.selfdraft import is_layer_draft, is_window_draft

    if is_layer_draft(draft_spec):
        return open_layer_draft(target, draft_spec, target_spec)
    if is_window_draft(draft_spec):
        return open_window_draft(target, options, owns=False, on_note=on_note)
    # One context size for both (a draft capped smaller would overflow in long chats),
    # and the target's backend, so that auto cannot split a pair across two runtimes.
    backend = options.backend if options.backend != "auto" else target.name
    # drafts chains, on this machine
    draft_options = dataclasses.replace(options, n_ctx=target.n_ctx, backend=backend, tree_paths=0, rpc=())
    draft = open_backend(draft_spec, draft_options, entries, target_spec=target_spec)
    try:
        check_compatible(target, draft, target_spec, draft_spec)
        if _same_model_file(target, draft):  # lossless, but it cannot save a step: say so
            (on_note or _note_to_stderr)(
                f"--draft {draft_spec} is the target's own model file: its drafts cost what the target's steps "
                "do, so it saves no step (auto stops asking it; a fixed method runs slower than plain "
                "decoding): pass a smaller model, --draft self:q4, or no --draft")
        if options.window:  # 0: the full cache, and auto holds no window beside it
            return open_window_draft(draft, options, owns=True, on_note=on_note)
    except BaseException:
        draft.close()
        raise
    return draft


def open_window_draft(model: Backend, options: LoadOptions, owns: bool,
                      on_note: Callable[[str], None] | None = None) -> Backend:
    """``model`` drafting from a cache of its first ``options.sinks`` tokens and its last
    ``options.window`` (backends/window.py). Where that cannot be (a window no smaller than the
    context, no sinks, a cache that cannot drop tokens, a backend without window caches) one line
    says why and the draft reads its full cache: ``model`` itself when it is a draft model
    (``owns``), else the target with a second cache of the whole context."""
    from specrun.backends.window import DEFAULT_WINDOW, SINKS, block_for

    window = options.window or DEFAULT_WINDOW
    sinks = SINKS if options.sinks is None else options.sinks
    if not owns and (not hasattr(model, "open_window") or getattr(model, "recurrent", False)):
        cannot = "a backend without windowed caches" if not hasattr(model, "open_window") else "a recurrent state"
        raise UsageError(f"--draft self:window drafts from a windowed cache, and {model.name} keeps {cannot}",
                         "pass --backend llama with a GGUF target, or use --draft self:q4 or a draft model")
    if not hasattr(model, "open_window"):
        reason = f"the {model.name} backend keeps no windowed cache yet"
    elif sinks == 0:
        reason = ("--sinks 0 drops the context's first tokens, which attention leans on (StreamingLLM's "
                  "attention sinks): pass --sinks 4")
    elif sinks + window + block_for(window) >= model.n_ctx:
        reason = (f"a window of {window} tokens and {sinks} sinks is no smaller than the context of "
                  f"{model.n_ctx}: pass a smaller --window")
    else:
        try:
            return model.open_window(sinks, window, owns=owns)
        except ModelFileError as exc:
            reason = exc.problem
    if owns:  # a draft model as it is
        (on_note or _note_to_stderr)(f"{reason}; the draft reads its full cache")
        return model
    try:  # the target, with a second cache of the whole context (it never moves on)
        full = model.open_window(SINKS, model.n_ctx, owns=False)
    except ModelFileError as exc:
        raise UsageError(f"--draft self:window cannot draft from this target: {exc.problem}",
                         "use --draft self:q4 or a draft model") from None
    (on_note or _note_to_stderr)(f"{reason}; the draft reads its full cache")
    return full


def _same_model_file(target: Backend, draft: Backend) -> bool:
    """Are ``target`` and ``draft`` loaded from one file or folder?"""
    paths = getattr(target, "path", None), getattr(draft, "path", None)
    if None in paths:
        return False
    try:
        return same_file(*paths)
    except TypeError:  # a path that is no path (a test's stand-in)
        return False


def _note_to_stderr(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)
