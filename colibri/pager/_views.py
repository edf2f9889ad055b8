"""What :meth:`Pager.load <colibri.pager.Pager.load>` hands out: read-only numpy views of an
expert's matrices, and the pins that keep their slot.

Views and pinning
-----------------
:meth:`Pager.load` returns an :class:`ExpertBatch` of read-only numpy views. An expert is
pinned (never evicted, its slot never reused) while any view of it is alive, including views
derived from it (slices, ``torch.from_numpy``, DLPack exports): every view's memory is owned
by a small per-load object, and the pin goes with the last of them. Leaving the ``with`` block
drops the batch's own references. Closing the pager never invalidates live views and never
raises ``BufferError``: a mapping stays until its last view dies. ``close()`` drops every page
the pager held (``MADV_DONTNEED``); a view still alive after it re-faults its pages from the
file when read: those pages are outside any budget (the pager is gone), and show in the
process's ``RssFile``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from colibri.formats import ExpertWeights
from colibri.pager._cache import _Cache, _Slot

__all__ = ["ExpertBatch"]


class _Pin:
    """One load's pin on a slot; released when the last view made by that load dies."""

    __slots__ = ("__weakref__", "_cache", "_holder", "_slot")

    def __init__(self, cache: _Cache, slot: _Slot, holder: int) -> None:
        self._cache, self._slot, self._holder = cache, slot, holder

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown nothing is left to free
            self._cache.unpin(self._slot, self._holder)


class _Region:
    """Read-only memory of ``owner`` (a numpy array: the pool or a mapping) for views; holds
    the owner alive and the pin."""

    __slots__ = ("__array_interface__", "_owner", "_pin")

    def __init__(self, owner: np.ndarray, address: int, pin: _Pin) -> None:
        self._owner, self._pin = owner, pin
        self.__array_interface__ = {
            "data": (address, True),  # read-only; ``owner.ctypes.data``, known beforehand
            "shape": (owner.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


class ExpertBatch(Mapping):
    """The experts of one :meth:`Pager.load`: ``batch[e]`` is an :class:`ExpertWeights`.

    Use as a context manager (or call :meth:`release`): afterwards the batch holds no views, so
    the pager may reuse the slots, except those of views the caller still keeps alive.
    """

    def __init__(
        self,
        layer: int,
        experts: dict[int, ExpertWeights],
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.layer = layer
        self._experts: dict[int, ExpertWeights] | None = experts
        self._on_release = on_release  # the pager's check that what was read is the file's

    def _live(self) -> dict[int, ExpertWeights]:
        if self._experts is None:
            raise RuntimeError("this ExpertBatch was released; load the experts again")
        return self._experts

    def __getitem__(self, expert: int) -> ExpertWeights:
        experts = self._live()
        try:
            return experts[int(expert)]
        except KeyError:
            raise KeyError(
                f"expert {expert} was not loaded in this batch (loaded: {sorted(experts)})"
            ) from None

    def __iter__(self) -> Iterator[int]:
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def release(self) -> None:
        """Drop this batch's views (idempotent).

        Raises
        ------
        FileChangedError
            A weight file shrank while the views were read: the pages it no longer holds
            read as zeros (instead of a ``SIGBUS``), so nothing computed from them may be
            used. The pager forgets these experts.
        """
        check, self._on_release = self._on_release, None
        try:
            if check is not None:
                check()  # while the views still pin their slots
        finally:
            self._experts = None

    def __enter__(self) -> ExpertBatch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
