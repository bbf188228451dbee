"""Compile every variant of the Triton kernels for a CUDA target, no GPU needed: Triton's own
front end, LLVM and the ptxas it ships build each to a cubin, which catches what the CPU
interpreter lets through (types of loop-carried values, constexpr branches, layouts). Prints each
variant's registers and stack per thread (``cuobjdump --dump-resource-usage``; a stack beside 255
registers means spills). Run directly: ``python tests/triton_compile.py [--arch 90]``."""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from smmf.kernels.triton_gpu import finish, flag, levels, no_m, sign, sums, table

_POINTERS = dict(meta_ptr="*i64", item_tensor_ptr="*i32", partial_ptr="*fp32", words_ptr="*i32", bad_ptr="*i32",
                 keys_ptr="*i64")
_SCALARS = dict(lr="fp32", beta1="fp32", beta2="fp32", eps="fp32", gsign="fp32", shrink="fp32", l2="fp32")
STEP_ARGS = dict(**_POINTERS, **_SCALARS)
SUMS_ARGS = dict(meta_ptr="*i64", item_tensor_ptr="*i32", partial_ptr="*fp32", beta1="fp32", gsign="fp32",
                 shrink="fp32", l2="fp32")
FINISH_ARGS = dict(meta_ptr="*i64", partial_ptr="*fp32", words_ptr="*i32")
TILES = dict(BR=table.BLOCK_ROWS, BC=table.BLOCK_COLS, BAND=table.BAND_ROWS)
_LEVELS_SCALARS = dict(beta2="fp32", rest2="fp32", gsign="fp32", shrink="fp32", l2="fp32")
LEVELS_V_SUMS_ARGS = dict(meta_ptr="*i64", item_tensor_ptr="*i32", partial_ptr="*fp32", **_LEVELS_SCALARS)
LEVELS_STEP_ARGS = dict(meta_ptr="*i64", item_tensor_ptr="*i32", salts_ptr="*i64", bad_ptr="*i32", lr="fp32",
                        beta1="fp32", rest1="fp32", eps="fp32", keys_ptr="*i64", **_LEVELS_SCALARS)
STEP_KERNELS = (sign.sign_step_kernel, flag.flag_step_kernel, no_m.no_m_step_kernel)
# Options a kernel is launched with beyond its warps.
LAUNCH_OPTIONS = {levels.v_sums_kernel: levels.LAUNCH_OPTIONS, levels.levels_step_kernel: levels.LAUNCH_OPTIONS,
                  **{kernel: dict(maxnreg=table.MAX_REGISTERS) if table.MAX_REGISTERS else {} for kernel in STEP_KERNELS}}


def variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int]]:
    """(label, kernel, argument types, constexprs, warps) for each specialization a launch can make: an
    argument given as None (no bit scratch, no NaN/inf count, no bf16 rounding keys) is a constexpr."""
    out = []
    for dtype, has_m, aligned, vector, shard, natural, with_flag in itertools.product(
            (tl.float32, tl.bfloat16, tl.float16), (True, False), (True, False), (True, False), (False, True),
            (False, True), (False, True)):
        if not has_m and (not aligned or natural or with_flag):
            continue  # without a first moment there are no bits: aligned, with or without 16-byte hints
        if vector and not aligned:
            continue  # 16-byte rows are whole sign bytes
        consts: dict[str, Any] = dict(W_DTYPE=dtype, VECTOR=vector, SHARD=shard, **TILES)
        if dtype != tl.bfloat16:
            consts["keys_ptr"] = None  # nearest (stochastic rounding is bf16's)
        if has_m:
            consts["NATURAL"] = natural
            if aligned:
                consts["words_ptr"] = None
        kernel = flag.flag_step_kernel if with_flag else sign.sign_step_kernel if has_m else no_m.no_m_step_kernel
        label = (f"step {dtype} m={has_m} aligned={aligned} vector={vector} shard={shard} natural={natural} "
                 f"flag={with_flag}")
        out.append((label, kernel, STEP_ARGS, consts, table.WARPS))
    for with_flag in (False, True):
        consts = dict(W_DTYPE=tl.float32, ZERO_NONFINITE=True, FLAG=with_flag, **TILES)
        out.append((f"momentum sums flag={with_flag}", sums.momentum_sums_kernel, SUMS_ARGS, consts, table.WARPS))
    for first, moments, scratch, with_flag in ((0, 2, False, False), (0, 1, False, False), (1, 1, True, True),
                                               (0, 1, False, True)):
        consts = dict(BLOCK=256, KB=16, COPIERS=table.COPY_PROGRAMS, COPY_BLOCK=4096, NORMALIZE=True, FIRST=first,
                      MOMENTS=moments, TO_SCRATCH=scratch, FLAG=with_flag)
        out.append((f"finish moments {first}..{first + moments - 1} scratch={scratch} flag={with_flag}",
                    finish.finish_kernel, FINISH_ARGS, consts, 8))
    out.append(("flag finish", finish.flag_finish_kernel, dict(meta_ptr="*i64", partial_ptr="*fp32"),
                dict(BLOCK=256), 4))
    for dtype in (tl.float32, tl.bfloat16, tl.float16):
        out.append((f"levels V sums {dtype}", levels.v_sums_kernel, LEVELS_V_SUMS_ARGS,
                    dict(W_DTYPE=dtype, ZERO_NONFINITE=True, **TILES), table.WARPS))
        bf16 = ((False, False), (True, False), (False, True), (True, True))  # weights' rounding × the levels'
        for stochastic, dithered in bf16 if dtype == tl.bfloat16 else ((False, False), (False, True)):
            consts = dict(W_DTYPE=dtype, **({} if stochastic else {"keys_ptr": None}),
                          **({} if dithered else {"salts_ptr": None}))
            out.append((f"levels step {dtype} stochastic={stochastic} dither={dithered}", levels.levels_step_kernel,
                        LEVELS_STEP_ARGS, consts, levels.STEP_WARPS))
    return out


def cuobjdump(cubin: bytes, flag: str) -> str:
    """What Triton's own ``cuobjdump`` prints for ``cubin`` with ``flag``; "" where Triton ships none."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resources(cubin: bytes) -> str:
    out = cuobjdump(cubin, "--dump-resource-usage")
    usage = next((line.split() for line in out.splitlines() if "REG:" in line), [])
    return " ".join(field for field in usage if field.split(":")[0] in ("REG", "STACK", "SHARED"))


def loop_instructions(ptx: str) -> int:
    """PTX instructions in the kernel's longest loop (a label and the last branch back to it): what a
    thread runs per tile of the step kernels. 0 without a loop."""
    lines = [line.strip() for line in ptx.splitlines()]
    labels = {found.group(1): i for i, found in enumerate(re.match(r"(\$L\w+):", line) for line in lines) if found}
    longest = 0
    for j, line in enumerate(lines):
        target = re.search(r"\bbra(?:\.uni)?\s+(\$L\w+);", line)
        if target and labels.get(target.group(1), j) < j:
            body = lines[labels[target.group(1)]:j + 1]
            longest = max(longest, sum(1 for x in body if x and x[0].isalpha() or x.startswith("@")))
    return longest


def sass_loop_instructions(sass: str) -> int:
    """Machine (SASS) instructions a thread issues per pass of the kernel's longest loop: the loop's own,
    plus each subroutine it calls, once per call (a 64-bit division is one PTX instruction but a call of
    about 80 SASS instructions). 0 without a loop."""
    code = [(int(found.group(1), 16), found.group(2).strip()) for found in
            (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if found]
    index = {address: i for i, (address, _) in enumerate(code)}
    first = last = 0
    for i, (address, text) in enumerate(code):
        target = re.search(r"\bBRA(?:\.U)?\s+(0x[0-9a-f]+)", text)
        if target and "BRA.DIV" not in text and index.get(int(target.group(1), 16), i) < i:
            j = index[int(target.group(1), 16)]
            if i - j > last - first:
                first, last = j, i
    if first == last:
        return 0
    total = last - first + 1
    for _, text in code[first:last + 1]:
        call = re.search(r"\bCALL\.\S+\s+(0x[0-9a-f]+)", text)
        if call:
            start = index[int(call.group(1), 16)]
            end = next(k for k in range(start, len(code)) if code[k][1].startswith("RET"))
            total += end - start + 1
    return total


def compile_all(arch: int = 90) -> list[tuple[str, str]]:
    """Build every variant for ``sm_<arch>``; raises on the first that does not compile. Beside the
    resources, for kernels that walk BR × BC tiles: thread instructions per element of a tile, the
    proxy for a step's issue cost: the loop's PTX instructions × threads / (BR·BC) (INSTR), and the
    same of the machine code it becomes, the subroutines it calls included (SASS)."""
    report = []
    for label, kernel, arg_types, consts, warps in variants():
        names = inspect.signature(kernel.fn).parameters
        signature = {name: "constexpr" if name in consts else arg_types[name] for name in names}
        options = {"num_warps": warps, **LAUNCH_OPTIONS.get(kernel, {})}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        usage = resources(compiled.asm["cubin"])
        if "BR" in consts and "BC" in consts:
            threads_per_element = 32 * warps / (consts["BR"] * consts["BC"])
            usage += f" INSTR/ELEM:{loop_instructions(compiled.asm['ptx']) * threads_per_element:.1f}"
            machine = sass_loop_instructions(cuobjdump(compiled.asm["cubin"], "-sass"))
            if machine:
                usage += f" SASS/ELEM:{machine * threads_per_element:.1f}"
        report.append((label, usage))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    for label, usage in compile_all(args.arch):
        print(f"{label}: {usage}")
    print("TRITON COMPILE OK")
