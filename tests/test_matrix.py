"""The pure math: shape choice, NNMF, sign packing, schedules."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smmf.matrix import nnmf, pack_signs, packed_sign_bytes, square_matricize_shape
from smmf.schedules import beta1_at, beta2_at


def _brute_force_min_perimeter(numel: int) -> int:
    return min(n + numel // n for n in range(1, numel + 1) if numel % n == 0)


@settings(max_examples=2000, deadline=None)
@given(st.integers(min_value=1, max_value=10_000))
def test_shape_is_a_minimal_factorization(numel: int) -> None:
    n, m = square_matricize_shape(numel)
    assert n * m == numel
    assert n >= m >= 1
    assert n + m == _brute_force_min_perimeter(numel)


def test_shape_edge_cases() -> None:
    assert square_matricize_shape(1) == (1, 1)
    assert square_matricize_shape(0) == (0, 0)
    assert square_matricize_shape(9973) == (9973, 1)  # prime
    assert square_matricize_shape(768 * 3072) == (1536, 1536)
    assert square_matricize_shape(64 * 3 * 7 * 7) == (98, 96)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=4), st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(shape: list[int], seed: int) -> None:
    from smmf.matrix import unpack_signs

    gen = torch.Generator().manual_seed(seed)
    signs = torch.rand(shape, generator=gen) >= 0.5
    packed = pack_signs(signs)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_sign_bytes(signs.numel())
    assert torch.equal(unpack_signs(packed, signs.numel()).view(signs.shape), signs)


def test_pack_layout_is_little_endian_bits() -> None:
    signs = torch.tensor([True, False, False, False, False, False, False, True, True])
    assert pack_signs(signs).tolist() == [0b1000_0001, 0b0000_0001]


def test_nnmf_reconstructs_rank_one_exactly_and_zero_without_nan() -> None:
    a = torch.outer(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0]))
    r, c = nnmf(a)
    torch.testing.assert_close(torch.outer(r, c), a)
    r0, c0 = nnmf(torch.zeros(3, 2))
    assert torch.equal(r0, torch.zeros(3)) and torch.equal(c0, torch.zeros(2))


def test_schedules() -> None:
    assert beta2_at(-0.5, 1) == 0.0
    assert abs(beta2_at(-0.8, 10) - (1 - 10**-0.8)) < 1e-15
    assert abs(beta1_at(0.9, 0.999, 3) - 0.9 * 0.999**2) < 1e-15
    assert beta1_at(0.9, None, 100) == 0.9
