"""AdamW over named NumPy arrays (the EAGLE, EAGLE-3 and Hydra trainers'; Medusa's keeps its
own per head), its state on disk, and NumPy's BLAS threads while a trainer steps."""

from __future__ import annotations

import io
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from specrun.blas import openblas_threads
from specrun.fileio import write_atomically


BETAS = (0.9, 0.999)


EPS = 1e-8


WEIGHT_DECAY = 0.01  # AdamW's default, as mlx.optimizers.AdamW uses


@contextmanager
def blas_threads(count: int):
    """NumPy's OpenBLAS on ``count`` threads meanwhile, then on as many as before. specrun keeps
    it on one (specrun/__init__.py: its threads spin beside llama.cpp's between passes); a
    trainer's long matrix products run ~1.85x faster on two cores with two (a projection over
    4,096 draft tokens). A no-op where NumPy's BLAS is not OpenBLAS."""
    found = openblas_threads()
    if found is None or count <= 1:
        yield
        return
    setter, getter = found
    before = int(getter())
    setter(int(count))
    try:
        yield
    finally:
        setter(before)


def write_optimizer_state(path: Path, moments: dict[str, np.ndarray], step: int) -> None:
    """An optimizer's named moments and its step count as one .npz, written atomically."""
    buffer = io.BytesIO()
    np.savez(buffer, **moments, step=np.array(step))
    write_atomically(Path(path), buffer.getvalue(), "optimizer state")


class NamedAdamW:
    """AdamW over named float32 arrays (``params``, with ``first`` and ``second`` moments alike,
    ``learning_rate`` and ``step_count``), and its state saved and loaded: the trainers of EAGLE
    and Hydra heads (training/eagle.py, training/hydra.py) keep their arrays so."""

    params: dict[str, np.ndarray]
    first: dict[str, np.ndarray]
    second: dict[str, np.ndarray]
    learning_rate: float
    step_count: int

    frozen: frozenset[str] = frozenset()  # names of arrays apply leaves as they are

    def freeze_projections(self) -> None:
        """Train all but the projections over the draft vocabulary (``*lm_head``): most of a step's
        memory traffic is their AdamW update, and online learning has a budget."""
        self.frozen = frozenset(name for name in self.params if name.endswith("lm_head"))
        for name in self.frozen:  # no moments for what never moves
            self.first[name] = self.second[name] = np.zeros(0, np.float32)

    def copies(self) -> dict[str, np.ndarray]:
        """The arrays for published heads: copies, but frozen ones shared (never written)."""
        return {name: array if name in self.frozen else array.copy() for name, array in self.params.items()}

    def start_moments(self) -> None:
        self.first = {name: np.zeros_like(array) for name, array in self.params.items()}
        self.second = {name: np.zeros_like(array) for name, array in self.params.items()}
        self.step_count = 0

    def apply(self, grads: dict[str, np.ndarray]) -> None:
        """One step with the gradient of every array (by name); no decay on norms and biases."""
        self.step_count += 1
        beta1, beta2 = BETAS
        t = self.step_count
        rate = self.learning_rate * np.sqrt(1 - beta2**t) / (1 - beta1**t)
        for name, p in self.params.items():
            if name in self.frozen:
                continue
            g, m, v = grads[name], self.first[name], self.second[name]
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            if p.ndim > 1:
                p *= 1 - self.learning_rate * WEIGHT_DECAY
            p -= rate * m / (np.sqrt(v) + EPS)

    @property
    def steps_taken(self) -> int:
        return self.step_count

    def save_optimizer(self, path: Path) -> None:
        """The moments and the step count (.npz), written atomically."""
        arrays = {f"{kind}.{name}": array for kind, moments in (("m", self.first), ("v", self.second))
                  for name, array in moments.items()}
        write_optimizer_state(path, arrays, self.step_count)

    def load_optimizer(self, path: Path) -> None:
        with np.load(path) as saved:
            for kind, moments in (("m", self.first), ("v", self.second)):
                for name in moments:
                    moments[name] = saved[f"{kind}.{name}"].astype(np.float32)
            self.step_count = int(saved["step"])
