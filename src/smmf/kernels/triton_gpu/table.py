"""The Triton kernels' table of tensors and their launch geometry: tile shape, the table's columns
(one ``T_*`` constant per field, made from :data:`TABLE_FIELDS`, the state's from the step schema: the kernels
read ``row + T_N``, the host fills a row by name), and
:func:`layout`, where each tensor's work items, partial sums and bit scratch lie, and :func:`levels_layout`,
the same for tensors under the block-levels code of M."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...levels import BLOCK as LEVELS_BLOCK
from ...codes import FACTORED_FIELDS
from ...schema import FLAG_GAINS_M

# The step kernels' geometry, chosen by benchmarks/gpu_tune.py on an H200 (docs/gpu.md): tiles of 8 × 128
# on 8 warps, so that each warp holds one row of a tile (4 elements a thread) and a row's sums stay in its
# warp; each iteration issues the next tile's loads into registers before it computes (:mod:`.step`). A cap
# of 80 registers a thread lets three programs share an SM. BLOCK_COLS is a multiple of 32 (the unaligned
# sign path packs 32 bits at a time).
BLOCK_ROWS, BLOCK_COLS, WARPS = 8, 128, 8
BAND_ROWS = 256  # rows of a work item's band
MAX_REGISTERS: Optional[int] = 80  # per thread (ptxas's maxnreg); None: the compiler's choice
# Whether launches whose tensors pass host.py's _vector check tell the step kernel so (16-byte loads
# and stores).
VECTOR_HINTS = True
COPY_PROGRAMS = 64  # programs per tensor that copy an unaligned tensor's sign scratch back
# The tensor table: one row of int64 per tensor, a column per field: the weight's and gradient's addresses, the
# state's tensors' by the step schema's keys (smmf.schema.FACTORED_FIELDS; 0 for the fields a code lacks), then
# the geometry (:func:`layout`). Each field's column is a ``T_<FIELD>`` constant made from this list: the kernels
# read ``row + T_N``, and the host fills a row by name (``host._table_row``).
TABLE_FIELDS = ("w", "g", *FACTORED_FIELDS, "n", "m", "tiles", "bands", "first_item", "partial_at", "words_at", "lo",
                "hi", "m_cols", "m_rows", "m_tiles", "m_bands", "first_sums_item", "m_partial_at", "new_m_at",
                "gain_sums_at", "flag_words_at")
for _column, _field in enumerate(TABLE_FIELDS):
    globals()["T_" + ("flag_gains_m" if _field == FLAG_GAINS_M else _field).upper()] = tl.constexpr(_column)
META_COLUMNS = tl.constexpr(len(TABLE_FIELDS))


def __getattr__(name: str) -> Any:  # the T_* columns are made above: this tells type checkers they exist
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FP32_MAX = tl.constexpr(3.4028234663852886e38)  # float32's largest finite value


@functools.lru_cache(maxsize=256)
def layout(spans: tuple[tuple[int, int, int, int, int, bool], ...], has_m: bool, device: torch.device,
           block_cols: int, band_rows: int) -> tuple[list[dict[str, int]], Tensor, Tensor, int, int]:
    """Geometry of one launch, cached by its tensors' spans (n, m, lo, hi, m_cols, flag: the n×m
    matrix's elements lo .. hi, the columns of M's view, whether M carries the magnitude flag):
    each tensor's geometry columns of the table, by field name, the step kernel's and the momentum sums
    kernel's work items (tensor indices, on ``device``), and the sizes of the partial-sum buffer and
    of the bit scratch, for tiles ``block_cols`` wide and bands of ``band_rows`` (:data:`BLOCK_COLS`,
    :data:`BAND_ROWS`; arguments, so that a cached layout follows a change of them). Partial sums per
    tensor: [V rows: tiles×n][V cols: bands×m][M rows: tiles×rows of M's view][M cols: bands×m_cols],
    then under the flag [M's new row factors][its new column factors][4 level sums per step work item]."""
    geometry, counts, sums_counts = [], [], []
    first_item = first_sums_item = partial_at = words_at = 0
    for n, m, lo, hi, m_cols, flag in spans:
        tiles, bands = triton.cdiv(m, block_cols), triton.cdiv(triton.cdiv(hi, m) - lo // m, band_rows)
        m_rows = n * m // m_cols
        sums_first = m_cols != m or flag  # |M|'s sums by the sums kernel, in M's view
        held_m_rows = triton.cdiv(hi, m_cols) - lo // m_cols
        m_tiles, m_bands = (triton.cdiv(m_cols, block_cols), triton.cdiv(held_m_rows, band_rows)) if sums_first else (tiles, bands)
        m_partial_at = partial_at + tiles * n + bands * m
        new_m_at = m_partial_at + ((m_tiles * m_rows + m_bands * m_cols) if has_m else 0)
        gain_sums_at = new_m_at + (m_rows + m_cols if flag else 0)
        sign_words = (hi - lo) // 32 + 2 if has_m and (m % 8 or lo % 8) else 0
        geometry.append(dict(n=n, m=m, tiles=tiles, bands=bands, first_item=first_item,
                             partial_at=partial_at, words_at=words_at, lo=lo, hi=hi, m_cols=m_cols, m_rows=m_rows,
                             m_tiles=m_tiles, m_bands=m_bands, first_sums_item=first_sums_item,
                             m_partial_at=m_partial_at, new_m_at=new_m_at, gain_sums_at=gain_sums_at,
                             flag_words_at=words_at + sign_words))
        counts.append(tiles * bands)
        sums_counts.append(m_tiles * m_bands if sums_first else 0)
        first_item += tiles * bands
        first_sums_item += sums_counts[-1]
        partial_at = gain_sums_at + (4 * tiles * bands if flag else 0)
        words_at += sign_words * (2 if flag else 1)
    index = torch.arange(len(spans), dtype=torch.int32)
    items = torch.repeat_interleave(index, torch.tensor(counts))
    sums_items = torch.repeat_interleave(index, torch.tensor(sums_counts))
    return geometry, items.to(device), sums_items.to(device), partial_at, words_at


@functools.lru_cache(maxsize=256)
def levels_layout(spans: tuple[tuple[int, int, int, int, int, int], ...], device: torch.device, block_cols: int,
                  band_rows: int, blocks_per_item: int) -> tuple[list[dict[str, int]], Tensor, Tensor, int, int]:
    """:func:`layout` for tensors under the block-levels code (``magnitude_bits=3``), whose spans are
    (n, m, lo, hi, rows, cols): V's n×m view's elements lo .. hi, and the rows × cols of M (the param's rows
    held) that the same elements make. V's fields are :func:`layout`'s; the fields of M's view hold M's rows
    and columns, its blocks per row (``m_tiles``) and the first of the tensor's work items of the levels
    step kernel (``first_sums_item``: one per ``blocks_per_item`` blocks). Partial sums per tensor: V's only,
    as :func:`layout` lays them out. Returns the same five as :func:`layout` (its second list of work items
    is the levels step kernel's; no bit scratch)."""
    geometry, counts, step_counts = [], [], []
    first_item = first_step_item = partial_at = 0
    for n, m, lo, hi, rows, cols in spans:
        tiles, bands = triton.cdiv(m, block_cols), triton.cdiv(triton.cdiv(hi, m) - lo // m, band_rows)
        blocks_per_row = triton.cdiv(cols, LEVELS_BLOCK)
        if cols + LEVELS_BLOCK >= 2**31 or rows * blocks_per_row >= 2**31:
            raise RuntimeError(f"the Triton kernels of the levels code index a row's elements and a tensor's blocks in "
                               f"int32: M of {rows} × {cols} (a 1-D param is one row) is too large for them; "
                               "use backend='torch' for it")
        geometry.append(dict(n=n, m=m, tiles=tiles, bands=bands, first_item=first_item,
                             partial_at=partial_at, words_at=0, lo=lo, hi=hi, m_cols=cols, m_rows=rows,
                             m_tiles=blocks_per_row, m_bands=0, first_sums_item=first_step_item, m_partial_at=0,
                             new_m_at=0, gain_sums_at=0, flag_words_at=0))
        counts.append(tiles * bands)
        step_counts.append(triton.cdiv(rows * blocks_per_row, blocks_per_item))
        first_item += counts[-1]
        first_step_item += step_counts[-1]
        partial_at += tiles * n + bands * m
    index = torch.arange(len(spans), dtype=torch.int32)
    items = torch.repeat_interleave(index, torch.tensor(counts))
    step_items = torch.repeat_interleave(index, torch.tensor(step_counts))
    return geometry, items.to(device), step_items.to(device), partial_at, 0
