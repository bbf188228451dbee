"""numba's on-disk cache of the kernels, and what to do when it is broken."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import numba

# Reassociation lets LLVM vectorize the row/column sums; no-NaN/no-inf flags stay off so that
# non-finite values propagate exactly as on the torch path.
FASTMATH = {"reassoc", "contract", "nsz"}
KERNEL_OPTIONS: dict[str, Any] = dict(nogil=True, error_model="numpy", fastmath=FASTMATH)


def cached_njit(**options: Any) -> Any:
    """``numba.njit`` with ``cache=True``: compiled once per machine and source version, then loaded
    in every process (in ``__pycache__`` beside this file, else numba's user-wide cache dir, or
    ``NUMBA_CACHE_DIR``). Where numba finds no writable place it compiles in every process instead;
    a cache entry that cannot be read is compiled again (:func:`_tolerate_broken_cache`)."""

    def jit(fn: Any) -> Any:
        try:
            dispatcher = numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(**options)(fn)
        _tolerate_broken_cache(dispatcher)
        return dispatcher

    return jit


_broken_cache_warned = False


def _warn_broken_cache(action: str, error: BaseException) -> None:
    global _broken_cache_warned
    if not _broken_cache_warned:
        _broken_cache_warned = True
        warnings.warn(f"smmf: numba's cache of the fused kernels could not be {action} ({type(error).__name__}: "
                      f"{error}); compiling them instead. Warned once per process.", RuntimeWarning, stacklevel=2)


def _tolerate_broken_cache(dispatcher: Any) -> None:
    """A truncated or overwritten cache file (index or data) makes numba raise at the first call of
    every later process (``UnpicklingError``, ``EOFError``, an LLVM bitcode error, ...). Here a load
    that fails warns once, drops the index so that the fresh compile writes a new entry, and
    compiles; a save that fails keeps the compiled kernel uncached."""
    cache = getattr(dispatcher, "_cache", None)
    if cache is None or not hasattr(cache, "load_overload"):
        return
    load, save = cache.load_overload, cache.save_overload

    def load_overload(sig: Any, target_context: Any) -> Any:
        try:
            return load(sig, target_context)
        except Exception as error:  # noqa: BLE001 - any unreadable entry: compile instead
            _warn_broken_cache("read", error)
            with contextlib.suppress(OSError, AttributeError):
                os.remove(cache._cache_file._index_path)
            return None

    def save_overload(sig: Any, data: Any) -> None:
        try:
            save(sig, data)
        except Exception as error:  # noqa: BLE001
            _warn_broken_cache("written", error)

    cache.load_overload, cache.save_overload = load_overload, save_overload
