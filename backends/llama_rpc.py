"""llama.cpp's RPC backend: a target whose layers run on other machines (``--rpc``), and the
server those machines run (``specrun rpc-server``).

llama.cpp splits a model's layers over RPC servers (its ``rpc-server`` program, which serves a
machine's devices over TCP). specrun sends only the target there: the draft model and every
drafter stay on this machine, so each speculative step crosses the network once, for the
target's verify pass, which is where speculation pays most.

Two things llama.cpp's client does not do gently, and what this module does about them:

- It aborts the whole process when a server cannot be reached, answers another protocol
  version, or is not an RPC server at all. Each server is therefore first asked for its
  devices by llama.cpp's own client in a child process (``probe``): a bad endpoint costs the
  user one line, not their process.
- ``ggml_backend_rpc_add_server`` only describes a server's devices; registering them
  globally (as llama.cpp's tools do) would offload the draft model there too. They are
  handed to the target alone, through ``llama_model_params.devices``.

``serve`` starts the same server code llama.cpp's ``rpc-server`` runs
(``ggml_backend_rpc_start_server``), from the library llama-cpp-python installed, so a
machine with specrun needs no llama.cpp build of its own to lend its devices.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from specrun.errors import BackendUnavailableError, RemoteServerError, UsageError, cannot_listen

DEFAULT_PORT = 50052  # llama.cpp's rpc-server default
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS
PROBE_SECONDS = 30.0  # a server busy with another client answers only when that one leaves
_CPU, _GPU, _IGPU = 0, 1, 2  # enum ggml_backend_dev_type
_ABORT_PLACE = re.compile(r"^\S+\.(c|cpp):\d+: ")  # GGML_ABORT's "file.cpp:547: " before its message

REBUILD_FIX = (
    "reinstall llama-cpp-python with RPC support: CMAKE_ARGS=-DGGML_RPC=ON pip install --force-reinstall "
    "--no-cache-dir llama-cpp-python (specrun's `make install` does this)"
)


@dataclass(frozen=True)
class RpcDevice:
    """One device an RPC server lends: its llama.cpp name (RPC0, RPC1, …) and memory in bytes."""

    endpoint: str
    name: str
    free: int
    total: int


def parse_endpoints(text: str) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT…]`` as a tuple of endpoints; a usage error names the bad one.

    llama.cpp splits an endpoint at its first colon, so a host cannot hold one (IPv6
    addresses are not accepted; use a host name)."""
    endpoints = tuple(part.strip() for part in text.split(","))
    if not text.strip() or not all(endpoints):
        raise UsageError(f"--rpc {text!r} names no server", "pass HOST:PORT, several separated by commas")
    for endpoint in endpoints:
        host, colon, port = endpoint.partition(":")
        if not colon or not host or ":" in port or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UsageError(
                f"--rpc server {endpoint!r} is not HOST:PORT (a port from 1 to 65535)",
                f"pass e.g. 192.168.1.10:{DEFAULT_PORT}",
            )
    if len(set(endpoints)) != len(endpoints):
        raise UsageError(f"--rpc names a server twice: {text}", "name each server once")
    if len(endpoints) > MAX_SERVERS:
        raise UsageError(f"--rpc names {len(endpoints)} servers; llama.cpp takes at most {MAX_SERVERS}",
                         f"pass {MAX_SERVERS} servers or fewer")
    return endpoints


class _Ggml:
    """The few ggml-backend calls RPC needs, from the ggml library llama-cpp-python loads.
    ``rpc`` False: the device calls only (``local_accelerators``), on any build."""

    def __init__(self, llama_cpp, rpc: bool = True) -> None:
        from llama_cpp import _ggml  # the library llama-cpp-python itself loaded

        lib = self.lib = _ggml.libggml
        void_p, size_t, char_p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        for name, args, result in (
            ("ggml_backend_reg_by_name", [char_p], void_p),
            ("ggml_backend_reg_get_proc_address", [void_p, char_p], void_p),
            ("ggml_backend_reg_dev_count", [void_p], size_t),
            ("ggml_backend_reg_dev_get", [void_p, size_t], void_p),
            ("ggml_backend_reg_name", [void_p], char_p),
            ("ggml_backend_dev_count", [], size_t),
            ("ggml_backend_dev_get", [size_t], void_p),
            ("ggml_backend_dev_type", [void_p], ctypes.c_int),
            ("ggml_backend_dev_backend_reg", [void_p], void_p),
            ("ggml_backend_dev_name", [void_p], char_p),
            ("ggml_backend_dev_description", [void_p], char_p),
            ("ggml_backend_dev_memory", [void_p, ctypes.POINTER(size_t), ctypes.POINTER(size_t)], None),
        ):
            function = getattr(lib, name)
            function.argtypes, function.restype = args, result
        if not rpc:
            return
        if not llama_cpp.llama_supports_rpc():  # also loads ggml's backends
            raise BackendUnavailableError("this llama-cpp-python was built without llama.cpp's RPC backend",
                                          REBUILD_FIX)
        self.rpc_reg = lib.ggml_backend_reg_by_name(b"RPC")
        if not self.rpc_reg:
            raise BackendUnavailableError("llama.cpp's RPC backend is not registered", REBUILD_FIX)

    def rpc_function(self, name: str, prototype):
        address = self.lib.ggml_backend_reg_get_proc_address(self.rpc_reg, name.encode())
        if not address:
            raise BackendUnavailableError(f"llama.cpp's RPC backend has no {name}", REBUILD_FIX)
        return prototype(address)

    def memory(self, device: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.lib.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def server_devices(self, endpoint: str) -> list[int]:
        """The devices of one server; llama.cpp aborts if it cannot be reached (probe first)."""
        add_server = self.rpc_function("ggml_backend_rpc_add_server",
                                       ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p))
        reg = add_server(endpoint.encode())
        if not reg:
            return []
        return [self.lib.ggml_backend_reg_dev_get(reg, i) for i in range(self.lib.ggml_backend_reg_dev_count(reg))]

    def local_accelerators(self) -> list[int]:
        """This machine's GPUs (integrated ones where there is no discrete one), as llama.cpp
        chooses them by default; the CPU is not a device a layer is offloaded to."""
        lib = self.lib
        devices = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
        local = [d for d in devices if lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(d)) != b"RPC"]
        gpus = [d for d in local if lib.ggml_backend_dev_type(d) == _GPU]
        return gpus or [d for d in local if lib.ggml_backend_dev_type(d) == _IGPU]


def probe(endpoint: str, timeout: float = PROBE_SECONDS) -> list[RpcDevice]:
    """Ask the server at ``endpoint`` for its devices, with llama.cpp's own client in a child
    process (llama.cpp aborts the process it runs in when a server is unreachable or speaks
    another protocol version). A server that cannot be used is one RemoteServerError."""
    _check_reachable(endpoint)
    environment = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    command = [sys.executable, "-m", "specrun.backends.llama_rpc", "probe", endpoint]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
    except subprocess.TimeoutExpired:
        raise RemoteServerError(
            f"the RPC server at {endpoint} did not answer within {timeout:.0f} s",
            "it may be serving another client (llama.cpp's server takes one at a time): wait, or start another",
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        reason = _ABORT_PLACE.sub("", said[-1]) if said else f"exit {done.returncode}"
        if done.returncode == 3:  # the child's BackendUnavailableError: this install has no RPC
            raise BackendUnavailableError(reason, REBUILD_FIX)
        raise RemoteServerError(
            f"the server at {endpoint} is not a usable llama.cpp RPC server ({reason})",
            "start `specrun rpc-server` (or llama.cpp's rpc-server of the same llama.cpp version) there",
        )
    devices = [RpcDevice(endpoint, d["name"], d["free"], d["total"]) for d in json.loads(lines[-1])["devices"]]
    if not devices:
        raise RemoteServerError(f"the RPC server at {endpoint} lends no device", "start it with a device to lend")
    return devices


def _check_reachable(endpoint: str) -> None:
    host, _, port = endpoint.partition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except (socket.gaierror, UnicodeError):  # UnicodeError: a name with an empty or too long label (bad..x)
        raise RemoteServerError(f"--rpc host {host!r} is unknown", "check the name, or pass its address") from None
    except OSError as exc:
        raise RemoteServerError(
            f"cannot reach an RPC server at {endpoint} ({exc.strerror or exc})",
            f"start one there: specrun rpc-server --host HOST --port {port} (or llama.cpp's rpc-server)",
        ) from None


def _check_distinct(endpoints: tuple[str, ...]) -> None:
    """Two names of one server (127.0.0.1:P and localhost:P) would hang the load: llama.cpp's
    server answers one client at a time, and its client waits without a timeout."""
    seen: dict[tuple[str, str], str] = {}
    for endpoint in endpoints:
        host, _, port = endpoint.partition(":")
        try:
            address = socket.gethostbyname(host)  # IPv4, as llama.cpp's client resolves it
        except (OSError, UnicodeError):  # UnicodeError: a name with an empty or too long label (bad..x)
            raise RemoteServerError(f"--rpc host {host!r} is unknown", "check the name, or pass its address") from None
        if (address, port) in seen:
            raise UsageError(f"--rpc names one server twice: {seen[address, port]} and {endpoint}",
                             "name each server once")
        seen[address, port] = endpoint


def target_devices(llama_cpp, endpoints: tuple[str, ...]):
    """A NULL-terminated device array for ``llama_model_params.devices``: every device of the
    servers at ``endpoints`` (probed first), then this machine's GPUs, as llama.cpp orders
    them. Keep the array alive for as long as the model (llama.cpp reads it while loading)."""
    _check_distinct(endpoints)
    for endpoint in endpoints:
        probe(endpoint)
    if os.environ.get("SPECRUN_DEBUG") != "1":  # a server lost mid-run aborts: one message, not a gdb dump
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    ggml = _Ggml(llama_cpp)
    devices: list[int] = []
    for endpoint in endpoints:
        found = ggml.server_devices(endpoint)
        if not found:
            raise RemoteServerError(f"the RPC server at {endpoint} stopped answering", "check that it still runs")
        devices += found
    devices += ggml.local_accelerators()
    return (ctypes.c_void_p * (len(devices) + 1))(*devices, None)


def serve(host: str, port: int, threads: int, cache_dir: str | None, started=None) -> None:
    """Lend this machine's devices (its GPUs, else its CPU) to specrun or llama.cpp clients
    until Ctrl-C: llama.cpp's own RPC server, run in a thread so that Ctrl-C reaches Python.
    ``started`` (a callable) gets the devices' descriptions once the server is about to listen.
    llama.cpp's server prints its banner and each client to stdout: they go to stderr here."""
    import llama_cpp

    check_listening(host, port)
    ggml = _Ggml(llama_cpp)
    devices = ggml.local_accelerators()
    if not devices:
        cpu = [ggml.lib.ggml_backend_dev_get(i) for i in range(ggml.lib.ggml_backend_dev_count())]
        devices = [d for d in cpu if ggml.lib.ggml_backend_dev_type(d) == _CPU][:1]
    if not devices:
        raise BackendUnavailableError("llama.cpp found no device to lend", "check the llama-cpp-python install")
    start = ggml.rpc_function("ggml_backend_rpc_start_server", ctypes.CFUNCTYPE(
        None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)))
    array = (ctypes.c_void_p * len(devices))(*devices)
    endpoint = f"{host}:{port}".encode()
    cache = cache_dir.encode() if cache_dir else None
    names = [f"{ggml.lib.ggml_backend_dev_name(d).decode()} ({ggml.lib.ggml_backend_dev_description(d).decode()})"
             for d in devices]
    if started is not None:
        started(names)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the C library's stdout: llama.cpp's lines
    def run() -> None:
        # Signals go to the main thread, which waits for them: delivered to this one, blocked in
        # llama.cpp's accept(), a Ctrl-C once ended the process without its last line (CI, once).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        start(endpoint, cache, threads, len(devices), array)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while thread.is_alive():  # the server never returns while it serves; Ctrl-C ends the wait
        thread.join(0.5)
    raise RemoteServerError(f"llama.cpp's RPC server on {host}:{port} stopped (its message is above)",
                            "check the address and that the port is free")


def check_host(host: str) -> None:
    """llama.cpp's server listens on a dotted IPv4 address only."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise UsageError(f"--host {host!r} is not an IPv4 address (llama.cpp's RPC server takes no names)",
                         "pass 127.0.0.1, 0.0.0.0 or one of this machine's addresses") from None


def check_listening(host: str, port: int) -> None:
    """A host llama.cpp's server can listen on (an address of this machine), and the port free there."""
    check_host(host)
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise cannot_listen(host, port, exc, busy=RemoteServerError) from None


_log_callback = None  # kept alive for as long as llama.cpp may call it


def silence_logs(llama_cpp) -> None:
    """Route llama.cpp's own logging to nowhere unless SPECRUN_DEBUG is set."""
    global _log_callback
    if _log_callback is not None or os.environ.get("SPECRUN_DEBUG") == "1":
        return

    @llama_cpp.llama_log_callback
    def _drop(level, text, user_data):  # noqa: ARG001 - ctypes signature
        return None

    _log_callback = _drop
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def _probe_main(endpoint: str) -> int:
    """The child side of ``probe``: print the server's devices as one JSON line."""
    import llama_cpp

    silence_logs(llama_cpp)
    try:
        ggml = _Ggml(llama_cpp)
    except BackendUnavailableError as exc:
        print(exc.problem, file=sys.stderr)
        return 3
    found = []
    for device in ggml.server_devices(endpoint):
        free, total = ggml.memory(device)
        found.append({"name": ggml.lib.ggml_backend_dev_name(device).decode(), "free": free, "total": total})
    print(json.dumps({"devices": found}))
    return 0


if __name__ == "__main__":  # python -m specrun.backends.llama_rpc probe HOST:PORT
    if len(sys.argv) != 3 or sys.argv[1] != "probe":
        sys.exit("usage: python -m specrun.backends.llama_rpc probe HOST:PORT")
    sys.exit(_probe_main(sys.argv[2]))
