"""The SIGBUS guard of the pager's file mappings (include/colibri/guard.h): a read of a page
the file no longer holds reads zeros and marks its mapping, instead of killing the process."""

from libc.stdint cimport int64_t, uintptr_t


cdef extern from "colibri/guard.h" nogil:
    enum:
        COLIBRI_GUARD_ENABLED
        COLIBRI_GUARD_MAX
    int64_t colibri_guard_register(uintptr_t start, size_t length) noexcept
    void colibri_guard_unregister(int64_t i) noexcept
    int colibri_guard_faulted(int64_t i) noexcept


#: Whether this build guards mappings (POSIX); elsewhere ``register`` returns -1.
ENABLED = bool(COLIBRI_GUARD_ENABLED)
#: Mappings guarded at once; ``register`` returns -1 beyond.
MAX_RANGES = COLIBRI_GUARD_MAX


def register(uintptr_t address, size_t length) -> int:
    """Guard the mapping ``[address, address + length)``; its index, or -1 when it cannot be
    guarded (not POSIX, or ``MAX_RANGES`` mappings guarded already)."""
    return colibri_guard_register(address, length)


def unregister(int64_t index) -> None:
    """Stop guarding mapping ``index`` (before it is unmapped); -1 is ignored."""
    colibri_guard_unregister(index)


def faulted(int64_t index) -> bool:
    """Whether a page of mapping ``index`` was read past the end of its file (and replaced by
    zeros) since it was registered."""
    return colibri_guard_faulted(index) != 0
