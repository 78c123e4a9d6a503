"""The model registry: aliases in models.toml resolved to model files.

The shipped registry is models.toml at the repository root (installed inside the
package); a user registry in the XDG config directory and ``--registry FILE``
override it, entry by entry. Wherever an alias is accepted, a local path (a .gguf
file or an MLX folder) and a Hugging Face id (``owner/name`` for an MLX repo,
``owner/name/FILE.gguf`` for one GGUF file) work too: :func:`entry_for` turns
each into a :class:`ModelEntry`.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from specrun.errors import ModelFileError, RegistryError, UsageError
from specrun.fileio import MiB, config_dir, read_limited

NUMBER = (int, float)
# A registry lists models, a few hundred bytes each.
MAX_REGISTRY_BYTES = 16 * MiB
ENTRY_KEYS: dict[str, type | tuple[type, ...]] = {
    "description": str,
    "family": str,
    "params": str,
    "quant": str,
    "context": int,
    "size_gb": NUMBER,
    "builtin": str,
    "gguf_repo": str,
    "gguf_file": str,
    "gguf_path": str,
    "mlx_repo": str,
    "mlx_path": str,
    "drafts": list,
    "verified": bool,
    "completion": bool,
}
SOURCE_KEYS = ("builtin", "gguf_repo", "gguf_path", "mlx_repo", "mlx_path")
LOCAL_ORIGIN = "a local path"  # the origin of entries made from what a user typed
HUB_ID_ORIGIN = "a Hugging Face id"

REPO_ID_FIX = "write it as OWNER/NAME, e.g. bartowski/Llama-3.2-1B-Instruct-GGUF"
REPO_FILE_FIX = "give it as the repo lists it, e.g. model-Q4_K_M.gguf"
# huggingface_hub's validate_repo_id, written out: importing it costs every command that reads the
# registry its HTTP client (tests/registry/test_registry.py checks the two agree)
_REPO_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]{1,96}", re.ASCII)


def is_repo_id(repo: str) -> bool:
    """Would the Hub take ``repo`` as a repo id (OWNER/NAME or NAME)?"""
    return (bool(_REPO_ID.fullmatch(repo)) and "--" not in repo and ".." not in repo
            and not repo.endswith(".git") and not repo.startswith(("-", ".")) and not repo.endswith(("-", "."))
            and "/-" not in repo and "/." not in repo and "-/" not in repo and "./" not in repo)


def is_repo_file(name: str) -> bool:
    """Is ``name`` a path inside a repo (not absolute, no ``..``)?"""
    return bool(name) and not name.startswith(("/", "\\")) and ".." not in name.replace("\\", "/").split("/")


_REPO_PART = r"[A-Za-z0-9][\w.-]*"
HUB_REPO_ID = re.compile(rf"(?P<repo>{_REPO_PART}/{_REPO_PART})")
HUB_GGUF_ID = re.compile(rf"(?P<repo>{_REPO_PART}/{_REPO_PART})/(?P<file>[^\s]+\.gguf)")
_TABLE_HEADER = re.compile(r"""^\s*\[\s*models\s*\.\s*(?:"([^"]+)"|'([^']+)'|([\w.-]+))\s*\]""")
_KEY_LINE = re.compile(r"""^\s*(?:"([^"]+)"|([\w-]+))\s*=""")
_ERROR_LINE = re.compile(r"at line (\d+)")


@dataclass(frozen=True)
class ModelEntry:
    """One alias: where its GGUF and/or MLX weights come from, and what it pairs with."""

    alias: str
    origin: str  # the registry file it came from, or how a path or Hub id was read
    description: str = ""
    family: str = ""  # the tokenizer family: drafts must share it
    params: str = ""
    quant: str = ""
    context: int = 0
    size_gb: float = 0.0  # download size of the GGUF (all parts), or of the MLX repo without one
    builtin: str = ""
    gguf_repo: str = ""
    gguf_file: str = ""  # the first part when the GGUF is split (NAME-00001-of-0000N.gguf)
    gguf_path: str = ""
    mlx_repo: str = ""
    mlx_path: str = ""
    drafts: tuple[str, ...] = field(default=())
    verified: bool = True  # repo ids and file names checked against public listings
    completion: bool = False  # a model for text completion: prompts go to it as typed, not in its chat template


def shipped_registry_path() -> Path:
    return Path(str(resources.files("specrun").joinpath("models.toml")))


def user_registry_path() -> Path:
    return config_dir() / "models.toml"


def parse_registry(path: Path) -> dict[str, ModelEntry]:
    """Read one registry file; every problem names the file, the alias and the key."""
    raw = read_limited(path, MAX_REGISTRY_BYTES, "registry", "check the path", error=RegistryError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RegistryError(
            f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
            "save it as UTF-8 (TOML files must be)",
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _toml_error(path, text, exc) from None
    except RecursionError:
        raise RegistryError(f"{path} is not valid TOML: it nests too deeply", "fix the syntax") from None
    except ValueError:  # tomllib's integers past Python's 4,300 digits (its own hint names a Python call)
        raise RegistryError(f"{path} holds a number of more than 4300 digits", "write a number of a sane size") from None
    unknown_tables = set(data) - {"models"}
    if unknown_tables:
        raise RegistryError(
            f"{path}: unknown top-level key {sorted(unknown_tables)[0]!r}", "put entries under [models.ALIAS]"
        )
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise RegistryError(f"{path}: key 'models' must hold tables", "write entries as [models.ALIAS]")
    return {alias: _parse_entry(path, alias, raw) for alias, raw in models.items()}


def _parse_entry(path: Path, alias: str, raw: object) -> ModelEntry:
    if not isinstance(raw, dict):
        raise RegistryError(f"{path}: models.{alias} must be a table", f"write it as [models.{alias}]")
    for key, value in raw.items():
        _check_value(path, alias, key, value)
    if not any(raw.get(key) for key in SOURCE_KEYS):
        raise RegistryError(
            f"{path}: alias {alias!r} is missing a source", f"add one of: {', '.join(SOURCE_KEYS)}"
        )
    if raw.get("gguf_repo") and not raw.get("gguf_file"):
        raise RegistryError(f"{path}: alias {alias!r} has key 'gguf_repo' but no 'gguf_file'", "add gguf_file")
    fields = dict(raw)
    fields["drafts"] = tuple(fields.get("drafts", ()))
    return ModelEntry(alias=alias, origin=str(path), **fields)


def _check_value(path: Path, alias: str, key: str, value: object) -> None:
    if isinstance(value, dict):  # [models.a.b] nests table "b" inside alias "a"
        raise RegistryError(
            f"{path}: alias {alias!r} has a sub-table {key!r}", f'quote an alias with a dot: [models."{alias}.{key}"]'
        )
    expected = ENTRY_KEYS.get(key)
    if expected is None:
        raise RegistryError(
            f"{path}: alias {alias!r} has unknown key {key!r}", f"use one of: {', '.join(sorted(ENTRY_KEYS))}"
        )
    # TOML booleans are Python ints: true must not pass for a context length.
    wrong_bool = isinstance(value, bool) and expected is not bool
    if wrong_bool or not isinstance(value, expected):
        raise RegistryError(
            f"{path}: alias {alias!r} key {key!r} must be {_type_name(expected)}, not {value!r}", "fix its value"
        )
    if key == "drafts" and not all(isinstance(item, str) for item in value):
        raise RegistryError(f"{path}: alias {alias!r} key 'drafts' must list aliases as strings", "fix its value")
    # checked here, not an internal error at the first download (in every command that reads the file)
    if key in ("gguf_repo", "mlx_repo") and value and not is_repo_id(value):
        raise RegistryError(f"{path}: alias {alias!r} key {key!r} is not a Hugging Face repo id: {value!r}",
                            REPO_ID_FIX)
    if key == "gguf_file" and not is_repo_file(value):
        raise RegistryError(f"{path}: alias {alias!r} key 'gguf_file' must be a file's path inside its repo, "
                            f"not {value!r}", REPO_FILE_FIX)
    if key in ("context", "size_gb") and not (0 <= value < math.inf):
        raise RegistryError(
            f"{path}: alias {alias!r} key {key!r} must be a positive number or 0 (unknown), not {value!r}",
            "fix its value",
        )


def _type_name(expected: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", bool: "true or false", list: "a list", NUMBER: "a number"}
    return names[expected]


def _toml_error(path: Path, text: str, exc: tomllib.TOMLDecodeError) -> RegistryError:
    """A TOML syntax error, located: the line, and the alias and key written there."""
    duplicate = re.search(r"Cannot declare \('models', '([^']+)'\) twice", str(exc))
    if duplicate:
        return RegistryError(
            f"{path}: alias {duplicate[1]!r} is defined twice ({exc})", "merge the two tables or rename one alias"
        )
    match = _ERROR_LINE.search(str(exc))
    line_number = int(match[1]) if match else 0
    alias, key = _place(text, line_number)
    where = f" in alias {alias!r}" if alias else ""
    where += f" at key {key!r}" if key else ""
    return RegistryError(f"{path} is not valid TOML{where}: {exc}", "fix the syntax at that line")


def _place(text: str, line_number: int) -> tuple[str | None, str | None]:
    """(alias, key) written at 1-based ``line_number``: the enclosing [models.ALIAS] and the key on that line."""
    lines = text.splitlines()
    if not 0 < line_number <= len(lines):
        return None, None
    alias = None
    for line in lines[:line_number]:
        header = _TABLE_HEADER.match(line)
        if header:
            alias = next(group for group in header.groups() if group)
        elif line.lstrip().startswith("["):
            alias = None
    key_match = _KEY_LINE.match(lines[line_number - 1])
    key = next((group for group in key_match.groups() if group), None) if key_match else None
    return alias, key


def load_registry(extra: Path | None = None) -> dict[str, ModelEntry]:
    """Shipped entries, overridden by the user registry, overridden by ``extra``."""
    entries = parse_registry(shipped_registry_path())
    for path in (user_registry_path(), extra):
        if path is not None and (path == extra or path.exists()):
            entries.update(parse_registry(path))
    return entries


def lookup(alias: str, entries: dict[str, ModelEntry]) -> ModelEntry:
    """The entry for a registry alias (only): unknown aliases raise RegistryError."""
    try:
        return entries[alias]
    except KeyError:
        raise RegistryError(
            f"unknown model {alias!r}: not a file and not an alias in models.toml",
            "run `specrun models list` to see aliases, or pass a path to a .gguf file",
        ) from None


def entry_for(spec: str, entries: dict[str, ModelEntry]) -> ModelEntry:
    """The entry behind what a user typed: an existing path, an alias, or a Hugging Face id.

    An existing file is a GGUF, an existing folder an MLX model. ``owner/name/FILE.gguf``
    is one GGUF file on the Hub, ``owner/name`` an MLX repo. Any other spec ending in
    .gguf is taken as a (missing) local file, so the error names that file.
    """
    if not spec.strip():  # an unset shell variable: Path("") is the working folder
        raise UsageError("the model's name is empty",
                         "name a model: an alias (`specrun models list`), a .gguf path, an MLX folder or a Hub id")
    path = Path(spec).expanduser()
    if path.is_dir() and path.suffix.lower() == ".gguf" and not (path / "config.json").exists():
        raise ModelFileError(f"{path} is a folder, not a GGUF file", "pass the .gguf file inside it")
    if path.exists() and not (path.is_dir() or path.is_file()):  # reading a FIFO waits for a writer for ever
        raise ModelFileError(f"{path} is not a regular file (a FIFO, a socket or a device)",
                             "pass the .gguf model file itself")
    if path.exists():
        source = {"mlx_path": str(path)} if path.is_dir() else {"gguf_path": str(path)}
        return ModelEntry(alias=spec, origin=LOCAL_ORIGIN, **source)
    if spec in entries:
        return entries[spec]
    hub_file = HUB_GGUF_ID.fullmatch(spec)
    if hub_file:
        if not is_repo_id(hub_file["repo"]):
            raise RegistryError(f"{spec}: {hub_file['repo']!r} is not a Hugging Face repo id", REPO_ID_FIX)
        if not is_repo_file(hub_file["file"]):
            raise RegistryError(f"{spec}: {hub_file['file']!r} is not a file's path inside its repo", REPO_FILE_FIX)
        return ModelEntry(
            alias=spec, origin=HUB_ID_ORIGIN, gguf_repo=hub_file["repo"], gguf_file=hub_file["file"]
        )
    if spec.endswith(".gguf"):
        return ModelEntry(alias=spec, origin=LOCAL_ORIGIN, gguf_path=str(path))
    if HUB_REPO_ID.fullmatch(spec):
        if not is_repo_id(spec):
            raise RegistryError(f"{spec!r} is not a Hugging Face repo id", REPO_ID_FIX)
        return ModelEntry(alias=spec, origin=HUB_ID_ORIGIN, mlx_repo=spec)
    return lookup(spec, entries)
