"""How the numba kernels read and write memory: prefetches, bf16 weights as fp32 rows (rounded to
nearest or stochastically), and packed bits as 0/1 bytes; and the counter hash their noise comes from."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ...noise import HASH_MULTIPLIERS


@intrinsic
def _prefetch(typingctx, array, index):  # noqa: ARG001 - numba's intrinsic signature
    """Ask the CPU to bring ``array[index]``'s cache line into L1 (LLVM's ``llvm.prefetch``: read,
    high locality); no effect on results."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.globals.get("llvm.prefetch.p0") or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), name="llvm.prefetch.p0")
        address = builder.bitcast(builder.gep(data, [args[1]]), byte_ptr)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, types.intp), codegen


@numba.njit(inline="always")
def prefetch_lines(array, start, length):
    """Prefetch every 64-byte line of ``array[start : start + length]``."""
    for k in range(start, start + length, 64 // array.itemsize):
        _prefetch(array, k)


@numba.njit(inline="always")
def nearest_even(u):
    """The fp32 bit pattern ``u`` (not NaN) plus what rounds its top 16 bits to nearest even when truncated."""
    return u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))


@numba.njit(inline="always")
def bf16_bits(u):
    """The top 16 bits of the fp32 bit pattern ``u`` (after rounding it): bf16, as int16 bits."""
    return np.int16(np.int32(u >> np.uint32(16)) - (65536 if (u >> np.uint32(31)) else 0))


def load(src, start, length, buf):
    """``src[start : start + length]`` as float: in place for fp32/fp64, for bf16 (int16 bit patterns)
    converted into ``buf`` (uint32, at least ``length``). Typed by :func:`_overload_load`."""
    raise NotImplementedError("compiled only")


def store(dst, start, row, stochastic, noise_base):
    """Write a loaded row back: nothing for fp32/fp64 (it lives in ``dst``); bf16 rounds to
    nearest even, or stochastically with ``stochastic``: element j adds the top 16 bits of
    :func:`hash32_at` (``noise_base``, j) below its kept bits (``noise_base``: the tensor's key at this
    step, :func:`smmf.noise.rounding_key`, plus the row's first index in the param, so that no two elements
    of a tensor's step share it, a shard's included, and every path draws the same noise)."""
    raise NotImplementedError("compiled only")


def mix32_ir(builder, x):
    """LLVM IR of :func:`smmf.noise.mix32` on an i32 value ``x`` (two multiply-xorshift rounds), in
    32-bit lanes: numba widens integer products to 64 bits, whose vector multiply (``vpmullq``) made the
    hash cost 1.5× more per element."""
    i32 = ir.IntType(32)

    def xorshift(v, bits):
        return builder.xor(v, builder.lshr(v, ir.Constant(i32, bits)))

    x = xorshift(builder.mul(xorshift(x, 16), ir.Constant(i32, HASH_MULTIPLIERS[0])), 15)
    return xorshift(builder.mul(x, ir.Constant(i32, HASH_MULTIPLIERS[1])), 16)


def hashed_i32(builder, base, offset):
    """The i32 hash of (``base`` + ``offset``) mod 2³², both truncated alone, so that a loop's counter as
    ``offset`` vectorizes in 32-bit lanes."""
    i32 = ir.IntType(32)
    return mix32_ir(builder, builder.add(builder.trunc(base, i32), builder.trunc(offset, i32)))


@intrinsic
def hash32_at(typingctx, base, offset):  # noqa: ARG001 - numba's intrinsic signature
    """:func:`smmf.noise.mix32` of (``base`` + ``offset``) mod 2³², a uint32."""
    def codegen(context, builder, signature, args):
        return hashed_i32(builder, args[0], args[1])

    if not all(isinstance(t, types.Integer) and t.bitwidth >= 32 for t in (base, offset)):
        return None
    return types.uint32(base, offset), codegen


@overload(load, inline="always")
def _overload_load(src, start, length, buf):
    if src.dtype == types.int16:
        def load_bf16(src, start, length, buf):
            for j in range(length):
                buf[j] = (np.uint32(src[start + j]) & np.uint32(0xFFFF)) << np.uint32(16)
            return buf[:length].view(np.float32)  # a row's last tile is shorter than the buffer

        return load_bf16
    return lambda src, start, length, buf: src[start : start + length]


@overload(store, inline="always")
def _overload_store(dst, start, row, stochastic, noise_base):
    if dst.dtype == types.int16:
        def store_bf16(dst, start, row, stochastic, noise_base):
            bits = row.view(np.uint32)
            for j in range(bits.shape[0]):
                u = bits[j]
                if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    u = u | np.uint32(0x00400000)  # NaN stays NaN: the quiet bit survives truncation
                elif stochastic:
                    u = u + (hash32_at(noise_base, j) >> np.uint32(16))  # stochastic rounding
                else:
                    u = nearest_even(u)
                dst[start + j] = bf16_bits(u)

        return store_bf16
    return lambda dst, start, row, stochastic, noise_base: None





# Eight sign bits ↔ eight bytes of 0/1 in one uint64, branch-free and vectorizable: spreading
# copies the byte into every lane and keeps bit t in lane t (adding 0x7F then carries it to bit 7);
# gathering multiplies each lane's bit to bit 56 + t.
_SPREAD_COPIES = np.uint64(0x0101010101010101)
_SPREAD_BITS = np.uint64(0x8040201008040201)
_SPREAD_CARRY = np.uint64(0x7F7F7F7F7F7F7F7F)
_GATHER = np.uint64(0x0102040810204080)


@numba.njit(inline="always")
def unpack_bytes(signs, first, count, lanes):
    """Bytes ``first .. first+count`` of ``signs`` → ``lanes`` (uint64 view): one 0/1 byte per bit."""
    src = signs[first : first + count]  # indexed from 0: no negative-index wraparound, so LLVM vectorizes
    for b in range(count):
        spread = (np.uint64(src[b]) * _SPREAD_COPIES) & _SPREAD_BITS
        lanes[b] = ((spread + _SPREAD_CARRY) >> np.uint64(7)) & _SPREAD_COPIES


@numba.njit(inline="always")
def pack_bytes(signs, first, count, lanes):
    """Inverse of :func:`unpack_bytes`: every lane byte must be 0 or 1."""
    dst = signs[first : first + count]
    for b in range(count):
        dst[b] = np.uint8((lanes[b] * _GATHER) >> np.uint64(56))



@numba.njit(inline="always")
def byte_span(start, width):
    """The bytes of packed bits that elements ``start .. start + width`` use: the first, how many, and
    the bit of element ``start`` in the first."""
    first = start >> 3
    return first, ((start + width - 1) >> 3) - first + 1, start & 7

