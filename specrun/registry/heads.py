"""Where a target's self-drafting heads are found: --heads, beside the model, specrun's cache,
or shipped with the package (the demo target's; a widened builtin's derived from its original's)."""

from __future__ import annotations

import re
from pathlib import Path

from specrun.errors import ModelFileError, SpecrunError, UsageError
from specrun.heads.kinds import BY_NAME, HEAD_METHODS, kinds_of_method
from specrun.registry.catalog import ModelEntry, load_registry

HEADS_SUFFIX = ".safetensors"



def _stored_name(kind: str) -> str:
    """A kind's file name ending: the kind's name for a folder (EAGLE-3's), a .safetensors file
    (beside its .json) else."""
    return kind if BY_NAME[kind].stored == "folder" else f"{kind}{HEADS_SUFFIX}"


def heads_cache_path(target_spec: str, kind: str) -> Path:
    """Where `specrun heads train` writes a target's heads by default: <cache>/heads/<target>/<kind>
    (``kind``: a stored kind, "eagle3" among them)."""
    from specrun.modelkit.demo import cache_dir

    return cache_dir() / "heads" / _cache_name(target_spec) / _stored_name(kind)


def _cache_name(spec: str) -> str:
    """A model named in specrun's cache: an alias as it is, a path by its last part, made safe."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(spec).name if "/" in spec else spec)


def adapters_cache_path(target_spec: str, draft_name: str) -> Path:
    """Where ``--keep-learned`` keeps the adapters a draft model learned against a target:
    <cache>/heads/<target>/draft-<draft>.adapters.safetensors."""
    from specrun.modelkit.demo import cache_dir

    return cache_dir() / "heads" / _cache_name(target_spec) / f"draft-{_cache_name(draft_name)}.adapters.safetensors"


def shipped_heads_path(builtin: str, kind: str) -> Path:
    """Heads that ship in the package for a builtin model (specrun/demo/<model>.<kind>.safetensors,
    or the folder <model>.eagle3); a builtin widened with zeros (demo-target-xl, smollm2-135m-x2)
    has its original's, widened on first use (modelkit.widened_heads)."""
    import specrun.demo
    from specrun.modelkit.widened_heads import widened_heads, widened_original

    package = Path(specrun.demo.__file__).parent
    shipped = package / f"{builtin}.{_stored_name(kind)}"
    original = widened_original(builtin)
    if original is None:
        return shipped
    originals = package / f"{original}.{_stored_name(kind)}"
    return widened_heads(originals, builtin, kind) if _present(originals, kind) else shipped


def heads_candidates(target_spec: str, kind: str, entries: dict[str, ModelEntry],
                     failures: list[SpecrunError] | None = None) -> list[Path]:
    """Where ``kind`` heads for ``target_spec`` are looked for, first found first used: beside
    a model file or in a model folder, specrun's cache, the package (at each place, EAGLE-3's
    folder before EAGLE-1's file for the eagle method). A widened builtin's that cannot be
    derived (no room in the cache) are left out, the error added to ``failures``: another kind
    may serve."""
    candidates = []
    entry = entries.get(target_spec)
    local = [Path(target_spec).expanduser()] if entry is None else [
        Path(path).expanduser() for path in (entry.gguf_path, entry.mlx_path) if path
    ]
    if BY_NAME[kind].stored == "model":  # inside the target's own files (its GGUF, its model folder)
        if entry is not None and (entry.gguf_repo or entry.mlx_repo):  # a Hub model: what its cache holds
            from specrun.registry.hub import cached_model_paths

            local += cached_model_paths(entry)
        return [path for path in local if path.suffix.lower() == ".gguf" or path.is_dir()]
    stored = [each.name for each in kinds_of_method(kind)]  # EAGLE-3's folder before EAGLE-1's file
    for path in local:
        for each in stored:
            if path.is_dir():
                candidates.append(path / _stored_name(each))
            elif path.suffix:
                candidates.append(path.with_suffix(f".{_stored_name(each)}"))
    candidates.extend(heads_cache_path(target_spec, each) for each in stored)
    if entry is not None and entry.builtin:
        for each in stored:
            try:
                candidates.append(shipped_heads_path(entry.builtin, each))
            except ModelFileError as exc:
                if failures is not None:
                    failures.append(exc)
    return candidates


def _present(path: Path, kind: str) -> bool:
    """Heads are at ``path``: a file, or a folder holding its config (an empty or half-written
    folder left by a failed save is not heads); for a kind inside the model, a model file that
    says it carries such layers."""
    if BY_NAME[kind].stored == "model":
        from specrun.modelkit.mtp import folder_mtp_layers, mtp_layer_count

        if path.is_dir():
            return folder_mtp_layers(path) > 0
        try:
            return path.is_file() and mtp_layer_count(path) > 0
        except (OSError, ValueError, KeyError):  # not a GGUF it can read: the target's loading says why
            return False
    if path.is_dir():  # a published folder, or one holding specrun's pair KIND.safetensors (a widened builtin's)
        pair = path / f"{kind}{HEADS_SUFFIX}"
        return (path / "config.json").is_file() or (pair.is_file() and pair.with_suffix(".json").is_file())
    return path.exists()


def find_all_heads(target_spec: str, explicit: str | None, kind: str, registry: Path | None = None) -> list[Path]:
    """Every heads file or folder for ``kind`` in the order they are tried: ``explicit`` (--heads)
    alone when given, else the candidates found; a one-line usage error when there is none."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise UsageError(f"--heads {explicit}: no such file or folder", "pass the path of a heads file")
        return [path]
    failures: list[SpecrunError] = []
    candidates = heads_candidates(target_spec, kind, load_registry(registry), failures)
    found = [path for path in candidates if _present(path, kind)]
    if not found and failures:
        raise failures[0]  # the heads that ship could not be derived: say why
    if not found and BY_NAME[kind].stored == "model":
        from specrun.modelkit.mtp import no_layers_refusal

        raise no_layers_refusal(target_spec, candidates, "" if candidates else " (no model file or folder of it)")
    if not found:
        raise UsageError(
            f"no {kind} heads for {target_spec} (looked in {', '.join(str(path) for path in candidates)})",
            f"train them with: specrun heads train --target {target_spec} --kind {kind}, or pass --heads FILE",
        )
    return found


def find_heads(target_spec: str, explicit: str | None, kind: str, registry: Path | None = None) -> Path:
    """The heads file to use: ``explicit`` (--heads) when given, else the first candidate found;
    a one-line usage error saying where it looked when there is none."""
    return find_all_heads(target_spec, explicit, kind, registry)[0]


def heads_available(target_spec: str, kind: str, registry: Path | None = None) -> bool:
    """Are there ``kind`` heads for ``target_spec`` where find_heads looks (without --heads)?"""
    try:
        return any(_present(path, kind) for path in heads_candidates(target_spec, kind, load_registry(registry)))
    except SpecrunError:  # an unreadable registry is reported where the target is opened
        return False


def head_kinds_available(target_spec: str, explicit: str | None = None, registry: Path | None = None) -> tuple[str, ...]:
    """The head methods ``target_spec`` can draft with: the kind of the ``explicit`` file (--heads)
    and every other kind found where find_heads looks."""
    given = explicit_heads_kind(explicit) if explicit is not None else None
    return tuple(kind for kind in HEAD_METHODS if kind == given or heads_available(target_spec, kind, registry))


def explicit_heads_kind(explicit: str) -> str | None:
    """The kind of heads the file ``explicit`` (--heads) holds; None where it cannot be loaded (what
    is wrong with it is reported where the heads are loaded for a method)."""
    from specrun.heads.files import load_heads

    try:
        heads = load_heads(Path(explicit).expanduser())
    except SpecrunError:
        return None
    return heads.config.kind
