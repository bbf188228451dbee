"""Shared test helpers: the shape zoo, state reconstruction, backends to test."""

from __future__ import annotations

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
