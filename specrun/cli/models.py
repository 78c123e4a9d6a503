"""``specrun models``: the registry (models.toml) and the Hugging Face cache.

list, info, pull, rm, check and convert. Every MODEL argument is an alias, a local path or a
Hugging Face id (``owner/name/FILE.gguf`` for a GGUF, ``owner/name`` for an MLX repo).
Data goes to stdout (``--json`` prints only JSON); progress and reports to stderr.
"""

from __future__ import annotations

import contextlib
import json
import struct
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from specrun.cli.common import PipeConsole, check_backend, cli_errors
from specrun.cli.interrupts import terminate_as_interrupt
from specrun.cli.options import BackendOpt, DraftOpt, JsonOpt, RegistryOpt, TargetOpt
from specrun.errors import FileAccessError, ModelFileError, SpecrunError, UsageError
from specrun.fileio import check_writable_folder
from specrun.registry.hub import (
    SOURCE_KINDS,
    CacheStatus,
    PairCheck,
    cache_status,
    check_pair,
    gguf_parts,
    pull,
    remove_cached,
)
from specrun.registry.loading import DEFAULT_TARGET, choose_backend, check_layer_draft_pair, draft_entry_for
from specrun.registry.catalog import HUB_ID_ORIGIN, LOCAL_ORIGIN, ModelEntry, entry_for, load_registry

models_app = typer.Typer(
    help="The model registry (models.toml) and downloads from the Hugging Face Hub.",
    no_args_is_help=True,
)

ModelArg = Annotated[str, typer.Argument(help="Alias, local path, owner/name/FILE.gguf or owner/name (MLX).")]


@models_app.command("list")
def list_models(json_output: JsonOpt = False, registry: RegistryOpt = None) -> None:
    """Every alias: its sources, download size, and what is already cached."""
    with cli_errors():
        rows = [_summary(entry, cache_status(entry)) for entry in load_registry(registry).values()]
        if json_output:
            typer.echo(json.dumps(rows))
            return
        _stdout_console().print(_models_table(rows))
        if any(not row["verified"] for row in rows):
            typer.echo("* repository or file names not checked against the Hub", err=True)


@models_app.command()
def info(model: ModelArg, json_output: JsonOpt = False, registry: RegistryOpt = None) -> None:
    """Everything the registry knows about MODEL, and where its cached files are."""
    with cli_errors():
        entry = entry_for(model, load_registry(registry))
        if entry.origin == LOCAL_ORIGIN:
            _check_local_model(entry)
        details = _summary(entry, cache_status(entry))
        if entry.origin in (LOCAL_ORIGIN, HUB_ID_ORIGIN):
            # what the registry checked of its own entries: a path or an id typed was not checked
            details["verified"] = None
        details["gguf_files"] = gguf_parts(entry.gguf_file) if entry.gguf_file else []
        if json_output:
            typer.echo(json.dumps(details))
            return
        for key, value in details.items():
            if key == "verified" and value is False:  # said, not left out as an empty field
                value = "no (its repository or file names were not checked against the Hub)"
            if value not in ("", [], None, 0):
                typer.echo(f"{key:>12}: {', '.join(value) if isinstance(value, list) else value}")


def _check_local_model(entry: ModelEntry, kind: str | None = None) -> None:
    """A path given to `models info` holds a model: a GGUF file whose metadata fits the file (its
    tensors are left to loading: a type this gguf-py does not know may be llama.cpp's), or a
    folder with an MLX model's config.json; else ModelFileError naming what it is. ``kind``
    ("gguf", "mlx"): that one of the entry's paths (None: its GGUF where it has one)."""
    from specrun.backends.llama import check_gguf_file
    from specrun.modelkit.gguf_check import read_layout

    if entry.gguf_path and kind != "mlx":
        path = Path(entry.gguf_path).expanduser()
        check_gguf_file(path)
        try:
            read_layout(path, tensors=False)
        except (ValueError, OSError, struct.error) as exc:
            raise ModelFileError(f"{path} is not a whole GGUF file: {exc}",
                                 "download it again, or pass another .gguf file") from None
        return
    folder = Path(entry.mlx_path or "").expanduser()
    if not (folder / "config.json").is_file():
        raise ModelFileError(f"{folder} is not an MLX model folder (it holds no config.json)",
                             "pass an MLX model's folder or a .gguf file")


@models_app.command("pull")
def pull_model(model: ModelArg, backend: BackendOpt = "auto", registry: RegistryOpt = None) -> None:
    """Download MODEL into the Hugging Face cache (what --backend would load); print its local path."""
    with cli_errors():
        check_backend(backend)
        entries = load_registry(registry)
        entry = entry_for(model, entries)
        kind = _kind_for(backend, model, entry, entries)
        path = pull(entry, kind, progress=sys.stderr.isatty())
        # a path (given, or a registry's gguf_path / mlx_path): nothing to download, but it must be a model
        if (entry.gguf_path and not entry.gguf_repo) if kind == "gguf" else (entry.mlx_path and not entry.mlx_repo):
            if not path.exists():
                raise ModelFileError(f"model file not found: {path}",
                                     "give a .gguf file's or an MLX folder's path, or an alias (`specrun models list`)")
            _check_local_model(entry, kind)
        typer.echo(str(path))
        typer.echo(f"{entry.alias}: {kind.upper()} ready", err=True)


@models_app.command("rm")
def remove_model(model: ModelArg, backend: BackendOpt = "auto", registry: RegistryOpt = None) -> None:
    """Delete MODEL's files from the Hugging Face cache (--backend llama: only the GGUF, mlx: only MLX)."""
    with cli_errors():
        check_backend(backend)
        entry = entry_for(model, load_registry(registry))
        kinds = {"auto": SOURCE_KINDS, "llama": ("gguf",), "mlx": ("mlx",)}[backend]
        removed = remove_cached(entry, kinds)
        for label, size in removed:
            typer.echo(f"removed {label} ({_gigabytes(size)})", err=True)
        if not removed:
            typer.echo(f"nothing of {entry.alias} is in the cache", err=True)


@models_app.command()
def check(
    target: TargetOpt = None, draft: DraftOpt = None, json_output: JsonOpt = False, registry: RegistryOpt = None
) -> None:
    """Can DRAFT speculate for TARGET? Compares vocabularies from GGUF metadata or tokenizer files, not weights.

    Exits 0 when compatible, 1 when not. With no --draft, checks the target's first
    suggested draft; with neither, the demo pair.
    """
    with cli_errors():
        entries = load_registry(registry)
        target_entry = entry_for(target or DEFAULT_TARGET, entries)
        draft_spec = draft or next(iter(target_entry.drafts), None)
        if draft_spec is None:
            raise UsageError(f"{target_entry.alias} suggests no draft", "name one with --draft")
        draft_entry = draft_entry_for(draft_spec, target_entry, entries)
        verdict = check_pair(target_entry, draft_entry)
        verdict = check_layer_draft_pair(verdict, draft_spec, target_entry)
        if json_output:
            typer.echo(json.dumps({"target": target_entry.alias, "draft": draft_entry.alias,
                                   "compatible": verdict.compatible, **vars(verdict)}))
        else:
            _print_verdict(target_entry.alias, draft_entry.alias, verdict)
        if not verdict.compatible:
            raise typer.Exit(1)


@models_app.command()
def convert(
    model_file: Annotated[Path, typer.Argument(help="The .gguf file: llama, qwen2, Qwen3.5's qwen35/qwen35moe, qwen3next, glm4moe or deepseek2 (MTP kept).")],
    to: Annotated[str, typer.Option("--to", help="The format to write: mlx.")],
    out: Annotated[
        Optional[Path], typer.Option("--out", help="The folder to write (default: <stem>-mlx beside the file).")
    ] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="float16, or q4: MLX 4-bit in groups of 32 (Q4_1 weights kept exactly).")
    ] = "float16",
) -> None:
    """Convert a GGUF file into an MLX model folder (mlx-lm cannot load GGUF); print the folder's path."""
    from specrun.backends.llama import check_gguf_file
    from specrun.modelkit.demo import derive_once
    from specrun.modelkit.gguf_convert import MLX_DTYPES, convert_gguf_to_mlx

    with cli_errors():
        if to != "mlx":
            raise UsageError(f"cannot convert to {to!r}", "use --to mlx")
        if dtype not in MLX_DTYPES:
            raise UsageError(f"unknown --dtype {dtype!r}", f"use one of: {', '.join(MLX_DTYPES)}")
        if not model_file.exists():  # an alias, say: convert reads a file
            raise ModelFileError(f"model file not found: {model_file}",
                                 "models convert takes a .gguf file's path (`specrun models info ALIAS` shows an "
                                 "alias's gguf_path)")
        check_gguf_file(model_file)
        dest = out or model_file.with_name(f"{model_file.stem}-mlx")
        missing = [folder for folder in dest.parents if not folder.exists()]  # made for it, deepest first
        emptied = dest.is_dir() and not dest.is_symlink()
        _check_out_folder(dest)
        typer.echo(f"converting {model_file} to MLX ({dtype})", err=True)
        # Written beside dest and renamed at the end: a failure, Ctrl-C or SIGTERM leaves no
        # half-written folder, and what was there before as it was (the user's empty folder, no
        # folders made for it).
        try:
            with terminate_as_interrupt():
                derive_once(dest, lambda scratch: convert_gguf_to_mlx(model_file, scratch, mlx_dtype=dtype))
        except BaseException:
            _put_back(dest, emptied, missing)
            raise
        typer.echo(str(dest))


def _put_back(dest: Path, emptied: bool, missing: list[Path]) -> None:
    """A conversion that failed: the empty folder ``dest`` was made again where it was, the
    folders made for it (``missing``, deepest first) removed where still empty."""
    with contextlib.suppress(OSError):
        if emptied and not dest.exists():
            dest.mkdir()
        for folder in missing:
            folder.rmdir()


def _check_out_folder(dest: Path) -> None:
    """Before converting anything: ``dest`` is a folder convert can create (an empty folder there
    is replaced); a link, a full folder, a path under a file or a read-only place is one line."""
    fix = "pass another --out"
    if dest.is_symlink():
        raise UsageError(f"--out {dest} is a symbolic link", "pass the path of the folder to create itself")
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        raise UsageError(f"{dest} already exists", f"remove it or {fix}")
    if not dest.exists():
        check_writable_folder(dest, "output folder", fix)
        return
    try:
        dest.rmdir()  # an empty folder: the finished one takes its place
    except OSError as exc:
        raise FileAccessError(f"cannot replace the empty folder {dest}: {exc.strerror or exc}", fix) from None


def _kind_for(backend: str, spec: str, entry: ModelEntry, entries: dict[str, ModelEntry]) -> str:
    """'gguf' or 'mlx': what ``--backend`` loads; for auto, what `specrun chat` would pick here."""
    check_backend(backend)
    if backend == "auto":
        with contextlib.suppress(SpecrunError):  # no backend installed: still fetch what exists
            backend = choose_backend("auto", spec, entries)
    if backend == "auto":
        backend = "llama" if entry.gguf_repo or not entry.mlx_repo else "mlx"
    return "gguf" if backend == "llama" else "mlx"


def _summary(entry: ModelEntry, status: CacheStatus) -> dict:
    """One entry and its cache status as plain data (the JSON of `list` and `info`)."""
    return {
        "alias": entry.alias,
        "description": entry.description,
        "family": entry.family,
        "params": entry.params,
        "quant": entry.quant,
        "context": entry.context,
        "size_gb": entry.size_gb,
        "builtin": entry.builtin,
        "gguf_repo": entry.gguf_repo,
        "gguf_file": entry.gguf_file,
        "gguf_path": entry.gguf_path,
        "mlx_repo": entry.mlx_repo,
        "mlx_path": entry.mlx_path,
        "drafts": list(entry.drafts),
        "verified": entry.verified,
        "origin": entry.origin,
        "cached": [kind for kind in ("gguf", "mlx") if getattr(status, kind)],
        "cached_gb": round(status.bytes_on_disk / 1e9, 3),
    }


def _models_table(rows: list[dict]) -> Table:
    table = Table("alias", "params", "quant", "sources", "size", "cached", box=None, pad_edge=False)
    for row in rows:
        table.add_row(
            row["alias"] + ("" if row["verified"] else "*"),
            row["params"],
            row["quant"],
            _sources(row),
            f"{row['size_gb']:g} GB" if row["size_gb"] else "",
            _cached(row),
        )
    return table


def _sources(row: dict) -> str:
    if row["builtin"]:
        return "built in"
    names = [("GGUF", row["gguf_repo"] or row["gguf_path"]), ("MLX", row["mlx_repo"] or row["mlx_path"])]
    return " + ".join(kind for kind, where in names if where)


def _cached(row: dict) -> str:
    if row["builtin"]:
        return "built in"
    if row["gguf_path"] or row["mlx_path"]:
        return "local"
    return " + ".join(kind.upper() for kind in row["cached"]) or "-"


def _print_verdict(target: str, draft: str, verdict: PairCheck) -> None:
    if verdict.compatible:
        typer.echo(f"compatible: {draft} can draft for {target}")
    else:
        typer.echo(f"incompatible: {draft} cannot draft for {target}")
        for problem in verdict.problems:
            typer.echo(f"  - {problem}")
    for note in verdict.notes:
        typer.echo(f"  note: {note}")
    typer.echo(f"  target: {verdict.target_source}\n  draft:  {verdict.draft_source}")


def _stdout_console() -> PipeConsole:
    """Rich on stdout; wide enough when piped that rows are not cut."""
    return PipeConsole(width=None if sys.stdout.isatty() else 200)


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.2f} GB"
