"""numba's on-disk cache of the kernels, and what to do when it is broken."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numba
from numba.core.compiler_lock import global_compiler_lock
from numba.core.sigutils import normalize_signature

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
    a cache entry that cannot be read is compiled again (:func:`_tolerate_broken_cache`),
    processes that write the cache at once take turns (:func:`_take_turns`), and processes that need
    one signature before it is cached compile it once (:func:`_compile_once`)."""

    def jit(fn: Any) -> Any:
        try:
            dispatcher = numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(**options)(fn)
        _stamp_with_sources(dispatcher)
        _tolerate_broken_cache(dispatcher)
        _take_turns(dispatcher)  # outermost: a broken entry's index is dropped under the lock
        _compile_once(dispatcher)
        return dispatcher

    return jit


# What went wrong so far in this process ("read", "written", "locked"): each is warned once, so that a
# lock waited out does not hide a broken entry.
_cache_warned: set[str] = set()


def _warn_broken_cache(action: str, error: BaseException, instead: str = "compiling them instead") -> None:
    if action not in _cache_warned:
        _cache_warned.add(action)
        warnings.warn(f"smmf: numba's cache of the fused kernels could not be {action} ({type(error).__name__}: "
                      f"{error}); {instead}. Warned once per process.", RuntimeWarning, stacklevel=2)


# The sources a kernel's compiled code depends on: this package's modules (inlined into the cached
# kernels), the constants of smmf.levels and smmf.noise and the step schema's names of the kernels' numbers and
# options.
_SOURCES = (*sorted(Path(__file__).parent.glob("*.py")),
            *(Path(__file__).parents[2] / name for name in ("levels.py", "noise.py", "schema.py")))


def digest_of(paths: tuple[Path, ...]) -> str:
    """A hash of the contents of ``paths``, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def sources_digest() -> str:
    """:func:`digest_of` the kernels' sources, read once per process."""
    return digest_of(_SOURCES)


def _stamp_with_sources(dispatcher: Any) -> None:
    """numba keys a cache entry on the source file of the cached function alone, so an edit of an inlined
    helper in another module (elements.py, an upgrade that rewrote it) would keep loading the old code: the
    stamp gets a digest of every source the kernels compile from."""
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if cache_file is not None and hasattr(cache_file, "_source_stamp"):
        cache_file._source_stamp = (cache_file._source_stamp, sources_digest())


class _WrongEntry(LookupError):
    """The cache's index names code compiled for another signature (left by an unlocked save)."""


def _tolerate_broken_cache(dispatcher: Any) -> None:
    """A truncated or overwritten cache file (index or data) makes numba raise at the first call of
    every later process (``UnpicklingError``, ``EOFError``, an LLVM bitcode error, ...), and an index
    that names another signature's code would run that code. Here a load that fails or brings the
    wrong signature warns once, drops the index so that the fresh compile writes a new entry, and
    compiles; a save that fails keeps the compiled kernel uncached."""
    cache = getattr(dispatcher, "_cache", None)
    if cache is None or not hasattr(cache, "load_overload"):
        return
    load, save = cache.load_overload, cache.save_overload

    def load_overload(sig: Any, target_context: Any) -> Any:
        try:
            loaded = load(sig, target_context)
            if loaded is not None and tuple(loaded.signature.args) != tuple(normalize_signature(sig)[0]):
                raise _WrongEntry(f"the entry for {sig} holds the code of {loaded.signature.args}")
            return loaded
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


# The lock is a file in the cache directory, opened for writing where it can be: NFS emulates
# ``flock`` with byte-range locks, and an exclusive one needs a file open for writing.
_LOCK_FILE = "smmf-cache.lock"
# A lock held longer than this (a stopped process, a debugger) is waited out with one warning.
_LOCK_PATIENCE_S = 60.0
# Another process's compile of a signature is waited for this long at most, then compiled here too (well
# above the largest kernel's compile, even on a loaded machine: docs/design.md).
_COMPILE_PATIENCE_S = 300.0
# A wait for another process's compile longer than this says once what this process waits for.
_COMPILE_NOTICE_S = 120.0
_held_lock_fds: set[int] = set()


def _drop_locks_in_child() -> None:
    """A forked child shares the parent's open lock files, and with them the locks: closing its copies
    lets the parent's ``close`` release them (unlocking would release the parent's lock too)."""
    for fd in _held_lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_lock_fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_locks_in_child)


def _open_lock_file(directory: str, name: str) -> int | None:
    path = os.path.join(directory, name)
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # read-only cache dirs: shared locks only
        with contextlib.suppress(OSError):
            return os.open(path, flags, 0o666)
    return None


def _lock(fd: int, exclusive: bool, patience: float, waiting: str | None) -> None:
    assert fcntl is not None
    operation = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    start = time.monotonic()
    deadline = start + patience
    while True:
        try:
            fcntl.flock(fd, operation)
            return
        except BlockingIOError:
            if waiting is not None and time.monotonic() > start + _COMPILE_NOTICE_S and "waiting" not in _cache_warned:
                _cache_warned.add("waiting")  # a long wait says why this process stands still, once
                warnings.warn(f"smmf: waiting for {waiting} (held for {_COMPILE_NOTICE_S:.0f} s so far, up to "
                              f"{patience:.0f} s, then compiling here). Warned once per process.", RuntimeWarning,
                              stacklevel=2)
            if time.monotonic() > deadline:
                if waiting is None:  # a compile waited out is compiled here, nothing lost
                    _warn_broken_cache("locked", TimeoutError(f"held elsewhere for {patience:.0f} s"),
                                       "going on without the lock")
                return
            time.sleep(0.005)
        except OSError:  # a filesystem without locks: as numba alone
            return


@contextlib.contextmanager
def _cache_lock(directory: str, exclusive: bool, name: str = _LOCK_FILE, patience: float = _LOCK_PATIENCE_S,
                waiting: str | None = None) -> Iterator[None]:
    """A lock file ``name`` of the cache directory, held while the block runs; by default the cache's
    own lock: exclusive to save, shared to load. A lock held elsewhere longer than ``patience`` is
    waited out with one warning; with ``waiting`` (a compile's lock), a wait past
    :data:`_COMPILE_NOTICE_S` says once what it waits for instead, and the timeout is silent. Where there is no ``fcntl`` (Windows), no lock file can be opened or
    the filesystem has no locks, the block runs unlocked, as numba's own cache does."""
    fd = _open_lock_file(directory, name) if fcntl is not None else None
    if fd is None:
        yield
        return
    _held_lock_fds.add(fd)
    try:
        _lock(fd, exclusive, patience, waiting)
        yield
    finally:
        _held_lock_fds.discard(fd)
        os.close(fd)  # and with it the lock


def _take_turns(dispatcher: Any) -> None:
    """numba writes a cache entry as three unlocked steps: read the index, write it with the entry's
    data file name (the first number the index it read does not use), write the data file. Two
    processes that save different signatures of one kernel at once can both pick number 1, and the
    index may end up naming the other signature's data: every later process then loads, for that
    signature, code compiled for the other one (a float kernel run as an int one). So a save holds the
    cache directory's lock (:func:`_cache_lock`) exclusively, and a load shares it."""
    cache = getattr(dispatcher, "_cache", None)
    if cache is None or not hasattr(cache, "load_overload") or fcntl is None:
        return
    load, save = cache.load_overload, cache.save_overload

    def load_overload(sig: Any, target_context: Any) -> Any:
        if not os.path.isdir(cache._cache_path):  # nothing cached yet: nothing to lock
            return load(sig, target_context)
        with _cache_lock(cache._cache_path, exclusive=False):
            return load(sig, target_context)

    def save_overload(sig: Any, data: Any) -> None:
        with contextlib.suppress(OSError):  # numba's save reports what fails here
            os.makedirs(cache._cache_path, exist_ok=True)
        with _cache_lock(cache._cache_path, exclusive=True):
            save(sig, data)

    cache.load_overload, cache.save_overload = load_overload, save_overload


def _compile_once(dispatcher: Any) -> None:
    """Processes that need a signature no one has cached yet each compiled it: the ranks of a first
    distributed run on a machine, two test workers, up to about 30 s of CPU apiece for the largest
    kernels. Now a compile holds a lock file of its own for that kernel and signature: the first
    process compiles and saves, the others wait for it and load what it saved; other processes compile
    other signatures meanwhile. A process that waits holds numba's in-process compiler lock (which its
    compile takes anyway), taken before the file lock: two threads of one process that each held one
    and waited for the other would never go on. A compile that reaches the same signature again inside
    its own (numba types a call between kernels by compiling the callee) does not lock it twice.

    The process that compiled then runs the saved entry, as loaded from the cache, not its own fresh
    copy: the two were seen to round a sum differently, and the ranks of one run (one compiling, the
    others loading) must run the same code."""
    cache: Any = getattr(dispatcher, "_cache", None)
    index_name = getattr(getattr(cache, "_cache_file", None), "_index_name", None)
    if index_name is None or fcntl is None:  # uncached (numba's NullCache), Windows
        return
    compile_here = dispatcher.compile
    held: set[str] = set()

    def compile_once(sig: Any) -> Any:
        args = tuple(normalize_signature(sig)[0])
        # Argument types are named by value for the kernels' arrays and structs (a type named by an object's
        # address would only make each process compile, as before).
        name = f"smmf-compile-{hashlib.sha256(f'{index_name} {args}'.encode()).hexdigest()[:20]}.lock"
        with global_compiler_lock:
            if args in dispatcher.overloads or name in held:
                return compile_here(sig)
            with contextlib.suppress(OSError):  # the lock file's directory; numba's save reports what fails
                os.makedirs(cache._cache_path, exist_ok=True)
            held.add(name)
            try:
                with _cache_lock(cache._cache_path, exclusive=True, name=name, patience=_COMPILE_PATIENCE_S,
                                 waiting="another process's compile of the fused kernels"):
                    misses = sum(dispatcher._cache_misses.values())
                    entry = compile_here(sig)
                    if sum(dispatcher._cache_misses.values()) > misses:
                        entry = _run_the_saved_entry(dispatcher, args, sig, entry)
                    return entry
            finally:
                held.discard(name)

    dispatcher.compile = compile_once


def _run_the_saved_entry(dispatcher: Any, args: tuple, sig: Any, entry: Any) -> Any:
    """Swap the overload just compiled for the cache's entry of it (numba's own steps for a cache hit);
    where the entry cannot be loaded (the save failed), keep the compiled one."""
    cres = dispatcher._cache.load_overload(sig, dispatcher.targetctx)
    if cres is None:
        return entry
    others = [kept for key, kept in dispatcher.overloads.items() if key != args]
    dispatcher._reset_overloads()  # numba's dispatch table too: a second entry for a signature is not looked up
    for kept in others:
        dispatcher.add_overload(kept)
    if not cres.objectmode:
        dispatcher.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
    dispatcher.add_overload(cres)
    dispatcher._cache_hits[sig] += 1
    return cres.entry_point
