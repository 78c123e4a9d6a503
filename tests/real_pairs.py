"""Real-model pairs opened as the CLI opens them, shared by the real-model test modules."""

from __future__ import annotations

from pathlib import Path


def open_exact_pair(target: Path, draft: Path, tree_paths: int = 0):
    """A target and draft on llama.cpp under --exact (flash attention off, an F32 cache), the target
    opened for trees of ``tree_paths`` paths as `generate --branches` opens it."""
    import dataclasses

    from specrun.registry.loading import LoadOptions, open_backend

    options = LoadOptions(backend="llama", n_ctx=1024, exact=True)
    opened = open_backend(str(target), dataclasses.replace(options, tree_paths=tree_paths))
    assert opened.tree_support.available == bool(tree_paths)
    return opened, open_backend(str(draft), options)
