"""`specrun rpc-server`: lend this machine's devices to a target run elsewhere with --rpc."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from specrun.cli.common import check_range, cli_errors
from specrun.cli.options import RpcServerHostOpt, RpcServerPortOpt, ThreadsOpt
from specrun.errors import FileAccessError


def rpc_server_command(
    host: RpcServerHostOpt = "127.0.0.1",
    port: RpcServerPortOpt = 50052,
    threads: ThreadsOpt = None,
    cache: Annotated[
        bool, typer.Option("--cache", help="Keep large tensors on disk (specrun's cache, rpc/), so that loading the "
                           "same model again sends less over the network.")
    ] = False,
) -> None:
    """Serve this machine's devices (its GPUs, else its CPU) to llama.cpp clients until Ctrl-C.

    Run it on each machine that holds part of a target, then on the main machine:
    specrun generate --target MODEL --draft DRAFT --rpc HOST:PORT[,HOST:PORT]. The server is
    llama.cpp's own (the one its rpc-server program runs, from the library llama-cpp-python
    installed), so clients of the same llama.cpp version can use it too."""
    with cli_errors():
        from specrun.backends.llama import default_threads
        from specrun.backends.llama_rpc import check_listening, serve
        from specrun.modelkit.demo import cache_dir
        from specrun.server.app import is_loopback

        check_range("--port", port, 1, 65535)
        check_range("--threads", threads, 1, 1024)
        check_listening(host, port)  # a bad address or a taken port is refused before the warning about a good one
        if not is_loopback(host):
            typer.echo(f"warning: --host {host} lets anyone who can reach this machine run code on its devices and "
                       "read what they hold; llama.cpp's RPC protocol has no authentication. Use it on a trusted "
                       "network only", err=True)
        folder = None
        if cache:
            folder = cache_dir() / "rpc"
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # a file where the folder goes was an internal error (FileExistsError)
                fix = (f"remove the file {folder}, or run without --cache" if folder.is_file() else
                       "set SPECRUN_CACHE to a folder you can write, or run without --cache")
                raise FileAccessError(f"cannot keep the RPC cache in {folder}: {exc.strerror or exc}", fix) from None

        def started(devices: list[str]) -> None:
            typer.echo(f"specrun rpc-server: lending {', '.join(devices)} on {host}:{port}; Ctrl-C stops it", err=True)
            sys.stderr.flush()

        try:
            serve(host, port, threads or default_threads(), str(folder) if folder else None, started=started)
        except KeyboardInterrupt:
            typer.echo("specrun rpc-server: stopped", err=True)
