"""Model files on the Hugging Face Hub: downloads into the shared cache, and what is cached.

Everything goes through huggingface_hub, so the cache is the one every Hugging Face
tool uses (HF_HOME and HF_HUB_CACHE are honoured): a file fetched once, by specrun or
by anything else, is not fetched again. With HF_HUB_OFFLINE=1 a cached file is used
as it is, and a missing one is a one-line ModelFileError naming the file and the
``specrun models pull`` command that fetches it.

Resuming: when a transfer breaks midway, huggingface_hub asks for the rest with an
HTTP Range request (again and again, as long as data keeps arriving). A download whose
process is killed starts that file over (huggingface_hub keeps no partial files between
runs), but every finished file stays cached, so a split GGUF resumes at the part it
was on.

Split GGUFs: llama.cpp's gguf-split names the parts NAME-00001-of-0000N.gguf and loads
the others from the first part's folder. The registry names the first part; every part
is fetched into one snapshot folder (pinned to the first part's commit), and the first
part's path is what gets loaded.

The second half reads vocabularies from model files (GGUF metadata, tokenizer.json)
without loading weights, so ``specrun models check`` can refuse a pair before anything
big is downloaded or loaded.

huggingface_hub and gguf are imported inside the functions that need them, so that
``specrun --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import shlex
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specrun.backends.base import VocabInfo
from specrun.registry.compat import vocabulary_differences
from specrun.errors import ModelFileError, RegistryError
from specrun.fileio import json_problem, read_limited
from specrun.registry.catalog import HUB_ID_ORIGIN, ModelEntry

SPLIT_GGUF = re.compile(r"-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# What an MLX model needs (as mlx_lm.load fetches it), minus model code: never run it.
MLX_FILES = ["*.json", "model*.safetensors", "mtp.safetensors", "tokenizer.model", "*.tiktoken", "tiktoken.model",
             "*.txt", "*.jinja"]  # mtp.safetensors: MTP layers beside the weights (modelkit.gguf_convert_qwen35)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
SOURCE_KINDS = ("gguf", "mlx")


# ---- names ---------------------------------------------------------------------------
def gguf_parts(filename: str) -> list[str]:
    """Every file of a GGUF: the file itself, or all parts of a split one (named by its first part)."""
    match = SPLIT_GGUF.search(filename)
    if match is None:
        return [filename]
    if int(match["index"]) != 1:
        raise RegistryError(
            f"GGUF file {filename} is part {int(match['index'])} of a split model",
            "name the first part (…-00001-of-…gguf) in gguf_file",
        )
    stem, count = filename[: match.start()], int(match["count"])
    return [f"{stem}-{index:05d}-of-{count:05d}.gguf" for index in range(1, count + 1)]


def pull_command(entry: ModelEntry, kind: str = "gguf") -> str:
    """The command that downloads ``entry``'s ``kind`` of files."""
    option = " --backend mlx" if kind == "mlx" and (entry.gguf_repo or entry.gguf_path) else ""
    return f"specrun models pull {shlex.quote(entry.alias)}{option}"


# ---- downloads -------------------------------------------------------------------------
def pull(entry: ModelEntry, kind: str, progress: bool = False) -> Path:
    """``entry``'s ``kind`` ("gguf" or "mlx") of model, downloaded unless cached: the path that loads.

    Local and built-in models need no download; their path comes back as it is.
    """
    if kind == "gguf" and entry.gguf_repo:
        return cached_gguf(entry, progress)
    if kind == "mlx" and entry.mlx_repo:
        return cached_mlx(entry, progress)
    local = entry.gguf_path if kind == "gguf" else entry.mlx_path
    if local:
        return Path(local).expanduser()
    if entry.builtin:
        from specrun.modelkit.builtin import builtin_gguf, builtin_mlx_dir

        return builtin_gguf(entry.builtin) if kind == "gguf" else builtin_mlx_dir(entry.builtin)
    other = "mlx" if kind == "gguf" else "llama"
    raise RegistryError(f"{entry.alias} has no {kind.upper()} source ({entry.origin})", f"try --backend {other}")


def cached_gguf(entry: ModelEntry, progress: bool = False) -> Path:
    """The local path of ``entry``'s Hub GGUF (its first part when split), downloading what is missing."""
    parts = gguf_parts(entry.gguf_file)
    with _progress_bars(progress):
        first = _fetch(entry, "gguf", entry.gguf_repo, parts[0])
        commit = _snapshot_folder(first, parts[0]).name
        for part in parts[1:]:
            _fetch(entry, "gguf", entry.gguf_repo, part, revision=commit)
    return first


def cached_mlx(entry: ModelEntry, progress: bool = False) -> Path:
    """The local snapshot folder of ``entry``'s MLX repo (weights and tokenizer), downloading what is missing."""
    from huggingface_hub import snapshot_download

    with _hub_errors(entry, "mlx", entry.mlx_repo), _progress_bars(progress):
        return Path(snapshot_download(entry.mlx_repo, allow_patterns=MLX_FILES, local_files_only=not hub_reachable()))


def tokenizer_folder(entry: ModelEntry) -> Path:
    """A folder with ``entry``'s tokenizer.json (and configs): the MLX folder, or just those files from its repo."""
    if entry.mlx_path:
        return Path(entry.mlx_path).expanduser()
    tokenizer = _fetch(entry, "mlx", entry.mlx_repo, TOKENIZER_FILES[0])
    folder = _snapshot_folder(tokenizer, TOKENIZER_FILES[0])
    for name in TOKENIZER_FILES[1:]:
        _fetch(entry, "mlx", entry.mlx_repo, name, revision=folder.name, optional=True)
    return folder


def _fetch(
    entry: ModelEntry, kind: str, repo: str, filename: str, revision: str | None = None, optional: bool = False
) -> Path | None:
    """One file through the cache, downloaded if missing; None when an ``optional`` file is not on the Hub."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    with _hub_errors(entry, kind, f"{repo}/{filename}"):
        try:
            return Path(hf_hub_download(repo, filename, revision=revision, local_files_only=not hub_reachable()))
        except RemoteEntryNotFoundError:
            if optional:
                return None
            raise


# How long to wait for the Hub's host to accept a connection before working from the cache.
HUB_PROBE_SECONDS = 3.0


def hub_reachable() -> bool:
    """Does the Hub (HF_ENDPOINT) accept a connection? Offline, huggingface_hub retries each
    request with backoff for ~24 s, printing every retry, before it falls back to the cache or
    fails; one quick probe lets specrun go straight to the cache (or to its one-line error)."""
    from huggingface_hub import constants

    return not constants.HF_HUB_OFFLINE and _accepts_connections(constants.ENDPOINT)


@functools.cache
def _accepts_connections(url: str) -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=HUB_PROBE_SECONDS).close()
    except (OSError, UnicodeError, ValueError):
        return False
    return True


def _snapshot_folder(path: Path, filename: str) -> Path:
    """.../snapshots/COMMIT for a file downloaded as ``filename`` (which may sit in a subfolder)."""
    return path.parents[len(Path(filename).parts) - 1]


@contextlib.contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """huggingface_hub's progress bars on (stderr) or off for the block."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if show or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


@contextlib.contextmanager
def _hub_errors(entry: ModelEntry, kind: str, what: str) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line ModelFileErrors that say what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if entry.origin == HUB_ID_ORIGIN:
        where = f"{entry.alias} (a path that does not exist reads as owner/name/FILE.gguf)"
    else:
        where = f"alias {entry.alias!r} in {entry.origin}"
    try:
        yield
    except GatedRepoError as exc:
        raise ModelFileError(
            f"{what} is gated on the Hub", "accept its license on huggingface.co, then run `hf auth login`"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelFileError(
            f"no Hub repository for {what} (or it is private)", f"check the repository id of {where}"
        ) from exc
    except (RemoteEntryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelFileError(f"the Hub has no file {what}", f"check the file name of {where}") from exc
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise ModelFileError(
                f"{what} is not downloaded, and HF_HUB_OFFLINE=1 keeps specrun off the network",
                f"run `{pull_command(entry, kind)}` while online",
            ) from exc
        raise ModelFileError(
            f"cannot reach {constants.ENDPOINT} to download {what}, and it is not in {constants.HF_HUB_CACHE}",
            f"check the connection (or HF_ENDPOINT), then run `{pull_command(entry, kind)}`",
        ) from exc
    except HfHubHTTPError as exc:
        raise ModelFileError(
            f"the Hub refused {what}: {exc}".splitlines()[0], "check the id and your token (`hf auth login`)"
        ) from exc
    except OSError as exc:  # a transfer that broke off for good, a full disk, an unwritable cache
        raise ModelFileError(
            f"downloading {what} failed: {exc}".splitlines()[0], f"fix that, then run `{pull_command(entry, kind)}`"
        ) from exc


# ---- the cache -------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheStatus:
    """Which of an entry's Hub sources are fully in the cache (None: no such Hub source)."""

    gguf: bool | None
    mlx: bool | None
    bytes_on_disk: int


def cache_status(entry: ModelEntry) -> CacheStatus:
    """What is cached for ``entry``, from the cache folder alone (no network)."""
    gguf_files = _cached_gguf_files(entry) if entry.gguf_repo else None
    mlx_files = _cached_mlx_files(entry) if entry.mlx_repo else None
    found = [path for files in (gguf_files, mlx_files) if files for path in files]
    return CacheStatus(
        gguf=None if gguf_files is None else bool(gguf_files),
        mlx=None if mlx_files is None else bool(mlx_files),
        bytes_on_disk=sum(path.stat().st_size for path in found),
    )


def cached_model_paths(entry: ModelEntry) -> list[Path]:
    """What the Hub cache holds of ``entry``'s model, asking the Hub nothing: its GGUF's first part
    and its MLX folder, where every file of each is cached."""
    found = []
    if entry.gguf_repo and entry.gguf_file:
        found += _cached_gguf_files(entry)[:1]
    if entry.mlx_repo and _cached_mlx_files(entry):
        from huggingface_hub import try_to_load_from_cache

        found.append(Path(try_to_load_from_cache(entry.mlx_repo, "config.json")).parent)
    return found


def _cached_gguf_files(entry: ModelEntry) -> list[Path]:
    """Every part of the GGUF if all are cached, else []."""
    from huggingface_hub import try_to_load_from_cache

    paths = [try_to_load_from_cache(entry.gguf_repo, part) for part in gguf_parts(entry.gguf_file)]
    return [Path(path) for path in paths] if all(isinstance(path, str) for path in paths) else []


def _cached_mlx_files(entry: ModelEntry) -> list[Path]:
    """The snapshot's files if its config and every weight file listed in its index are cached, else []."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(entry.mlx_repo, "config.json")
    if not isinstance(config, str):
        return []
    folder = Path(config).parent
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weights = {folder / name for name in json.loads(index.read_text())["weight_map"].values()}
    else:
        weights = {folder / "model.safetensors"}
    if not all(path.exists() for path in weights):
        return []
    return [path for path in folder.rglob("*") if path.is_file()]


def remove_cached(entry: ModelEntry, kinds: tuple[str, ...] = SOURCE_KINDS) -> list[tuple[str, int]]:
    """Delete ``entry``'s files of ``kinds`` from the cache: (repo/file, bytes freed) for each.

    A GGUF goes file by file (a repo often holds other quantizations that stay); an
    MLX repo goes whole. A blob another kept file points to stays.
    """
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    wanted = {}
    if "gguf" in kinds and entry.gguf_repo:
        wanted[entry.gguf_repo] = set(gguf_parts(entry.gguf_file))
    if "mlx" in kinds and entry.mlx_repo:
        wanted[entry.mlx_repo] = None  # every file
    try:
        cache = scan_cache_dir(constants.HF_HUB_CACHE)  # its default is read once, at import
    except CacheNotFound:
        return []
    removed = []
    for repo in cache.repos:
        if repo.repo_type == "model" and repo.repo_id in wanted:
            removed += _remove_repo_files(repo, wanted[repo.repo_id])
    return removed


def _remove_repo_files(repo, names: set[str] | None) -> list[tuple[str, int]]:
    """Unlink the snapshot links named ``names`` (None: all) in every revision, and blobs nothing else uses."""
    removed, kept_blobs, doomed = [], set(), {}
    for revision in repo.revisions:
        for cached in revision.files:
            name = cached.file_path.relative_to(revision.snapshot_path).as_posix()
            if names is None or name in names:
                cached.file_path.unlink(missing_ok=True)
                doomed[cached.blob_path] = (f"{repo.repo_id}/{name}", cached.size_on_disk)
            else:
                kept_blobs.add(cached.blob_path)
    for blob, (label, size) in doomed.items():
        if blob not in kept_blobs:
            blob.unlink(missing_ok=True)
            removed.append((label, size))
    return removed


# ---- vocabularies, read from files -----------------------------------------------------
@dataclass(frozen=True)
class FileVocabulary:
    """A vocabulary as a model's files state it, read without loading any weights.

    It answers what :func:`specrun.registry.compat.vocabulary_differences` asks of a loaded
    backend (``vocab`` and ``token_text``), so ``models check`` and the check before
    generation apply one rule.
    """

    source: str
    tokens: tuple[str, ...]
    vocab: VocabInfo
    padding_ids: frozenset[int]  # ids converters add to round the vocabulary up: never produced

    def token_text(self, token: int) -> str:
        return self.tokens[token]


def training_context(path: Path) -> int | None:
    """The context length a model was trained with (GGUF ``ARCH.context_length``, or an MLX
    folder's ``max_position_embeddings``); None when the file does not say or cannot be read."""
    path = Path(path)
    try:
        if path.is_dir():
            trained = _model_json(path / "config.json").get("max_position_embeddings")
        else:  # key by key from the header: GGUFReader maps a whole vocabulary first (~15 s for Gemma 3)
            from specrun.modelkit.gguf_header import header_values

            values: dict[str, object] = {}
            for key, value in header_values(path):
                values[key] = value
                if f"{values.get('general.architecture')}.context_length" in values:
                    break
            trained = values.get(f"{values.get('general.architecture')}.context_length")
    except Exception:  # noqa: BLE001 (an unreadable file: loading it names the problem)
        return None
    return trained if isinstance(trained, int) and trained > 0 else None


def read_gguf_vocabulary(path: Path) -> FileVocabulary:
    """Tokens, token types and BOS/EOS ids from a GGUF's metadata (the first part of a split one)."""
    import struct

    import gguf

    from specrun.modelkit.gguf_check import read_layout

    # Every count, length and offset of the metadata checked against the file first, as `models
    # info` reads it: gguf-py's reader told a truncated file as "When changing to a larger dtype..."
    try:
        try:
            fields, _ = read_layout(path)  # the tensors' offsets too: a file cut short in its data
        except ValueError as exc:
            if "unknown type" not in str(exc):
                raise
            fields, _ = read_layout(path, tensors=False)  # a type newer than this gguf-py: its metadata alone
    except (ValueError, struct.error, OSError) as exc:
        raise ModelFileError(f"{path} is damaged: {exc}",
                             "check the file; if it is corrupt or truncated, download it again") from None
    keys = gguf.Keys.Tokenizer
    tokens, types = fields.get(keys.LIST) or [], fields.get(keys.TOKEN_TYPE) or []
    ids = {key: fields.get(key) for key in (keys.BOS_ID, keys.EOS_ID, keys.EOT_ID, keys.EOM_ID)}
    if (not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens)
            or not isinstance(types, list) or not all(isinstance(kind, int) for kind in types)
            or not all(value is None or (isinstance(value, int) and not isinstance(value, bool))
                       for value in ids.values())):
        raise ModelFileError(f"{path}'s tokenizer metadata has values of the wrong types",
                             "check the file; if it is corrupt, download it again")
    tokens = tuple(tokens)
    eos_ids = {ids[key] for key in (keys.EOS_ID, keys.EOT_ID, keys.EOM_ID)} - {None}
    bos_id, add_bos = ids[keys.BOS_ID], fields.get(keys.ADD_BOS)
    if not tokens:
        raise ModelFileError(f"{path} has no tokenizer in its metadata", "use a GGUF converted with its tokenizer")
    return FileVocabulary(
        source=f"GGUF metadata of {path}",
        tokens=tokens,
        vocab=VocabInfo(
            size=len(tokens),
            bos_id=bos_id,
            eos_ids=frozenset(eos_ids),
            add_bos=bool(add_bos),
        ),
        padding_ids=frozenset(i for i, kind in enumerate(types) if kind == gguf.TokenType.UNUSED),
    )


def read_tokenizer_vocabulary(folder: Path) -> FileVocabulary:
    """Tokens from tokenizer.json; BOS/EOS from tokenizer_config.json and config.json, as transformers reads them."""
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.exists():
        raise ModelFileError(f"{folder} has no tokenizer.json", "point at a Hugging Face / MLX model folder")
    spec = _model_json(tokenizer_path)
    try:
        vocab = spec["model"]["vocab"]
        if isinstance(vocab, dict):  # BPE, WordPiece: token -> id
            by_id = {token_id: token for token, token_id in vocab.items()}
        else:  # Unigram: [piece, score] in id order
            by_id = {token_id: piece for token_id, (piece, _score) in enumerate(vocab)}
        by_id.update((added["id"], added["content"]) for added in spec.get("added_tokens") or [])
        tokens = tuple(by_id.get(token_id, "") for token_id in range(max(by_id) + 1))
    except (KeyError, TypeError, ValueError) as exc:  # no model.vocab, ids that are not numbers
        raise ModelFileError(f"{tokenizer_path} is not a tokenizer.json specrun can read ({type(exc).__name__}: "
                             f"{json_problem(exc)})", "download the model again") from None
    ids = {token: token_id for token_id, token in by_id.items()}
    settings, config = _json_or_empty(folder / "tokenizer_config.json"), _json_or_empty(folder / "config.json")
    eos_ids = {ids.get(_token_content(settings.get("eos_token")))} | _id_set(config.get("eos_token_id"))
    return FileVocabulary(
        source=f"tokenizer.json of {folder}",
        tokens=tokens,
        vocab=VocabInfo(
            size=len(tokens),
            bos_id=ids.get(_token_content(settings.get("bos_token"))),
            eos_ids=frozenset(eos_ids - {None}),
            add_bos=bool(settings.get("add_bos_token")),
        ),
        padding_ids=frozenset(),
    )


def _json_or_empty(path: Path) -> dict:
    return _model_json(path) if path.exists() else {}


MAX_MODEL_JSON_BYTES = 256 << 20  # a tokenizer.json of 262k tokens is 33 MB


def _model_json(path: Path) -> dict:
    """A model folder's JSON file (config.json, tokenizer.json), read only as a regular file of
    bounded size; ModelFileError naming it where it is not, or not a JSON object."""
    fix = "download the model again"
    data = read_limited(path, MAX_MODEL_JSON_BYTES, "model file", fix, error=ModelFileError)
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:  # syntax, UTF-8, 4300-digit numbers; nesting
        raise ModelFileError(f"{path} is not valid JSON ({json_problem(exc)})", fix) from None
    if not isinstance(document, dict):
        raise ModelFileError(f"{path} is not a JSON object", fix)
    return document


def _token_content(token: str | dict | None) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {value}


@dataclass(frozen=True)
class PairCheck:
    """The verdict on a target/draft pair: what differs, read from which files."""

    target_source: str
    draft_source: str
    problems: list[str]
    notes: list[str]

    @property
    def compatible(self) -> bool:
        return not self.problems


def check_pair(target: ModelEntry, draft: ModelEntry) -> PairCheck:
    """Compare two entries' vocabularies from their files: GGUF metadata or tokenizer files, never weights.

    Both sides are read from the same kind of file when they can be (GGUFs pad their
    vocabularies, tokenizer.json files do not). A Hub GGUF counts only when cached;
    for an MLX repo just the tokenizer files are fetched.
    """
    target_readers, draft_readers = _vocabulary_readers(target), _vocabulary_readers(draft)
    common = [kind for kind in target_readers if kind in draft_readers]
    target_kind = common[0] if common else next(iter(target_readers))
    draft_kind = common[0] if common else next(iter(draft_readers))
    target_vocab, draft_vocab = target_readers[target_kind](), draft_readers[draft_kind]()
    notes = _padding_notes(target_vocab, draft_vocab)
    if target_kind != draft_kind:
        notes.append(
            "one side was read from GGUF metadata, the other from tokenizer.json: the two record padding "
            "and EOS ids differently, so a difference in those alone may not be real"
        )
    return PairCheck(
        target_source=target_vocab.source,
        draft_source=draft_vocab.source,
        problems=vocabulary_differences(target_vocab, draft_vocab),
        notes=notes,
    )


def _vocabulary_readers(entry: ModelEntry) -> dict[str, Callable[[], FileVocabulary]]:
    """How ``entry``'s vocabulary can be read without fetching weights, best first."""
    readers: dict[str, Callable[[], FileVocabulary]] = {}
    gguf_path = _local_gguf(entry)
    if gguf_path is not None:
        readers["gguf"] = lambda: read_gguf_vocabulary(gguf_path)
    if entry.mlx_path or entry.mlx_repo:
        readers["tokenizer"] = lambda: read_tokenizer_vocabulary(tokenizer_folder(entry))
    if not readers:
        raise ModelFileError(
            f"{entry.alias}: its GGUF is not downloaded, and it has no MLX source to read a tokenizer from",
            f"run `{pull_command(entry)}` first",
        )
    return readers


def _local_gguf(entry: ModelEntry) -> Path | None:
    """A GGUF of ``entry`` already on disk, or None."""
    if entry.builtin:
        from specrun.modelkit.demo import shipped_gguf
        from specrun.modelkit.gemma3 import GEMMA3_MODELS, gemma3_gguf
        from specrun.modelkit.smollm2 import SMOLLM2_MODELS, shipped_smollm2

        if entry.builtin in SMOLLM2_MODELS:
            return shipped_smollm2()  # the F16 and Q8_0 copies share its vocabulary
        if entry.builtin in GEMMA3_MODELS:
            return gemma3_gguf("gemma3-270m")  # joined from the package's chunks once; the F16 copy shares it
        return shipped_gguf(entry.builtin)  # the derived variants share its vocabulary
    if entry.gguf_path:
        return Path(entry.gguf_path).expanduser()
    if entry.gguf_repo:
        cached = _cached_gguf_files(entry)
        return cached[0] if cached else None
    return None


def _padding_notes(target: FileVocabulary, draft: FileVocabulary) -> list[str]:
    """Say so when two vocabularies differ in size only by padding ids that are never produced."""
    smaller, larger = sorted((target, draft), key=lambda vocabulary: vocabulary.vocab.size)
    extra = set(range(smaller.vocab.size, larger.vocab.size))
    if not extra or not extra <= larger.padding_ids:
        return []
    return [
        f"the {len(extra)} extra ids in {larger.source} are unused padding "
        f"({larger.tokens[min(extra)]!r}…): llama.cpp's own speculative decoding accepts such pairs"
    ]
