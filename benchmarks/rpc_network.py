"""Speculation with the target on an RPC server (`--rpc`): does it pay more across a network?

One `specrun rpc-server` runs on 127.0.0.1 for the whole run. Lines, each `specrun generate
--json` in a fresh process, in a rotating order per prompt (the machine's drift lands on all):

- plain / METHOD here: the target on this machine;
- plain / METHOD over rpc: the target's layers on the server, reached through a relay that holds
  every chunk of bytes ``--delay-ms`` in each direction (0: loopback as it is). A verify pass
  takes several round trips (graph, inputs, logits), so the delay stands for a network's.

Speeds are the engine's tokens per second after prefill (loading over the relay is not timed).
Ratios per prompt, geometric mean over prompts: METHOD over plain on each side.

    .venv/bin/python benchmarks/rpc_network.py --target smollm2-135m-f16 --draft smollm2-135m --prompts 8 \\
        --delay-ms 1 --json runs/rpc_network.json
    .venv/bin/python benchmarks/rpc_network.py --prompts 1 -n 16     # does it run (demo pair)
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import SPEC_BENCH, geometric_mean_interval, write_report  # noqa: E402
from serve_vs_generate import prompts_for  # noqa: E402

SPECRUN = [sys.executable, "-m", "specrun"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(port: int, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listens on port {port}")


class DelayRelay:
    """A TCP relay on 127.0.0.1 to ``target_port`` that holds every chunk ``delay`` seconds."""

    def __init__(self, target_port: int, delay: float) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port, self.delay = target_port, delay
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, server), (server, client)):
                a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(1 << 20):
                if self.delay:
                    time.sleep(self.delay)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def generate(model_args: list[str], prompt: str, max_tokens: int) -> dict:
    done = subprocess.run([*SPECRUN, "generate", "--json", "-n", str(max_tokens), *model_args, "-"], input=prompt,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"specrun generate failed: {done.stderr.strip()}")
    result = json.loads(done.stdout)
    return {"text": result["text"], "tps": result["stats"]["tokens_per_second"],
            "tokens_per_step": result["stats"]["mean_tokens_per_step"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--draft", help="draft model (default: the registry's suggestion)")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("-n", type=int, default=128, help="new tokens (default 128)")
    parser.add_argument("--threads", type=int, default=1, help="threads here and on the server (default 1)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="held per chunk, each direction (default 0)")
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH)
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args(argv)

    port = free_port()
    server = subprocess.Popen([*SPECRUN, "rpc-server", "--port", str(port), "--threads", str(args.threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(port)
        relay = DelayRelay(port, args.delay_ms / 1000)
        common = ["--target", args.target, "--threads", str(args.threads)]
        common += ["--draft", args.draft] if args.draft else []
        lines = {
            "plain here": [*common, "--method", "none"],
            f"{args.method} here": [*common, "--method", args.method],
            "plain over rpc": [*common, "--method", "none", "--rpc", f"127.0.0.1:{relay.port}"],
            f"{args.method} over rpc": [*common, "--method", args.method, "--rpc", f"127.0.0.1:{relay.port}"],
        }
        prompts, chat = prompts_for(args.target, args.prompts, args.questions)
        rows = []
        for index, prompt in enumerate(prompts):
            names = list(lines)
            order = names[index % len(names):] + names[:index % len(names)]
            row = {name: generate(lines[name], prompt, args.n) for name in order}
            rows.append(row)
            print(f"prompt {index + 1}/{len(prompts)}: " + ", ".join(
                f"{name} {row[name]['tps']:.1f} tok/s" for name in names), file=sys.stderr)
    finally:
        server.kill()
        server.wait()

    summary = {}
    for side in ("here", "over rpc"):
        ratios = [row[f"{args.method} {side}"]["tps"] / row[f"plain {side}"]["tps"] for row in rows]
        summary[side] = geometric_mean_interval(ratios)
    network = geometric_mean_interval([row["plain over rpc"]["tps"] / row["plain here"]["tps"] for row in rows])
    for side, (mean, low, high) in summary.items():
        print(f"{args.method} / plain {side}: {mean:.3f}x (90% {low:.3f}-{high:.3f})")
    print(f"plain over rpc / plain here: {network[0]:.3f}x; relay delay {args.delay_ms:g} ms a chunk each way, "
          f"{args.target}, {len(rows)} prompts, {args.n} tokens, {args.threads} thread(s)")
    write_report(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                             "summary": {k: list(v) for k, v in summary.items()}, "rpc_vs_here": list(network)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
