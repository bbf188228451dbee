"""numba's on-disk cache of the kernels, and what to do when it is broken."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numba

try:
    import fcntl
except ImportError:  # Windows: numba's cache files are written without a lock, as numba alone does
    fcntl = None  # type: ignore[assignment]

# Reassociation lets LLVM vectorize the row/column sums; no-NaN/no-inf flags stay off so that
# non-finite values propagate exactly as on the torch path.
FASTMATH = {"reassoc", "contract", "nsz"}
KERNEL_OPTIONS: dict[str, Any] = dict(nogil=True, error_model="numpy", fastmath=FASTMATH)


def cached_njit(**options: Any) -> Any:
    """``numba.njit`` with ``cache=True``: compiled once per machine and source version, then loaded
    in every process (in ``__pycache__`` beside this file, else numba's user-wide cache dir, or
    ``NUMBA_CACHE_DIR``). Where numba finds no writable place it compiles in every process instead;
    a cache entry that cannot be read is compiled again (:func:`_tolerate_broken_cache`), and
    processes that write the cache at once take turns (:func:`_take_turns`)."""

    def jit(fn: Any) -> Any:
        try:
            dispatcher = numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(**options)(fn)
        _take_turns(dispatcher)
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


@contextlib.contextmanager
def _directory_lock(path: str, exclusive: bool) -> Iterator[None]:
    """``flock`` on the cache directory, held while the block runs. Where there is no directory, no
    ``fcntl`` or no lock on this filesystem, the block runs unlocked, as numba's own cache does."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _take_turns(dispatcher: Any) -> None:
    """numba writes a cache entry as three unlocked steps: read the index, write it with the entry's
    data file name (the first number the index it read does not use), write the data file. Two
    processes that save different signatures of one kernel at once can both pick number 1, and the
    index may end up naming the other signature's data: every later process then loads, for that
    signature, code compiled for the other one (a float kernel run as an int one). So a save holds an
    exclusive lock on the cache directory, and a load a shared one."""
    cache = getattr(dispatcher, "_cache", None)
    if cache is None or not hasattr(cache, "load_overload") or fcntl is None:
        return
    load, save = cache.load_overload, cache.save_overload

    def load_overload(sig: Any, target_context: Any) -> Any:
        with _directory_lock(cache._cache_path, exclusive=False):
            return load(sig, target_context)

    def save_overload(sig: Any, data: Any) -> None:
        with contextlib.suppress(OSError):
            cache._impl.locator.ensure_cache_path()
        with _directory_lock(cache._cache_path, exclusive=True):
            save(sig, data)

    cache.load_overload, cache.save_overload = load_overload, save_overload
