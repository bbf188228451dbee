"""What the levels code's per-block loops cost on their own, from L1, one thread: the codes against a block's new
scale (with the dither, and rounded to nearest), packing them into nibbles and unpacking them into signed levels.
The blocks are ``smmf.levels.BLOCK`` elements, walked as the kernel walks them (``kernels/numba_cpu/levels.py``).

    python studies/levels_parts.py

Run on a quiet machine; name the CPU with the figures.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from smmf.kernels.numba_cpu import levels
from smmf.kernels.numba_cpu.cache import KERNEL_OPTIONS
from smmf.kernels.numba_cpu.structs import LevelsGeometry
from smmf.levels import BLOCK

ELEMENTS = 4096  # 16 KiB of M in fp32 and its codes: L1-resident
REPS = 20000


@numba.njit(**KERNEL_OPTIONS)
def _codes(m, cbuf, table, geo, reps):
    for _ in range(reps):
        for b in range(m.shape[0] // BLOCK):
            levels._codes_of(cbuf[:BLOCK], np.float32(3.0), table, m[b * BLOCK : (b + 1) * BLOCK], b * BLOCK, geo)
    return cbuf[0]


@numba.njit(**KERNEL_OPTIONS)
def _pack(codes, cbuf, reps):
    for _ in range(reps):
        for b in range(2 * codes.shape[1] // BLOCK):
            levels.pack_codes(codes[0], b * BLOCK, BLOCK, cbuf)
    return codes[0, 0]


@numba.njit(**KERNEL_OPTIONS)
def _unpack(codes, lbuf, reps):
    for _ in range(reps):
        for b in range(2 * codes.shape[1] // BLOCK):
            levels.unpack_codes(codes[0], b * BLOCK, BLOCK, lbuf)
    return lbuf[0]


def _ns_per_element(run, *args) -> float:
    run(*args, 10)  # compile
    start = time.perf_counter()
    run(*args, REPS)
    return (time.perf_counter() - start) / (REPS * ELEMENTS) * 1e9


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(0)
    m = rng.standard_normal(ELEMENTS).astype(np.float32)
    codes = rng.integers(0, 256, size=(1, ELEMENTS // 2), dtype=np.uint8)
    cbuf, lbuf = np.zeros(BLOCK + 1, np.uint8), np.zeros(BLOCK + 1, np.float32)
    table = levels.level_table(np.float32)
    print(f"one thread, L1-resident, blocks of {BLOCK}: ns/element")
    for dither in (True, False):
        geo = LevelsGeometry(64, 64, 64, 64, 0, 1, dither, 12345)
        print(f"  codes against the new scale, {'dithered' if dither else 'nearest'}: "
              f"{_ns_per_element(_codes, m, cbuf, table, geo):.3f}")
    print(f"  packing the codes: {_ns_per_element(_pack, codes, cbuf):.3f}")
    print(f"  unpacking them into signed levels: {_ns_per_element(_unpack, codes, lbuf):.3f}")


if __name__ == "__main__":
    main()
