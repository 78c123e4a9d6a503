"""What a bench ran on: CPU, cores, GPU, backend and library versions.

Every probe is best-effort and quick: a missing tool or file gives None, never an error.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

LIBRARIES = ("specrun", "llama-cpp-python", "mlx", "mlx-lm", "numpy")
PROBE_TIMEOUT_S = 5


def machine_info(backend: str, threads: int | None) -> dict:
    """The machine facts stored with every bench result."""
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "gpu": gpu_name(),
        "os": platform.platform(),
        "backend": backend,
        "threads": threads,
        "versions": library_versions(),
    }
    if backend == "mlx":
        from specrun.blas import mlx_blas

        info["mlx_blas"] = mlx_blas()  # Linux: "reference" (slow batched passes) or the preloaded BLAS's file
    return info


def library_versions() -> dict[str, str | None]:
    """Installed versions of specrun and the libraries that decide its speed (None: not installed)."""
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return versions


def cpu_model() -> str:
    """The CPU's marketing name, e.g. 'AMD EPYC 7B13' or 'Apple M2 Pro'."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    if platform.system() == "Darwin":
        brand = _command_output(["sysctl", "-n", "machdep.cpu.brand_string"])
        if brand:
            return brand
    return platform.processor() or platform.machine() or "unknown"


def gpu_name() -> str | None:
    """NVIDIA GPUs as nvidia-smi names them, the Apple GPU on Apple Silicon, else None."""
    if shutil.which("nvidia-smi"):
        names = _command_output(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
        if names:
            return "; ".join(line.strip() for line in names.splitlines() if line.strip())
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return f"Apple Silicon GPU (Metal), {cpu_model()}"
    return None


def _command_output(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None
