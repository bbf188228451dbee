"""``SMMF.routes()``: which backend, kernel and launch steps each param, and why, without stepping anything."""

from __future__ import annotations

import pytest
import torch

import smmf
from smmf import SMMF
from smmf.kernels import available_backends

needs_numba = pytest.mark.skipif("numba" not in available_backends(), reason="needs numba")


@needs_numba
def test_each_param_is_routed_to_the_launch_its_size_dtype_layout_and_code_take() -> None:
    params = {
        "small": torch.nn.Parameter(torch.randn(64, 64)),
        "mid": torch.nn.Parameter(torch.randn(512, 512)),
        "large": torch.nn.Parameter(torch.randn(2048, 1024)),
        "bf16": torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16)),
        "strided": torch.nn.Parameter(torch.randn(64, 64).t()),
        "levels": torch.nn.Parameter(torch.randn(64, 64)),
        "flag": torch.nn.Parameter(torch.randn(64, 64)),
        "dense": torch.nn.Parameter(torch.randn(64)),
        "complex": torch.nn.Parameter(torch.randn(8, 8, dtype=torch.complex64)),
        "torch": torch.nn.Parameter(torch.randn(64, 64)),
    }
    opt = SMMF([{"params": [params[k] for k in ("small", "mid", "large", "bf16", "strided", "complex")]},
                {"params": [params["levels"]], **smmf.RECOMMENDED}, {"params": [params["flag"]], "magnitude_bits": 1},
                {"params": [params["dense"]], "vector_reshape": False},
                {"params": [params["torch"]], "backend": "torch"}])
    by_param = {name: route for name, route in zip(["small", "mid", "large", "bf16", "strided", "complex", "levels",
                                                    "flag", "dense", "torch"], opt.routes())}
    expected = {"small": ("numba", "many_kernel"), "mid": ("numba", "many_blocks_kernel"),
                "large": ("numba", "own launch"), "bf16": ("numba", "own launch"),
                "strided": ("numba", "own launch"), "complex": ("torch", "torch"),
                "levels": ("numba", "many_levels_kernel"), "flag": ("numba", "many_flag_kernel"),
                "dense": ("torch", "torch"), "torch": ("torch", "torch")}
    assert {name: (r.kernel, r.launch) for name, r in by_param.items()} == expected
    assert by_param["levels"].code == "levels" and by_param["flag"].code == "flag" and by_param["dense"].code == "dense"
    assert "backend='torch'" in by_param["torch"].why and "vector_reshape=False" in by_param["dense"].why
    assert "complex" in by_param["complex"].why and "under 65536 elements" in by_param["small"].why
    assert [(r.group, r.index) for r in opt.routes()][:3] == [(0, 0), (0, 1), (0, 2)]
    assert not opt.state  # nothing stepped or stored

    for param in params.values():
        param.grad = torch.ones_like(param)
    opt.step()
    assert [(r.kernel, r.launch) for r in opt.routes()] == list(expected.values())  # with state, the same


def test_routes_without_a_fused_backend_say_so() -> None:
    param = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float16))
    (route,) = SMMF([param]).routes()
    assert (route.kernel, route.launch, route.dtype, route.shape) == ("torch", "torch", torch.float16, (8, 8))
    assert "no installed fused backend takes torch.float16" in route.why
