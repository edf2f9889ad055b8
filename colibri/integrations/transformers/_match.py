"""Matching a transformers module class to a router kind of the catalogue, by its code."""

from __future__ import annotations

import inspect

from colibri.integrations.transformers._families import (
    _KINDS,
    _UNSUPPORTED,
    CHECKED_VERSION,
    _fingerprint,
    _Kind,
)


def _family(cls: type) -> str:
    parts = cls.__module__.split(".")
    if len(parts) >= 3 and parts[0] == "transformers" and parts[1] == "models":
        return parts[2]
    return cls.__module__


def _method_fingerprint(cls: type, method: str) -> str | None:
    func = getattr(cls, method, None)
    if func is None or not callable(func):
        return None
    try:
        return _fingerprint(func)
    except (OSError, TypeError):
        return None


_BY_FINGERPRINT: dict[tuple[str, str], _Kind] = {
    (kind.method, fp): kind for kind in _KINDS for fp in kind.fingerprints
}
_METHODS = tuple(dict.fromkeys(kind.method for kind in _KINDS))


def _classify(cls: type) -> tuple[_Kind | None, str | None]:
    """(kind, None) for a supported router class, (None, reason) for an unsupported one,
    (None, None) for anything else."""
    if not cls.__module__.startswith("transformers.models."):
        return None, None
    for method in _METHODS:
        fp = _method_fingerprint(cls, method)
        if fp is None:
            continue
        kind = _BY_FINGERPRINT.get((method, fp))
        if kind is not None:
            return kind, None
        if fp in _UNSUPPORTED:
            return None, _UNSUPPORTED[fp]
    if _looks_like_router(cls):
        import transformers

        return None, (
            "its routing code is not one colibri was checked against (colibri maps the "
            f"routers of transformers {CHECKED_VERSION}; this is transformers "
            f"{transformers.__version__}, whose router may have changed)"
        )
    return None, None


def _looks_like_router(cls: type) -> bool:
    name = cls.__name__
    if not any(word in name for word in ("Router", "TopK", "Topk", "Gating", "MoEV1Gate")):
        return False
    func = getattr(cls, "forward", None)
    try:
        source = inspect.getsource(func) if func is not None else ""
    except (OSError, TypeError):
        return False
    return "topk" in source or "top_k" in source
