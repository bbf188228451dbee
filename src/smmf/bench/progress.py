"""Progress bars on stderr (tqdm when installed, plain lines otherwise)."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: Optional[int] = None, enabled: bool = True) -> Iterator[T]:
    if not enabled:
        yield from items
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        for i, item in enumerate(items):
            print(f"{desc}: {i + 1}{'/' + str(total) if total else ''}", file=sys.stderr, flush=True)
            yield item
        return
    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True,
                    mininterval=0.5 if sys.stderr.isatty() else 15.0)
