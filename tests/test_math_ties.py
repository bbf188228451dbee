"""Where a piece of math has a second copy in a kernel (the numba loops cannot call torch), a test
ties the copy to the readable one on the values that tell them apart."""

from __future__ import annotations

import pytest
import torch

from smmf.codes.flag import flag_gains




def test_numba_bf16_rounding_is_torchs() -> None:
    numba = pytest.importorskip("numba")
    """The numba kernels' bf16 store (nearest even, NaN kept NaN) writes what ``Tensor.to(bfloat16)``
    writes, on ties, the largest values, infinities, NaNs and subnormals."""
    import numpy as np

    from smmf.kernels.numba_cpu.access import store

    @numba.njit
    def store_all(dst, row):
        store(dst, 0, row, False, 0)

    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00008000, 0x80018000,
                         0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF], dtype=torch.int64)
    values = torch.cat([bits.to(torch.int32).view(torch.float32), torch.randn(1000) * 1e3,
                        torch.randn(1000) * 1e-38])
    out = torch.zeros(values.numel(), dtype=torch.bfloat16)
    store_all(out.view(torch.int16).numpy(), values.numpy().astype(np.float32))
    expected = values.to(torch.bfloat16)
    same = (out.view(torch.int16) == expected.view(torch.int16)) | (out.isnan() & expected.isnan())
    assert bool(same.all()), values[~same]


def test_numba_bf16_stochastic_rounding_adds_the_hash_of_its_index() -> None:
    numba = pytest.importorskip("numba")
    """Under stochastic rounding element j of a row written from ``noise_base`` adds the top 16 bits of
    :func:`smmf.noise.mix32` (``noise_base + j``) below the bits bf16 keeps (mod 2³², as the kernel's 32-bit
    lanes), then truncates; NaN stays NaN."""
    import numpy as np

    from smmf.kernels.numba_cpu.access import store
    from smmf.noise import mix32

    @numba.njit
    def store_all(dst, row, base):
        store(dst, 0, row, True, base)

    values = torch.cat([torch.randn(3000) * 10, torch.tensor([float("nan"), 0.0, -0.0])])
    base = 2**32 - 1000  # wraps past 2³² within the row
    out = torch.zeros(values.numel(), dtype=torch.bfloat16)
    store_all(out.view(torch.int16).numpy(), values.numpy().astype(np.float32), base)
    index = (torch.arange(values.numel(), dtype=torch.int64) + base) & 0xFFFFFFFF
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    expected = (((bits + (mix32(index) >> 16)) >> 16) & 0xFFFF).to(torch.int32)
    got = out.view(torch.int16).to(torch.int32) & 0xFFFF
    finite = ~values.isnan()
    assert torch.equal(got[finite], expected[finite])
    assert out[~finite].isnan().all()


def test_numba_flag_levels_are_flag_levels() -> None:
    numba = pytest.importorskip("numba")
    """The levels the numba kernel makes from its level sums are :func:`smmf.codes.flag.flag_gains`'s,
    including an empty set (energy 0) and NaN/inf sums."""
    from smmf.kernels.numba_cpu.elements import flag_gain

    @numba.njit
    def levels(sums):
        return flag_gain(sums[0], sums[1]), flag_gain(sums[2], sums[3])

    gen = torch.Generator().manual_seed(0)
    cases = [torch.rand(4, generator=gen, dtype=torch.float64) for _ in range(50)]
    cases += [torch.tensor(s, dtype=torch.float64) for s in [[1.0, 0.0, 2.0, 4.0], [0.0, 0.0, 0.0, 0.0],
                                                             [float("inf"), 1.0, 1.0, float("inf")],
                                                             [1.0, float("nan"), float("nan"), 2.0]]]
    for dtype in (torch.float32, torch.float64):
        for sums in cases:
            got = torch.tensor(levels(sums.to(dtype).numpy()), dtype=dtype)
            torch.testing.assert_close(got, flag_gains(sums.to(dtype)), rtol=0, atol=0, equal_nan=True)


def test_the_cheap_layout_keys_are_state_layouts() -> None:
    """``check_state_fits`` compares key sets from ``_STATE_KEYS`` at every step; they must be
    :func:`smmf.state.state_layout`'s keys (and ``step``) for every code of M."""
    from smmf.state import _STATE_KEYS, STEP, momentum_code, state_layout

    for shape in [(7,), (5, 6), (3, 4, 5)]:
        p = torch.zeros(shape)
        for beta in (0.9, None):
            for vector_reshape in (True, False):
                for options in ({}, {"momentum_shape": "natural"}, {"magnitude_bits": 1}, {"magnitude_bits": 3}):
                    group = {"beta": beta, "vector_reshape": vector_reshape, **options}
                    keys = _STATE_KEYS[momentum_code(p, group), beta is not None]
                    assert keys == set(state_layout(p, group)) | {STEP}, (shape, group)
