"""--rpc: the target's layers on llama.cpp RPC servers started here on 127.0.0.1, drafts local.

Servers: ``specrun rpc-server`` (llama.cpp's server code, from the library llama-cpp-python
installed) and llama.cpp's own ``ggml-rpc-server`` program, which ``make install`` builds from
the same source (tools/install_llama_cpp.sh). Outputs through the servers are compared with
the same generation on this machine alone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specrun.backends.llama_rpc import parse_endpoints
from specrun.errors import BackendUnavailableError, UsageError
from tests.hardening.cli_checks import ROOT, assert_one_line_error, run_specrun

llama_cpp = pytest.importorskip("llama_cpp")

needs_rpc = pytest.mark.skipif(
    not llama_cpp.llama_supports_rpc(),
    reason="llama-cpp-python was built without RPC (make install builds it with -DGGML_RPC=ON)",
)
PROMPT = "def fibonacci(n):"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the RPC server exited early: {process.stderr.read()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"no RPC server on port {port} after {seconds} s")


class Server:
    """One RPC server process on 127.0.0.1, stopped when the test ends."""

    def __init__(self, command: list[str], port: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.port = port
        self.endpoint = f"127.0.0.1:{port}"
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        wait_for_port(port, self.process)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self.process.stdout.close()
        self.process.stderr.close()


def specrun_server() -> Server:
    port = free_port()
    return Server([sys.executable, "-m", "specrun", "rpc-server", "--port", str(port), "--threads", "1"], port)


def llama_server_program() -> Path:
    """llama.cpp's ggml-rpc-server, as make install builds it into the virtual environment."""
    return Path(sys.executable).parent / "ggml-rpc-server"


@pytest.fixture()
def servers():
    started: list[Server] = []

    def start(kind: str = "specrun") -> Server:
        if kind == "specrun":
            server = specrun_server()
        else:
            program = llama_server_program()
            if not program.exists():
                pytest.skip(f"{program} is missing (make install builds it: tools/install_llama_cpp.sh)")
            port = free_port()
            server = Server([str(program), "-p", str(port), "-t", "1"], port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def generate(*args: str, env: dict | None = None) -> tuple[dict, str]:
    done = run_specrun("generate", PROMPT, "-n", "40", "--threads", "1", "--exact", "--json", *args, env=env)
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    return json.loads(done.stdout), stderr


# ---- endpoints --------------------------------------------------------------------


def test_endpoints_are_host_port_pairs():
    assert parse_endpoints("127.0.0.1:50052") == ("127.0.0.1:50052",)
    assert parse_endpoints("gpu-box:1, 10.0.0.2:65535") == ("gpu-box:1", "10.0.0.2:65535")


@pytest.mark.parametrize(
    ("text", "named"),
    [("", "names no server"), ("a:1,", "names no server"), ("127.0.0.1", "'127.0.0.1' is not HOST:PORT"),
     (":50052", "':50052' is not HOST:PORT"), ("h:0", "'h:0' is not HOST:PORT"), ("h:65536", "'h:65536'"),
     ("h:x", "'h:x'"), ("::1:50052", "'::1:50052'"), ("h:1,h:1", "names a server twice"),
     (",".join(f"h:{port}" for port in range(1, 18)), "at most 16")],
)
def test_malformed_endpoints_are_usage_errors(text, named):
    with pytest.raises(UsageError, match="--rpc") as caught:
        parse_endpoints(text)
    assert named in caught.value.problem


def test_an_install_without_rpc_is_named_with_the_rebuild():
    from specrun.backends import llama_rpc

    class NoRpc:
        @staticmethod
        def llama_supports_rpc():
            return False

    with pytest.raises(BackendUnavailableError, match="without llama.cpp's RPC backend") as caught:
        llama_rpc._Ggml(NoRpc)
    assert "-DGGML_RPC=ON" in caught.value.fix


# ---- bad input through the CLI ------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve", "tune"])
def test_every_command_takes_rpc_and_refuses_a_malformed_one(command):
    done = run_specrun(command, "--rpc", "gpu-box")
    assert_one_line_error(done.returncode, done.stderr, 2, "--rpc server 'gpu-box' is not HOST:PORT")


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
def test_rpc_with_no_layers_to_send_is_a_usage_error(command):
    done = run_specrun(command, "--rpc", "127.0.0.1:1", "--gpu-layers", "0", input=b"hello\n")
    assert_one_line_error(done.returncode, done.stderr, 2, "--gpu-layers 0", "--rpc would send none")


def test_rpc_on_mlx_is_a_usage_error():
    pytest.importorskip("mlx_lm")
    done = run_specrun("generate", "x", "--rpc", "127.0.0.1:1", "--backend", "mlx")
    assert_one_line_error(done.returncode, done.stderr, 2, "--rpc", "MLX backend", "--backend llama")


@needs_rpc
def test_an_unreachable_server_is_one_line():
    port = free_port()  # nothing listens there
    done = run_specrun("generate", "x", "--rpc", f"127.0.0.1:{port}")
    line = assert_one_line_error(done.returncode, done.stderr, 1, f"cannot reach an RPC server at 127.0.0.1:{port}")
    assert "specrun rpc-server" in line


@needs_rpc
def test_two_names_of_one_server_are_refused_before_they_hang_the_load():
    """llama.cpp's server answers one client at a time and its client never times out."""
    port = free_port()
    done = run_specrun("generate", "x", "--rpc", f"127.0.0.1:{port},localhost:{port}")
    assert_one_line_error(done.returncode, done.stderr, 2, "names one server twice", f"localhost:{port}")


def test_bench_native_and_rpc_contradict():
    done = run_specrun("bench", "--native", "--rpc", "127.0.0.1:50052")
    assert_one_line_error(done.returncode, done.stderr, 2, "--native", "--rpc")


@needs_rpc
@pytest.mark.parametrize("host", ["no-such-host.invalid", "bad..x"])  # bad..x: an internal error (idna's UnicodeError)
def test_an_unknown_host_is_one_line(host):
    done = run_specrun("generate", "x", "--rpc", f"{host}:50052")
    assert_one_line_error(done.returncode, done.stderr, 1, f"--rpc host {host!r} is unknown")


@needs_rpc
def test_a_server_that_is_not_rpc_is_one_line_not_an_abort():
    """llama.cpp aborts the process on a failed handshake; specrun's probe runs it in a child."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    answer = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys\n"
        f"s = socket.socket(fileno={listener.fileno()})\n"
        "while True:\n"
        "    c, _ = s.accept(); c.sendall(b'HTTP/1.0 400 Bad Request\\r\\n\\r\\n'); c.close()\n")],
        pass_fds=(listener.fileno(),))
    try:
        done = run_specrun("generate", "x", "--rpc", f"127.0.0.1:{port}")
    finally:
        answer.kill()
        answer.wait()
        listener.close()
    assert_one_line_error(done.returncode, done.stderr, 1, f"127.0.0.1:{port} is not a usable llama.cpp RPC server")


# ---- generation through servers ------------------------------------------------------


@needs_rpc
@pytest.mark.parametrize("method", ["none", "draft", "auto", "lookup"])
def test_greedy_through_a_server_equals_plain_decoding_here(servers, method):
    """--exact: speculation through the server gives plain decoding's tokens on this machine."""
    server = servers()
    local, _ = generate("--method", "none")
    remote, _ = generate("--method", method, "--rpc", server.endpoint, *(["--branches", "2"] * (method == "lookup")))
    assert remote["text"] == local["text"]
    assert remote["stats"]["new_tokens"] == local["stats"]["new_tokens"] == 40
    if method != "none":
        assert remote["stats"]["accepted"] > 0  # drafts were verified through the server


@needs_rpc
@pytest.mark.parametrize("method", [("--method", "none"), ("--method", "draft", "--draft-len", "3")])
def test_sampled_through_a_server_equals_the_same_run_here(servers, method):
    """The same logits and seed give the same samples (fixed draft lengths: adaptive ones follow
    the clock, and the server's passes take another time)."""
    server = servers()
    args = (*method, "--temp", "0.8", "--seed", "7")
    local, _ = generate(*args)
    remote, _ = generate(*args, "--rpc", server.endpoint)
    assert remote["text"] == local["text"]


@needs_rpc
def test_two_servers_share_the_target_and_the_draft_stays_here(servers):
    first, second = servers(), servers()
    local, _ = generate("--method", "none")
    remote, log = generate("--method", "draft", "--rpc", f"{first.endpoint},{second.endpoint}",
                           env={"SPECRUN_DEBUG": "1"})
    assert remote["text"] == local["text"]
    buffers = [line for line in log.splitlines() if "model buffer size" in line]
    assert any(f"[{first.endpoint}]" in line for line in buffers), buffers  # each server holds layers
    assert any(f"[{second.endpoint}]" in line for line in buffers), buffers
    # two models loaded, the target first (its layers on the servers), then the draft, here alone
    target_log, draft_log = log.split("llama_model_loader: loaded meta data")[1:3]
    assert any("RPC" in line for line in target_log.splitlines() if "model buffer size" in line)
    draft_buffers = [line for line in draft_log.splitlines() if "model buffer size" in line]
    assert draft_buffers and not any("RPC" in line for line in draft_buffers), draft_buffers


@needs_rpc
def test_bench_through_a_server_records_it(servers, tmp_path):
    server = servers()
    out = tmp_path / "bench.json"
    done = run_specrun("bench", "--rpc", server.endpoint, "--threads", "1", "--exact", "--methods", "none,lookup",
                       "--categories", "code-completion", "--per-category", "1", "-n", "16", "--json", str(out))
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert document["config"]["rpc"] == [server.endpoint]
    assert document["mismatches"] == [] and all(run["same_as_baseline"] for run in document["runs"])


@needs_rpc
def test_llama_cpps_own_server_program_serves_a_speculative_run(servers):
    server = servers("llama")
    local, _ = generate("--method", "none")
    remote, _ = generate("--method", "auto", "--rpc", server.endpoint)
    assert remote["text"] == local["text"]


# ---- specrun rpc-server -------------------------------------------------------------


@needs_rpc
def test_rpc_server_stops_on_ctrl_c(servers):
    server = servers()
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=30) == 0
    stderr = server.process.stderr.read()
    assert "lending CPU" in stderr and f"on {server.endpoint}" in stderr
    # specrun's last word; llama.cpp's server thread may still log the fixture's readiness probe
    # ("Accepted client connection") after it (a CI run saw that order under load)
    ours = [line for line in stderr.splitlines() if line.startswith("specrun rpc-server:")]
    assert ours[-1] == "specrun rpc-server: stopped", stderr  # once (of many runs) it was missing: show what came
    after = stderr.splitlines()[stderr.splitlines().index(ours[-1]) + 1:]
    assert all("client connection" in line.lower() for line in after), after  # nothing else after it
    assert "Traceback" not in stderr


@needs_rpc
def test_rpc_server_on_a_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run_specrun("rpc-server", "--port", str(port))
    assert_one_line_error(done.returncode, done.stderr, 1, f"cannot listen on 127.0.0.1:{port}", "--port")


@needs_rpc
def test_rpc_server_s_cache_where_a_file_is_in_the_way_is_one_line(tmp_path):
    """$SPECRUN_CACHE/rpc a file: an internal error (FileExistsError) before anything was served."""
    (tmp_path / "rpc").write_text("")
    done = run_specrun("rpc-server", "--port", str(free_port()), "--cache", env={"SPECRUN_CACHE": str(tmp_path)})
    assert_one_line_error(done.returncode, done.stderr, 1, f"cannot keep the RPC cache in {tmp_path / 'rpc'}",
                          f"remove the file {tmp_path / 'rpc'}, or run without --cache")


@needs_rpc
def test_rpc_server_on_an_address_of_another_machine_is_one_usage_error():
    """8.8.8.8 was blamed on the port ("pass another --port"), after the warning for a reachable host."""
    done = run_specrun("rpc-server", "--host", "8.8.8.8", "--port", str(free_port()))
    assert_one_line_error(done.returncode, done.stderr, 2, "cannot listen on 8.8.8.8:",
                          "8.8.8.8 is not an address of this machine; pass 127.0.0.1")


@needs_rpc
def test_rpc_server_takes_an_ipv4_address_only():
    """A name that is not this machine's got the warning for a reachable server first: one line."""
    for host in ("localhost", "bad.example"):
        done = run_specrun("rpc-server", "--host", host, "--port", str(free_port()))
        assert_one_line_error(done.returncode, done.stderr, 2, f"--host {host!r} is not an IPv4 address")


def test_rpc_server_port_out_of_range_is_a_usage_error():
    done = run_specrun("rpc-server", "--port", "0")
    assert_one_line_error(done.returncode, done.stderr, 2, "--port")
