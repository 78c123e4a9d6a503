"""A target split over two processes on the loopback address by MLX's distributed layer
(backends/mlx_distributed.py, `mlx.launch --backend ring`), the draft local to rank 0: the
greedy text is the one process's, both processes end cleanly, and what a split target cannot
do is one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")

LAUNCH = Path(sys.executable).with_name("mlx.launch")
MAIN = Path(__file__).resolve().parents[2] / "specrun" / "__main__.py"


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free now on the loopback address: each launch's ring
    listens on ports of its own (a port the last launch used may still be held by the system)."""
    import random
    import socket

    while True:
        first = random.randint(20000, 60000)
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(sockets):
                probe.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for probe in sockets:
                probe.close()


def launch_command(ranks: int, *args: str) -> list[str]:
    return [str(LAUNCH), "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)),
            "--python", sys.executable, "--", str(MAIN), *args]


def ranks_of(launcher: int) -> list[int]:
    """The pids of the processes ``launcher`` (an mlx.launch) started: its threads' children (a
    thread a rank starts each)."""
    pids = []
    for children in Path(f"/proc/{launcher}/task").glob("*/children"):
        try:
            pids += [int(pid) for pid in children.read_text().split()]
        except OSError:  # that thread ended meanwhile
            pass
    return pids


def run(*args: str, ranks: int = 0, timeout: int = 240) -> subprocess.CompletedProcess:
    """``specrun ARGS`` in one process, or in ``ranks`` processes mlx.launch starts."""
    env = {**os.environ, "PYTHONPATH": str(MAIN.parents[1])}
    if ranks:
        command = launch_command(ranks, *args)
    else:
        command = [sys.executable, str(MAIN), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)


@pytest.fixture(scope="module")
def pair(tiny_models):
    if not LAUNCH.exists():
        pytest.skip("mlx.launch is not installed beside this Python")
    return str(tiny_models["llama"].hf_dir), str(tiny_models["qwen2"].hf_dir)


@pytest.mark.parametrize("method", ["draft", "lookup"])
def test_a_target_split_over_two_processes_gives_the_text_one_process_gives(pair, method):
    target, draft = pair
    args = ("generate", "import os\nimport sys\n\ndef main(", "--target", target, "--draft", draft,
            "--backend", "mlx", "-n", "32", "--temp", "0", "--method", method, "--json")
    alone = run(*args)
    split = run(*args, ranks=2)
    assert alone.returncode == 0, alone.stderr
    assert split.returncode == 0, split.stderr[-2000:]
    import json

    texts = [json.loads(line)["text"] for line in split.stdout.splitlines() if line.startswith("{")]
    assert texts == [json.loads(alone.stdout.strip().splitlines()[-1])["text"]]  # rank 0 alone prints


def test_a_hybrid_split_by_pipeline_gives_the_text_one_process_gives(pair, tmp_path):
    """Qwen3-Next's mlx-lm code splits by pipeline only (its layers, recurrent ones among them, in
    two runs of layers): the draft model's rejections roll its state back on both processes."""
    import json

    import mlx.core as mx
    from hybrid_models import HybridShape, hybrid_weights, write_qwen35_mlx_folder

    shape = HybridShape(experts=4, next=True)
    folder = write_qwen35_mlx_folder(tmp_path / "qwen3next", shape, hybrid_weights(shape, mtp_layers=1))
    index = {name: path.name for path in folder.glob("*.safetensors") for name in mx.load(str(path))}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    args = ("generate", "def f(x):\n    return x", "--target", str(folder), "--draft", pair[0], "--backend", "mlx",
            "-n", "24", "--temp", "0", "--method", "draft", "--raw", "--json")
    alone, split = run(*args), run(*args, ranks=2)
    assert alone.returncode == 0 and split.returncode == 0, split.stderr[-2000:]
    one = json.loads(alone.stdout.strip().splitlines()[-1])
    texts = [json.loads(line) for line in split.stdout.splitlines() if line.startswith("{")]
    assert [answer["text"] for answer in texts] == [one["text"]]
    assert texts[0]["stats"]["drafted"] > texts[0]["stats"]["accepted"]  # rejected drafts: states rolled back


def test_what_a_split_target_cannot_do_is_one_line(pair, tiny_models):
    target, _ = pair
    done = run("generate", "def f(x):", "--target", target, "--draft", "self:layers=1", "--backend", "mlx",
               "-n", "4", ranks=2)
    assert "rank 0 exited with code 1" in done.stderr  # mlx.launch itself says so, and exits 0
    # the follower ends cleanly when rank 0 closes the target, unless mlx.launch, seeing rank 0 fail
    # first, terminates it (SIGTERM, on a busy machine): never a crash or an error of its own
    assert re.findall(r"rank 1 exited with code (-?\d+)", done.stderr) in ([], ["-15"]), done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors and "split over processes" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    gguf = run("generate", "def f(x):", "--target", str(tiny_models["llama"].gguf_path), "--backend", "llama",
               "-n", "4", ranks=2)
    errors = [line for line in gguf.stderr.splitlines() if line.startswith("error:")]
    # each rank says it (a usage error: exit 2), unless mlx.launch terminates one the other preceded
    assert errors and all("splits MLX targets only" in line for line in errors), gguf.stderr[-2000:]
    assert set(re.findall(r"rank \d exited with code (-?\d+)", gguf.stderr)) <= {"2", "-15"}, gguf.stderr[-2000:]


def test_a_server_on_a_split_target_answers_as_one_process_and_ends_with_ctrl_c(pair):
    """Rank 0 serves, rank 1 holds half the target and no port; Ctrl-C to the ranks (a terminal's
    reaches every process) ends them, and mlx.launch with them. (Not to mlx.launch itself: its main
    thread, interrupted inside one of its output queues' locks, can leave a reader thread waiting on
    that lock for good, a hang of mlx.launch's own, seen here once in ~30 runs on a busy machine.)"""
    import json
    import signal
    import socket
    import time
    import urllib.request

    target, draft = pair
    alone = run("generate", "def f(x):", "--target", target, "--draft", draft, "--backend", "mlx", "-n", "8",
                "--temp", "0", "--raw", "--json")  # a completion, as the server's /v1/completions
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(MAIN.parents[1])}
    launch = subprocess.Popen(launch_command(2, "serve", "--target", target, "--draft", draft, "--backend", "mlx",
                                             "--port", str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True)
    try:
        body = json.dumps({"model": target, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}).encode()
        deadline = time.monotonic() + 120
        while True:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    answer = json.loads(response.read())
                break
            except OSError:
                assert time.monotonic() < deadline and launch.poll() is None, "the split server did not start"
                time.sleep(1)
        assert answer["choices"][0]["text"] == json.loads(alone.stdout.strip().splitlines()[-1])["text"]
    finally:
        ranks = ranks_of(launch.pid)
        for rank in ranks:
            os.kill(rank, signal.SIGINT)
        try:
            launch.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            printed = launch.communicate()[0]
            raise AssertionError(f"the split server did not end on Ctrl-C:\n{printed[-3000:]}") from None
    assert len(ranks) == 2, ranks  # the ranks themselves were told (mlx.launch runs each as its own process)
