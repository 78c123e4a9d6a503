"""LoRA adapters an MLX draft model learns online (training/online_draft.py's DraftLearner).

The trainer works on a copy of the draft model (its arrays shared: MLX arrays never change in
place) with mlx-lm's LoRA layers on every linear map of every block, the base weights frozen, so
the drafting model and the trainer never touch the same module. Its steps run on a stream of the
thread that calls them (MLX's streams belong to one thread each: the worker's own, beside the
drafting thread's). What it publishes for a float map is the map fused with its adapter (mlx-lm's
``fuse``), so the drafting model keeps its own layers and costs what it always did: LoRA layers
left in it cost demo-draft 17% more a pass on this CPU (4.5 → 5.3 ms). A quantized map is not
fused: quantizing it again would move a 4-bit map by up to a step where the adapter is zero, and
keep little of an adapter smaller than half a step; the drafting model takes LoRA layers over those
maps instead, the first time, and each later copy swaps their small arrays. The fusing is the
worker's, within its budget; a swap is an assignment of arrays.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence

import numpy as np

from .mlx import _import_mlx
from .mlx_common import MODEL_CALLS

RANK = 8  # mlx-lm's own defaults for LoRA fine-tuning
SCALE = 20.0
CLIP_NORM = 1.0


def add_adapters(model, seed: int = 0) -> None:
    """mlx-lm's LoRA layers on every linear map of every block of ``model`` (the trainer's copy),
    their B zero: the model computes what it did until they are trained. Their A is drawn as
    mlx-lm draws it, from ``seed``."""
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx, _, _ = _import_mlx()
    linear_to_lora_layers(model, len(model.layers), {"rank": RANK, "scale": SCALE, "dropout": 0.0})
    key = mx.random.key(seed)
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            key, draw = mx.random.split(key)
            bound = 1.0 / float(np.sqrt(module.lora_a.shape[0]))
            module.lora_a = mx.random.uniform(-bound, bound, module.lora_a.shape, key=draw)
    mx.eval(model.parameters())


class LoraTrainer:
    """Adapters on a copy of ``model``, trained with AdamW on the cross-entropy of a window's
    labelled positions against the target's choices there (its token, or its distribution over a
    few tokens: soft labels), gradients clipped to CLIP_NORM."""

    def __init__(self, model, learning_rate: float, seed: int = 0) -> None:
        import mlx.nn as nn
        import mlx.optimizers as optim

        self._mx, _, _ = _import_mlx()
        with MODEL_CALLS:  # never mid packed pass, whose RoPE modules the copy would keep
            self.model = copy.deepcopy(model)  # the modules copied; the arrays, which never change in place, shared
        self.model.freeze()
        add_adapters(self.model, seed)
        # Every array the copy holds evaluated here, private ones too (Llama 3's RoPE frequencies):
        # an array left lazy on this thread's stream fails when the worker's thread evaluates it.
        self._mx.eval([value for _, module in self.model.named_modules() for value in module.values()
                       if isinstance(value, self._mx.array)])
        self._optimizer = optim.AdamW(learning_rate=learning_rate, weight_decay=0.0)
        self._loss_and_grad = nn.value_and_grad(self.model, self._loss)
        self._streams = threading.local()

    def _stream(self):
        """This thread's own stream on the default device."""
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = self._mx.new_stream(self._mx.default_device())
        return stream

    def predict(self, tokens: np.ndarray) -> np.ndarray:
        """(L - 1,) the adapted model's greedy guess of tokens[i + 1] at each position i."""
        mx = self._mx
        with mx.stream(self._stream()):
            ids = mx.argmax(self.model(mx.array(np.asarray(tokens, np.int64)[None, :-1])), axis=-1)[0]
            return np.array(ids, dtype=np.int64)

    def _loss(self, model, inputs, ids, weights, mask):
        """The mean over the labelled positions of -sum_k weights[k] log q(ids[k]): a token's
        cross-entropy where one id weighs 1, a soft label's where they are a distribution."""
        mx = self._mx
        logits = model(inputs).astype(mx.float32)
        log_q = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        inside = ids < logits.shape[-1]  # ids past the model's output (a tokenizer larger than it) weigh 0
        picked = mx.take_along_axis(log_q, mx.where(inside, ids, 0), axis=-1)
        losses = -(picked * mx.where(inside, weights, 0.0)).sum(axis=-1)
        return (losses * mask).sum() / mask.sum()

    def step(self, windows: Sequence[tuple]) -> float:
        """One step on ``windows``: each (tokens, first) or (tokens, first, soft), positions first ..
        end labelled (first >= 1) with their tokens or, where ``soft`` is given, its labels ((ids,
        probabilities), each (end - first + 1, K): training/online_draft.py's TokenWindow.soft)."""
        import mlx.optimizers as optim

        mx = self._mx
        windows = [(tokens, first, rest[0] if rest else None) for tokens, first, *rest in windows]
        longest = max(len(tokens) for tokens, _, _ in windows)
        width = max((soft[0].shape[1] for _, _, soft in windows if soft is not None), default=1)
        batch = np.zeros((len(windows), longest), np.int64)
        ids = np.zeros((len(windows), longest - 1, width), np.int64)
        weights = np.zeros((len(windows), longest - 1, width), np.float32)
        mask = np.zeros((len(windows), longest - 1), np.float32)
        for row, (tokens, first, soft) in enumerate(windows):
            batch[row, : len(tokens)] = tokens
            ids[row, : len(tokens) - 1, 0] = tokens[1:]  # the guess at i is of token i + 1
            weights[row, : len(tokens) - 1, 0] = 1.0
            if soft is not None:
                labelled = slice(first - 1, len(tokens) - 1)
                ids[row, labelled], weights[row, labelled] = 0, 0.0
                ids[row, labelled, : soft[0].shape[1]], weights[row, labelled, : soft[1].shape[1]] = soft
            mask[row, first - 1 : len(tokens) - 1] = 1.0
        with mx.stream(self._stream()):
            loss, grads = self._loss_and_grad(self.model, mx.array(batch[:, :-1]), mx.array(ids), mx.array(weights),
                                              mx.array(mask))
            grads, _ = optim.clip_grad_norm(grads, CLIP_NORM)
            self._optimizer.update(self.model, grads)
            mx.eval(self.model.parameters(), self._optimizer.state, loss)
            return float(loss.item())

    def weights(self) -> dict:
        """What the drafting model takes (``load_published``), keyed as it names its parameters:
        a float map fused with its adapter (``…q_proj.weight``), a quantized map's adapter as it
        is (``…q_proj.lora_a``, ``lora_b``). Evaluated: safe to read from any thread."""
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.tuner.lora import LoRALinear

        mx = self._mx
        published = {}
        with mx.stream(self._stream()):
            for path, module in self.model.named_modules():
                if not isinstance(module, LoRALinear):
                    continue
                if isinstance(module.linear, nn.QuantizedLinear):
                    published[f"{path}.lora_a"], published[f"{path}.lora_b"] = module.lora_a, module.lora_b
                else:
                    published.update((f"{path}.{name}", array) for name, array in tree_flatten(module.fuse().parameters()))
            mx.eval(list(published.values()))
        return published


    def adapter_arrays(self) -> dict[str, np.ndarray]:
        """The adapters as they stand, every LoRA layer's ``lora_a`` and ``lora_b`` (float32) by
        path: what ``--keep-learned`` writes, and ``load_adapter_arrays`` takes back."""
        from mlx_lm.tuner.lora import LoRALinear

        mx = self._mx
        arrays = {}
        with mx.stream(self._stream()):
            for path, module in self.model.named_modules():
                if isinstance(module, LoRALinear):
                    for name in ("lora_a", "lora_b"):
                        arrays[f"{path}.{name}"] = np.array(getattr(module, name).astype(mx.float32))
        return arrays

    def load_adapter_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Adapters an earlier run kept (``adapter_arrays``) put back on the trainer's copy; the
        drafting model takes them with the next ``weights``. ValueError naming what does not fit
        (another model's adapters, another rank), nothing changed then."""
        from mlx_lm.tuner.lora import LoRALinear

        mx = self._mx
        wanted = {f"{path}.{name}": getattr(module, name).shape for path, module in self.model.named_modules()
                  if isinstance(module, LoRALinear) for name in ("lora_a", "lora_b")}
        missing, extra = sorted(wanted.keys() - arrays.keys()), sorted(arrays.keys() - wanted.keys())
        if missing or extra:
            raise ValueError(f"they are another model's: {len(missing)} adapters missing, {len(extra)} unknown "
                             f"({(missing or extra)[0]})")
        for name, shape in wanted.items():
            array = arrays[name]
            if tuple(array.shape) != tuple(shape) or not np.isfinite(array).all():
                raise ValueError(f"{name} is {array.shape} where {tuple(shape)} of finite numbers was expected")
        modules = dict(self.model.named_modules())
        with mx.stream(self._stream()):
            for name, array in arrays.items():
                path, which = name.rsplit(".", 1)
                dtype = getattr(modules[path], which).dtype
                setattr(modules[path], which, mx.array(np.asarray(array, np.float32)).astype(dtype))
            mx.eval(self.model.parameters())


def load_published(model, weights: dict) -> None:
    """``weights`` (LoraTrainer.weights) into the drafting ``model``: fused float maps assigned,
    LoRA layers put over quantized maps the first time their adapters come."""
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear

    adapted = {name.rsplit(".", 1)[0] for name in weights if name.endswith((".lora_a", ".lora_b"))}
    if adapted:
        modules = dict(model.named_modules())
        wrapped = [(path, LoRALinear.from_base(modules[path], r=RANK, scale=SCALE)) for path in sorted(adapted)
                   if not isinstance(modules[path], LoRALinear)]
        if wrapped:
            model.update_modules(tree_unflatten(wrapped))
    model.update(tree_unflatten(list(weights.items())))
