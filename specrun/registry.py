"""The model registry: aliases in models.toml resolved to model files.

The shipped registry is models.toml at the repository root (installed inside the
package); a user registry in the XDG config directory and ``--registry FILE``
override it, entry by entry.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from specrun.errors import RegistryError

ENTRY_KEYS = {
    "description": str,
    "family": str,
    "params": str,
    "quant": str,
    "context": int,
    "builtin": str,
    "gguf_repo": str,
    "gguf_file": str,
    "gguf_path": str,
    "mlx_repo": str,
    "mlx_path": str,
    "drafts": list,
    "verified": bool,
}
SOURCE_KEYS = ("builtin", "gguf_repo", "gguf_path", "mlx_repo", "mlx_path")


@dataclass(frozen=True)
class ModelEntry:
    """One alias: where its GGUF and/or MLX weights come from, and what it pairs with."""

    alias: str
    origin: str  # the registry file it came from
    description: str = ""
    family: str = ""
    params: str = ""
    quant: str = ""
    context: int = 0
    builtin: str = ""
    gguf_repo: str = ""
    gguf_file: str = ""
    gguf_path: str = ""
    mlx_repo: str = ""
    mlx_path: str = ""
    drafts: tuple[str, ...] = field(default=())
    verified: bool = True


def shipped_registry_path() -> Path:
    return Path(str(resources.files("specrun").joinpath("models.toml")))


def user_registry_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "specrun" / "models.toml"


def parse_registry(path: Path) -> dict[str, ModelEntry]:
    """Read one registry file; every problem names the file, the alias and the key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RegistryError(f"cannot read registry {path}: {exc.strerror}", "check the path") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{path} is not valid TOML: {exc}", "fix the syntax at that line") from exc
    unknown_tables = set(data) - {"models"}
    if unknown_tables:
        raise RegistryError(
            f"{path}: unknown top-level key {sorted(unknown_tables)[0]!r}", "put entries under [models.ALIAS]"
        )
    entries = {}
    for alias, raw in data.get("models", {}).items():
        if not isinstance(raw, dict):
            raise RegistryError(f"{path}: models.{alias} must be a table", "write it as [models.{alias}]")
        for key, value in raw.items():
            expected = ENTRY_KEYS.get(key)
            if expected is None:
                raise RegistryError(
                    f"{path}: alias {alias!r} has unknown key {key!r}",
                    f"use one of: {', '.join(sorted(ENTRY_KEYS))}",
                )
            if not isinstance(value, expected):
                raise RegistryError(
                    f"{path}: alias {alias!r} key {key!r} must be a {expected.__name__}", "fix its value"
                )
        if not any(raw.get(key) for key in SOURCE_KEYS):
            raise RegistryError(
                f"{path}: alias {alias!r} is missing a source",
                f"add one of: {', '.join(SOURCE_KEYS)}",
            )
        if raw.get("gguf_repo") and not raw.get("gguf_file"):
            raise RegistryError(f"{path}: alias {alias!r} has gguf_repo but no gguf_file", "add gguf_file")
        fields = dict(raw)
        fields["drafts"] = tuple(fields.get("drafts", ()))
        entries[alias] = ModelEntry(alias=alias, origin=str(path), **fields)
    return entries


def load_registry(extra: Path | None = None) -> dict[str, ModelEntry]:
    """Shipped entries, overridden by the user registry, overridden by ``extra``."""
    entries = parse_registry(shipped_registry_path())
    for path in (user_registry_path(), extra):
        if path is not None and (path == extra or path.exists()):
            entries.update(parse_registry(path))
    return entries


def lookup(alias: str, entries: dict[str, ModelEntry]) -> ModelEntry:
    try:
        return entries[alias]
    except KeyError:
        raise RegistryError(
            f"unknown model {alias!r}: not a file and not an alias in models.toml",
            "run `specrun models list` to see aliases, or pass a path to a .gguf file",
        ) from None
