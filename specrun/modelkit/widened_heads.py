"""Heads for the builtin targets widened with zeros, derived from those their originals ship with.

demo-target-xl is the demo target widened (modelkit/demo.py), smollm2-135m-x2 SmolLM2's F16 copy
(modelkit/smollm2.py): each computes its original's function, its states the original's with
zeros after them. Heads of every kind the original ships (specrun/demo/) are widened on first
use (heads.kinds' ``widen``: the same drafts) into specrun's cache as a folder: EAGLE-3's as
SpecForge's layout, the others holding specrun's own pair, KIND.safetensors and KIND.json.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specrun.errors import ModelFileError
from specrun.modelkit.demo import XL_WIDEN_FACTOR, demo_gguf, derive_once, derived_path
from specrun.modelkit.smollm2 import WIDENED, smollm2_gguf


def _widened_builtins() -> dict[str, tuple[str, Callable[[], Path], Callable[[int], int]]]:
    """builtin -> (the builtin it widens, that one's GGUF, the width of a state the original's
    is ``H`` wide)."""
    builtins = {
        "demo-target-xl": ("demo-target", lambda: demo_gguf("demo-target"), lambda size: XL_WIDEN_FACTOR * size),
    }
    for name, (base, hidden, _) in WIDENED.items():
        builtins[name] = (base, lambda base=base: smollm2_gguf(base), lambda size, hidden=hidden: hidden)
    return builtins


def widened_original(builtin: str) -> str | None:
    """The builtin ``builtin`` widens with zeros, or None."""
    found = _widened_builtins().get(builtin)
    return None if found is None else found[0]


def widened_heads(shipped: Path, builtin: str, kind: str) -> Path:
    """``kind`` heads for ``builtin`` (a widened builtin) derived from ``shipped``, its original's
    shipped heads (a file of specrun's pair or an EAGLE-3 folder), on first use."""
    # what the copy is keyed by: specrun's .json names its tensors' SHA-256 beside its layout and
    # training record, so it covers the pair; a folder's weights
    source = shipped / "model.safetensors" if shipped.is_dir() else shipped.with_suffix(".json")
    if not source.is_file():  # the install is damaged: another kind may still serve (registry.heads)
        raise ModelFileError(f"specrun's shipped heads {shipped.name} lack {source.name}",
                             "reinstall specrun")
    target = derived_path(source, f"{builtin}.{kind}")
    return derive_once(target, lambda folder: _write_widened(shipped, folder, builtin))


def _write_widened(shipped: Path, folder: Path, builtin: str) -> None:
    from specrun.heads.files import load_heads, save_heads
    from specrun.heads.kinds import kind_of
    from specrun.modelkit.gguf_io import read_gguf_tensor

    _, original_gguf, width = _widened_builtins()[builtin]
    heads = load_heads(shipped)
    kind = kind_of(heads)
    # the rows the heads were trained beside, for heads that embed with the target's own
    embedding = read_gguf_tensor(original_gguf(), "token_embd.weight") if kind.embeds == "target" else None
    widened = kind.widen(heads, width(heads.config.hidden_size), builtin, embedding)
    if kind.stored == "folder":
        save_heads(widened, folder)
        return
    folder.mkdir()
    save_heads(widened, folder / f"{kind.name}.safetensors")
