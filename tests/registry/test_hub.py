"""Downloads through huggingface_hub against a local hub on 127.0.0.1: never the real network.

The local hub serves files in the Hub's URL layout (``/{repo}/resolve/{revision}/{file}``
with ETag, X-Repo-Commit, Content-Length and Range support) and the two API routes
snapshot_download uses. huggingface_hub reads its settings into
``huggingface_hub.constants`` at import, so the tests patch those constants.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from huggingface_hub import constants
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.errors import ModelFileError
from specrun.registry.hub import CacheStatus, cache_status, cached_gguf, cached_mlx, check_pair, remove_cached
from specrun.registry.loading import resolve_gguf
from specrun.registry.catalog import ModelEntry, parse_registry

runner = CliRunner()
GGUF_REPO = "specrun-test/tiny-llama-GGUF"
SPLIT_REPO = "specrun-test/tiny-split-GGUF"
MLX_REPO = "specrun-test/tiny-qwen2-mlx"
SPLIT_FIRST = "Q8/tiny-Q8-00001-of-00002.gguf"
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")
API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<route>revision|tree)/(?P<revision>[^/]+)$")


@dataclass
class LocalHub:
    """Repos of files, a log of (method, path, Range header), and transfers to cut off once."""

    repos: dict[str, dict[str, bytes]]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    cut_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before dropping the connection
    endpoint: str = ""  # http://127.0.0.1:PORT once serving

    def commit(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def data_requests(self) -> list[tuple[str, str, str | None]]:
        return [request for request in self.requests if request[0] == "GET" and "/resolve/" in request[1]]


def make_handler(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self.serve(head=True)

        def do_GET(self) -> None:
            self.serve(head=False)

        def serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            resolve, api = RESOLVE.match(path), API.match(path)
            if resolve:
                self.serve_file(resolve["repo"], resolve["file"], path, head)
            elif api and api["repo"] in hub.repos:
                self.serve_api(api["repo"], api["route"])
            else:
                self.reply(404, b"", {"X-Error-Code": "RepoNotFound"})

        def serve_file(self, repo: str, name: str, path: str, head: bool) -> None:
            if repo not in hub.repos:
                return self.reply(404, b"", {"X-Error-Code": "RepoNotFound"})
            commit = hub.commit(repo)
            if name not in hub.repos[repo]:
                return self.reply(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
            data = hub.repos[repo][name]
            start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range") or "bytes=0-")[1])
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": commit,
                       "Accept-Ranges": "bytes"}
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            cut = None if head else hub.cut_after.pop(path, None)
            self.reply(206 if start else 200, data[start:], headers, head=head, cut=cut)

        def serve_api(self, repo: str, route: str) -> None:
            files = hub.repos[repo]
            if route == "revision":
                body = {"id": repo, "sha": hub.commit(repo), "siblings": [{"rfilename": name} for name in files]}
            else:
                body = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for name, data in files.items()]
            self.reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def reply(self, status: int, body: bytes, headers: dict, head: bool = False, cut: int | None = None):
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body if cut is None else body[:cut])
            if cut is not None:
                self.close_connection = True  # the client sees a body shorter than Content-Length

    return Handler


@pytest.fixture
def local_hub(tiny_llama, tiny_qwen2):
    gguf = tiny_llama.gguf_path.read_bytes()
    hub = LocalHub({
        GGUF_REPO: {"tiny-llama-f16.gguf": gguf, "README.md": b"tiny"},
        SPLIT_REPO: {SPLIT_FIRST: gguf[:1000], "Q8/tiny-Q8-00002-of-00002.gguf": gguf[1000:]},
        MLX_REPO: {path.name: path.read_bytes() for path in tiny_qwen2.hf_dir.iterdir()},
    })
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield hub
    server.shutdown()
    server.server_close()


@pytest.fixture
def hub_env(local_hub, tmp_path, monkeypatch):
    """huggingface_hub pointed at the local hub, with a fresh cache; online unless a test says otherwise."""
    monkeypatch.setattr(constants, "ENDPOINT", local_hub.endpoint)
    template = local_hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf" / "stored_tokens"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return local_hub


def gguf_entry(**changes) -> ModelEntry:
    fields = {"alias": "tiny-q", "origin": "test", "gguf_repo": GGUF_REPO, "gguf_file": "tiny-llama-f16.gguf"}
    return ModelEntry(**{**fields, **changes})


def go_offline(monkeypatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# ---- GGUF downloads -------------------------------------------------------------------
def test_download_lands_in_the_hf_cache_and_is_reused(hub_env, tiny_llama):
    path = cached_gguf(gguf_entry())
    assert path.read_bytes() == tiny_llama.gguf_path.read_bytes()
    assert Path(constants.HF_HUB_CACHE) in path.parents and "models--specrun-test--tiny-llama-GGUF" in str(path)
    assert len(hub_env.data_requests()) == 1
    assert cached_gguf(gguf_entry()) == path
    assert len(hub_env.data_requests()) == 1  # the second call only asked for metadata


def test_transfer_cut_off_midway_resumes_with_a_range_request(hub_env, tiny_llama, monkeypatch):
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)  # so the bytes before the cut reach the disk
    size = tiny_llama.gguf_path.stat().st_size
    hub_env.cut_after[f"/{GGUF_REPO}/resolve/main/tiny-llama-f16.gguf"] = size // 2
    path = cached_gguf(gguf_entry())
    assert path.read_bytes() == tiny_llama.gguf_path.read_bytes()
    first, second = hub_env.data_requests()
    assert first[2] is None
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", second[2])[1])
    assert 0 < resumed_at <= size // 2  # only the missing tail was fetched again


def test_offline_uses_the_cache_without_any_request(hub_env, monkeypatch):
    path = cached_gguf(gguf_entry())
    seen = len(hub_env.requests)
    go_offline(monkeypatch)
    assert cached_gguf(gguf_entry()) == path
    assert len(hub_env.requests) == seen


def test_offline_without_the_file_names_it_and_the_pull_command(hub_env, monkeypatch):
    go_offline(monkeypatch)
    with pytest.raises(ModelFileError) as caught:
        cached_gguf(gguf_entry())
    message = caught.value.one_line()
    assert f"{GGUF_REPO}/tiny-llama-f16.gguf is not downloaded" in message and "HF_HUB_OFFLINE=1" in message
    assert "`specrun models pull tiny-q`" in message and "\n" not in message
    assert hub_env.requests == []


def test_missing_file_and_missing_repo_are_one_line_errors(hub_env):
    with pytest.raises(ModelFileError, match="the Hub has no file .*nope.gguf"):
        cached_gguf(gguf_entry(gguf_file="nope.gguf"))
    with pytest.raises(ModelFileError, match="no Hub repository for someone/absent"):
        cached_gguf(gguf_entry(gguf_repo="someone/absent"))


def test_split_gguf_downloads_every_part_beside_the_first(hub_env):
    entry = gguf_entry(gguf_repo=SPLIT_REPO, gguf_file=SPLIT_FIRST)
    first = cached_gguf(entry)
    assert first.name == "tiny-Q8-00001-of-00002.gguf"
    assert (first.parent / "tiny-Q8-00002-of-00002.gguf").exists()
    assert cache_status(entry).gguf
    (first.parent / "tiny-Q8-00002-of-00002.gguf").unlink()
    assert not cache_status(entry).gguf  # one missing part: not cached


def test_hub_id_resolves_to_a_downloaded_gguf(hub_env, tiny_llama):
    path = resolve_gguf(f"{GGUF_REPO}/tiny-llama-f16.gguf", {})
    assert path.read_bytes() == tiny_llama.gguf_path.read_bytes()


def test_remove_deletes_only_the_entrys_files(hub_env):
    entry = gguf_entry()
    cached_gguf(entry)
    readme = cached_gguf(gguf_entry(gguf_file="README.md"))
    removed = remove_cached(entry)
    assert [label for label, _ in removed] == [f"{GGUF_REPO}/tiny-llama-f16.gguf"]
    assert cache_status(entry) == CacheStatus(gguf=False, mlx=None, bytes_on_disk=0)
    assert readme.read_bytes() == b"tiny"


# ---- MLX repos --------------------------------------------------------------------------
def test_mlx_snapshot_and_tokenizer_only_check(hub_env, tiny_qwen2, tiny_llama):
    entry = ModelEntry(alias="tiny-mlx", origin="test", mlx_repo=MLX_REPO)
    verdict = check_pair(ModelEntry(alias="t", origin="test", mlx_path=str(tiny_llama.hf_dir)), entry)
    assert verdict.compatible and "tokenizer.json" in verdict.draft_source
    assert not any(path.endswith(".safetensors") for _, path, _ in hub_env.requests)  # no weights for a check
    assert cache_status(entry).mlx is False
    folder = cached_mlx(entry)
    assert (folder / "model.safetensors").read_bytes() == (tiny_qwen2.hf_dir / "model.safetensors").read_bytes()
    assert cache_status(entry).mlx


# ---- the CLI ----------------------------------------------------------------------------
def test_cli_pull_list_rm_round_trip(hub_env, tmp_path):
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.tiny]\ngguf_repo = "{GGUF_REPO}"\ngguf_file = "tiny-llama-f16.gguf"\n'
                        f'mlx_repo = "{MLX_REPO}"\n')
    pulled = runner.invoke(app, ["models", "pull", "tiny", "--backend", "llama", "--registry", str(registry)])
    assert pulled.exit_code == 0, pulled.output
    assert Path(pulled.stdout.strip()).name == "tiny-llama-f16.gguf"
    listed = json.loads(runner.invoke(app, ["models", "list", "--json", "--registry", str(registry)]).stdout)
    assert next(row for row in listed if row["alias"] == "tiny")["cached"] == ["gguf"]
    removed = runner.invoke(app, ["models", "rm", "tiny", "--registry", str(registry)])
    assert removed.exit_code == 0 and "removed specrun-test/tiny-llama-GGUF/tiny-llama-f16.gguf" in removed.stderr
    assert not Path(pulled.stdout.strip()).exists()


@pytest.mark.parametrize(("given", "message"), [("/no/such/model.gguf", "model file not found"),
                                                ("garbage.gguf", "is not a GGUF file"),
                                                ("empty-folder", "is not an MLX model folder"),
                                                ("registered", "model file not found")])
def test_cli_pull_of_a_path_that_is_no_model_is_one_line_exit_1(hub_env, tmp_path, given, message):
    """A path (given, or a registry's gguf_path) needs no download, but `models pull` must not call
    a missing file, a garbage one or a folder without a model ready."""
    args = []
    if given == "garbage.gguf":
        given = str(tmp_path / given)
        Path(given).write_bytes(b"not a model at all")
    elif given == "empty-folder":
        given = str(tmp_path / given)
        Path(given).mkdir()
        args = ["--backend", "mlx"]
    elif given == "registered":
        registry = tmp_path / "models.toml"
        registry.write_text(f'[models.gone]\ngguf_path = "{tmp_path / "gone.gguf"}"\n')
        args = ["--registry", str(registry)]
        given = "gone"
    result = runner.invoke(app, ["models", "pull", given, *args])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "ready" not in result.stderr
    assert message in result.stderr, result.stderr


def test_cli_pull_offline_is_one_line_exit_1(hub_env, monkeypatch):
    go_offline(monkeypatch)
    entries = parse_registry(Path(__file__).parents[2] / "models.toml")
    assert "llama3-8b-q4" in entries
    result = runner.invoke(app, ["models", "pull", "llama3-8b-q4", "--backend", "llama"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf is not downloaded" in result.stderr
    assert "specrun models pull llama3-8b-q4" in result.stderr
    assert hub_env.requests == []
