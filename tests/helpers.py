"""Shared test helpers: the shape zoo, state reconstruction, backends to test."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from smmf import SMMF
from smmf.kernels import available_backends
from smmf.matrix import unpack_signs

# 0-d, 1-D, 2-D, 4-D conv, prime N, empty, odd 3-D, a non-multiple-of-8 matrix.
ZOO_SHAPES: list[tuple[int, ...]] = [(), (7,), (5, 6), (4, 3, 3, 3), (13,), (0,), (2, 0, 3), (3, 5, 7), (31, 9)]

# Each fused kernel runs on its own device's tensors: numba on CPU, triton on CUDA.
BACKEND_DEVICE = {"torch": "cpu", "numba": "cpu", "triton": "cuda"}
FUSED_BACKENDS = [b for b in available_backends() if b not in ("auto", "torch")]
CPU_FUSED_BACKENDS = [b for b in FUSED_BACKENDS if BACKEND_DEVICE[b] == "cpu"]
HAS_CUDA = torch.cuda.is_available()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def deepspeed_shm_removed(port: int | str) -> Iterator[None]:
    """Removes, once a job on ``port`` is over, the 64 MiB ``/dev/shm`` buffer per rank that DeepSpeed's CPU backend
    creates and never unlinks: left behind, a few runs of the suite fill a small machine's shared memory."""
    try:
        yield
    finally:
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            path.unlink(missing_ok=True)


def device_of(backend: str) -> str:
    return BACKEND_DEVICE[backend]


def make_zoo(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype)) for shape in ZOO_SHAPES]
    # A channels_last conv weight: its logical row-major order differs from its memory order.
    conv = torch.randn(6, 4, 3, 3, generator=gen, dtype=dtype).to(memory_format=torch.channels_last)
    params.append(torch.nn.Parameter(conv))
    return params


def random_grad(p: Tensor, gen: torch.Generator, non_contiguous: bool) -> Tensor:
    if non_contiguous and p.dim() == 2:
        return torch.randn(p.shape[::-1], generator=gen, dtype=p.dtype).t()
    return torch.randn(p.shape, generator=gen, dtype=p.dtype)


def reconstruct_state(opt: SMMF, p: Tensor) -> tuple[Tensor | None, Tensor]:
    """The decompressed (M̂, V̂) of ``p`` as matrices (dense state as it is)."""
    st = opt.state[p]
    if "exp_avg_sq" in st:
        return st.get("exp_avg"), st["exp_avg_sq"]
    v = torch.outer(st["row_v"], st["col_v"])
    if "codes_m" in st:  # magnitude_bits=3: M by rows of the param
        from smmf.levels import decode_levels

        rows = st["codes_m"].shape[0]
        return decode_levels(st["codes_m"], st["scales_m"], v.numel() // max(rows, 1), v.dtype), v
    if "row_m" not in st:
        return None, v
    magnitude = torch.outer(st["row_m"], st["col_m"])  # M's own n×m view
    if "flag_m" in st:
        flag = unpack_signs(st["flag_m"], v.numel()).view(magnitude.shape)
        magnitude = magnitude * torch.where(flag, st["levels_m"][0], st["levels_m"][1])
    signs = unpack_signs(st["sign_m"], v.numel()).view(magnitude.shape)
    return torch.where(signs, magnitude, -magnitude), v


def state_tensors_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if isinstance(t, Tensor))


def piece_cuts(numel: int, cols: int) -> list[int]:
    """Where the test's shards of an n×``cols`` matrix start and end: on a sign byte, mid-byte and
    mid-row, with an empty piece."""
    return [0, 8 * (numel // 24), numel // 2 + 1, numel // 2 + 1, numel - cols // 2, numel]


def updates_close(q: Tensor, p: Tensor, before: Tensor) -> Tensor:
    """Where fp32 weights ``q`` and ``p``, both stepped from ``before``, took the same update to 1e-4 of
    itself, give or take 4 ulp of the weight and of the largest update (a 0.1% error in ``lr`` is caught,
    summation order is not)."""
    update = (p - before).abs()
    eps = torch.finfo(p.dtype).eps
    largest = update.max() if update.numel() else 0.0
    return (q - p).abs() <= 1e-4 * update + 4 * eps * (before.abs() + largest) + 1e-30


def copy_state_(dst: dict, src: dict) -> None:
    """``src``'s state into ``dst``'s own tensors, in place (addresses kept); both hold the same entries."""
    assert dst.keys() == src.keys()
    for key, value in src.items():
        if isinstance(value, Tensor):
            assert dst[key].shape == value.shape, key
            dst[key].copy_(value)
        else:
            assert dst[key] == value, key


def copied_state(state: dict) -> dict:
    """A state whose tensors are copies (the other entries shared)."""
    return {key: value.clone() if isinstance(value, Tensor) else value for key, value in state.items()}


def piece_state(state: dict, lo: int, hi: int) -> dict:
    """The state a shard holding elements ``lo .. hi`` keeps: the factors whole, its own sign (and
    flag) bits."""
    from smmf.matrix import pack_signs

    numel = state["row_v"].numel() * state["col_v"].numel()  # V's n×m view: every element
    local = copied_state(state)
    for key in ("sign_m", "flag_m"):
        if key in state:
            local[key] = pack_signs(unpack_signs(state[key], numel)[lo:hi])
    return local


def step_in_pieces(shard_step, weight: Tensor, grad: Tensor, state: dict, cfg, cuts: list[int]) -> Tensor:
    """One step of a matrix's weight taken as FSDP2 shards take it, in one process: each piece
    ``cuts[i] .. cuts[i + 1]`` of the row-major flattening goes through ``shard_step`` (a kernel's
    shard pass, ``(weight, grad, state, cfg, start)``) with its own copy of the factors and its own
    sign bits; the raw sums the pieces leave are added up and normalized as the all-reduce does.
    Updates ``state`` in place; returns the new weight, flat."""
    from smmf.matrix import store_factors_
    from smmf.matrix import pack_signs

    has_m = "sign_m" in state
    pieces, bits, sums = [], [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        local = piece_state(state, lo, hi)
        piece = weight.reshape(-1)[lo:hi].clone()
        shard_step(piece, grad.reshape(-1)[lo:hi].clone(), local, cfg, lo)
        pieces.append(piece)
        if has_m:
            bits.append(unpack_signs(local["sign_m"], hi - lo))
        sums.append({key: local[key] for key in ("row_v", "col_v", "row_m", "col_m") if key in state})
    for row_key, col_key in (("row_v", "col_v"), ("row_m", "col_m")):
        if row_key in state:
            store_factors_(state, row_key, col_key, sum(s[row_key] for s in sums), sum(s[col_key] for s in sums))
    if has_m:
        state["sign_m"] = pack_signs(torch.cat(bits))
    return torch.cat(pieces)


def levels_step_in_pieces(shard_step, weight: Tensor, grad: Tensor, state: dict, cfg, row_cuts: list[int]) -> Tensor:
    """One step of a param under the levels code taken as FSDP2 ``Shard(0)`` shards take it, in one process:
    each piece of whole rows ``row_cuts[i] .. row_cuts[i + 1]`` of the param goes through ``shard_step``
    with its own copy of V's factors and its own rows' codes and scales; V's raw sums are added up and
    normalized as the all-reduce does. Updates ``state`` in place; returns the new weight, flat."""
    from smmf.matrix import store_factors_

    cols = weight[0].numel()
    pieces, locals_ = [], []
    for r0, r1 in zip(row_cuts[:-1], row_cuts[1:]):
        local = copied_state(state)
        local["codes_m"], local["scales_m"] = state["codes_m"][r0:r1].clone(), state["scales_m"][r0:r1].clone()
        piece = weight.reshape(-1)[r0 * cols : r1 * cols].clone()
        shard_step(piece, grad.reshape(-1)[r0 * cols : r1 * cols].clone(), local, cfg, r0 * cols)
        pieces.append(piece)
        locals_.append(local)
    store_factors_(state, "row_v", "col_v", sum(x["row_v"] for x in locals_), sum(x["col_v"] for x in locals_))
    for key in ("codes_m", "scales_m"):
        state[key] = torch.cat([x[key] for x in locals_])
    return torch.cat(pieces)


def pieces_match_whole(shard_step, device: str, dtype: torch.dtype, tol: float, momentum_shape: str = "square",
                       large: tuple[tuple[int, int], ...] = ((300, 1000),)) -> None:
    """:func:`step_in_pieces` equals the torch path's step of the whole matrix, over 3 steps from
    identical inputs: matrices whose width is a multiple of 8 and not, cut at a sign byte, mid-byte
    and mid-row, with an empty piece, and ``large`` ones; with and without the first moment
    (``momentum_shape``: M's view)."""
    from smmf.functional import StepConfig, torch_step_
    from smmf.state import MomentumCode, init_state, matrix_shape

    gen = torch.Generator().manual_seed(3)
    for shape in [(48, 64), (31, 9), (257, 33), *large]:
        for beta in (0.9, None):
            p = torch.randn(shape, generator=gen).to(device, dtype)
            state = init_state(p, {"beta": beta, "vector_reshape": True, "momentum_shape": momentum_shape})
            numel, cols = p.numel(), matrix_shape(p)[1]
            cuts = piece_cuts(numel, cols)
            for step in range(1, 4):
                cfg = StepConfig(lr=1e-2, beta1=None if beta is None else 0.9 * 0.999 ** (step - 1), beta2=0.9,
                                 eps=1e-8, weight_decay=0.1, decoupled_weight_decay=step != 2, maximize=step == 3,
                                 stochastic_rounding=False,
                                 code=MomentumCode.NO_M if beta is None else MomentumCode.SIGN)
                g = torch.randn(shape, generator=gen).to(device, dtype)
                whole, whole_state = p.clone(), copied_state(state)
                torch_step_(whole, g, whole_state, cfg)
                flat = step_in_pieces(shard_step, p, g, state, cfg, cuts)
                torch.testing.assert_close(flat.float(), whole.reshape(-1).float(), rtol=tol, atol=tol)
                for key in ("row_v", "col_v", "row_m", "col_m"):
                    if key in state:
                        scale = whole_state[key].abs().max().item()
                        torch.testing.assert_close(state[key], whole_state[key], rtol=tol, atol=tol * scale)
                if beta is not None:
                    flips = (unpack_signs(state["sign_m"], numel) != unpack_signs(whole_state["sign_m"], numel)).sum()
                    assert flips.item() <= max(1, 1e-3 * numel), flips  # |M| at float noise may differ
                p, state = whole, whole_state  # go on from identical inputs


STATE_TENSORS = ("row_m", "col_m", "sign_m", "row_v", "col_v")


def run_script(source: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def snapshot_of(opt: SMMF, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(opt: SMMF, params: list[torch.Tensor], saved: tuple[list[torch.Tensor], dict]) -> None:
    before_params, before = saved
    assert all(torch.equal(p, b) for p, b in zip(params, before_params))
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert after["state"].keys() == before["state"].keys()
    for pid, st in before["state"].items():
        assert after["state"][pid].keys() == st.keys()
        for key, value in st.items():
            got = after["state"][pid][key]
            assert type(got) is type(value) and torch.equal(torch.as_tensor(got), torch.as_tensor(value)), key


def assert_nothing_installed(opt: SMMF) -> None:
    """No step inside backward holds ``opt``: its ``zero_grad()`` clears the gradients, as in the ordinary loop."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for param in params:
        param.grad = torch.ones_like(param)
    opt.zero_grad()
    assert all(param.grad is None for param in params)


def trained_smmf(backend: str = "torch", steps: int = 3, **options) -> tuple[list[torch.nn.Parameter], SMMF]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(12))]
    opt = SMMF(params, lr=1e-2, backend=backend, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt
