"""From model names on the command line to loaded, compatible backends."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrun.backends.base import Backend
from specrun.compat import check_compatible
from specrun.errors import RegistryError, UsageError
from specrun.registry import ModelEntry, load_registry, lookup

BACKENDS = ("auto", "llama", "mlx")
DEFAULT_TARGET = "demo-target"
DEFAULT_DRAFT = "demo-draft"


@dataclass(frozen=True)
class LoadOptions:
    backend: str = "auto"
    n_ctx: int | None = None  # None: the model's training context, at most 4096
    threads: int | None = None
    gpu_layers: int | None = None
    registry: Path | None = None


def resolve_gguf(spec: str, entries: dict[str, ModelEntry]) -> Path:
    """A .gguf path, or the GGUF file behind a registry alias."""
    path = Path(spec).expanduser()
    if spec.endswith(".gguf") or path.exists():
        return path
    entry = lookup(spec, entries)
    if entry.builtin:
        from specrun.modelkit.demo import demo_gguf

        return demo_gguf(entry.builtin)
    if entry.gguf_path:
        return Path(entry.gguf_path).expanduser()
    if entry.gguf_repo:
        from specrun.hub import cached_gguf

        return cached_gguf(entry)
    raise RegistryError(
        f"alias {spec!r} has no GGUF source ({entry.origin})", "use --backend mlx, or add gguf_repo/gguf_file"
    )


def open_backend(spec: str, options: LoadOptions, entries: dict[str, ModelEntry] | None = None) -> Backend:
    """Load one model on the chosen backend."""
    entries = entries if entries is not None else load_registry(options.registry)
    backend = choose_backend(options.backend)
    if backend == "llama":
        from specrun.backends.llama import LlamaCppBackend

        return LlamaCppBackend(
            resolve_gguf(spec, entries),
            n_ctx=options.n_ctx,
            n_threads=options.threads,
            gpu_layers=options.gpu_layers,
        )
    raise UsageError(f"backend {backend!r} is not available yet", "use --backend llama")


def choose_backend(requested: str) -> str:
    if requested not in BACKENDS:
        raise UsageError(f"unknown backend {requested!r}", f"use one of: {', '.join(BACKENDS)}")
    return "llama" if requested == "auto" else requested


def open_pair(
    target_spec: str, draft_spec: str | None, options: LoadOptions
) -> tuple[Backend, Backend | None]:
    """Load the target and (if given) the draft, refusing a draft with another vocabulary."""
    entries = load_registry(options.registry)
    target = open_backend(target_spec, options, entries)
    if draft_spec is None:
        return target, None
    try:
        draft = open_backend(draft_spec, options, entries)
        check_compatible(target, draft, target_spec, draft_spec)
    except BaseException:
        target.close()
        raise
    return target, draft
