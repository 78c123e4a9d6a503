"""Where a target's self-drafting heads are found: --heads, beside the model, specrun's cache,
or shipped with the package (the demo target's)."""

from __future__ import annotations

import re
from pathlib import Path

from specrun.errors import SpecrunError, UsageError
from specrun.modelkit.heads import DRAFTING_KINDS
from specrun.registry.catalog import ModelEntry, load_registry

HEADS_SUFFIX = ".safetensors"


def heads_cache_path(target_spec: str, kind: str) -> Path:
    """Where `specrun heads train` writes a target's heads by default: <cache>/heads/<target>/<kind>."""
    from specrun.modelkit.demo import cache_dir

    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(target_spec).name if "/" in target_spec else target_spec)
    return cache_dir() / "heads" / name / f"{kind}{HEADS_SUFFIX}"


def shipped_heads_path(builtin: str, kind: str) -> Path:
    """Heads that ship in the package for a builtin model (specrun/demo/<model>.<kind>.safetensors)."""
    import specrun.demo

    return Path(specrun.demo.__file__).parent / f"{builtin}.{kind}{HEADS_SUFFIX}"


def heads_candidates(target_spec: str, kind: str, entries: dict[str, ModelEntry]) -> list[Path]:
    """Where ``kind`` heads for ``target_spec`` are looked for, first found first used: beside
    a model file or in a model folder, specrun's cache, the package."""
    candidates = []
    entry = entries.get(target_spec)
    local = [Path(target_spec).expanduser()] if entry is None else [
        Path(path).expanduser() for path in (entry.gguf_path, entry.mlx_path) if path
    ]
    for path in local:
        if path.is_dir():
            candidates.append(path / f"{kind}{HEADS_SUFFIX}")
        elif path.suffix:
            candidates.append(path.with_suffix(f".{kind}{HEADS_SUFFIX}"))
    candidates.append(heads_cache_path(target_spec, kind))
    if entry is not None and entry.builtin:
        candidates.append(shipped_heads_path(entry.builtin, kind))
    return candidates


def find_heads(target_spec: str, explicit: str | None, kind: str, registry: Path | None = None) -> Path:
    """The heads file to use: ``explicit`` (--heads) when given, else the first candidate found;
    a one-line usage error saying where it looked when there is none."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise UsageError(f"--heads {explicit}: no such file or folder", "pass the path of a heads file")
        return path
    candidates = heads_candidates(target_spec, kind, load_registry(registry))
    found = next((path for path in candidates if path.exists()), None)
    if found is None:
        raise UsageError(
            f"no {kind} heads for {target_spec} (looked in {', '.join(str(path) for path in candidates)})",
            f"train them with: specrun heads train --target {target_spec} --kind {kind}, or pass --heads FILE",
        )
    return found


def heads_available(target_spec: str, kind: str, registry: Path | None = None) -> bool:
    """Are there ``kind`` heads for ``target_spec`` where find_heads looks (without --heads)?"""
    try:
        return any(path.exists() for path in heads_candidates(target_spec, kind, load_registry(registry)))
    except SpecrunError:  # an unreadable registry is reported where the target is opened
        return False


def head_kinds_available(target_spec: str, explicit: str | None = None, registry: Path | None = None) -> tuple[str, ...]:
    """The head methods ``target_spec`` can draft with: the kind of the ``explicit`` file (--heads)
    and every other kind found where find_heads looks."""
    given = explicit_heads_kind(explicit) if explicit is not None else None
    return tuple(kind for kind in DRAFTING_KINDS if kind == given or heads_available(target_spec, kind, registry))


def explicit_heads_kind(explicit: str) -> str | None:
    """The kind of heads the file ``explicit`` (--heads) holds; None where it cannot be loaded (what
    is wrong with it is reported where the heads are loaded for a method)."""
    from specrun.modelkit.heads import load_heads

    try:
        heads = load_heads(Path(explicit).expanduser())
    except SpecrunError:
        return None
    return heads.config.kind
