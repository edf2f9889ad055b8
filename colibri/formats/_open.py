"""``open_weights``: the reader for a weight file, chosen from its name and first bytes."""

from __future__ import annotations

import os

from colibri.formats._base import WeightSource, file_size

__all__ = ["open_weights"]


def open_weights(path: str | os.PathLike | WeightSource) -> WeightSource:
    """Open an expert weight file, validating its header before anything is read.

    Parameters
    ----------
    path : path-like or WeightSource
        ``*.safetensors``; ``*.safetensors.index.json`` (sharded); ``*.gguf``; a colibri raw
        data file or its ``*.json`` manifest. A ``WeightSource`` is returned unchanged.

    Raises
    ------
    FormatError
        The file is corrupt, truncated, malicious or holds no routed experts; the message
        names the file and the tensor.
    FileNotFoundError
        ``path`` does not exist.
    """
    if isinstance(path, WeightSource):
        return path
    path = os.fspath(path)
    if not path.endswith(".json") and os.path.exists(path + ".json"):
        from colibri.formats.raw import open_raw

        return open_raw(path)  # its data may be <path>.alt: the manifest names it
    file_size(path)  # FileNotFoundError naming the path
    if path.endswith(".index.json"):
        from colibri.formats.safetensors import open_sharded

        return open_sharded(path)
    if path.endswith(".json"):
        from colibri.formats.raw import open_raw

        return open_raw(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from colibri.formats.gguf import open_gguf

        return open_gguf(path)
    from colibri.formats.safetensors import open_safetensors

    return open_safetensors(path)
