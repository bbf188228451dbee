"""The pieces of tensors a DeepSpeed ZeRO partition holds (smmf.partitions, smmf.shards), in one process: the levels
code's pieces that cut its blocks step as the whole tensor does, on numba and on the torch path; a partition's
checks refuse what is not its pieces' state. (DeepSpeed itself: tests/test_deepspeed.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import FUSED_BACKENDS, updates_close
from smmf.codes import BIT_FIELDS
from smmf.functional import StepConfig, torch_step_
from smmf.matrix import unpack_signs
from smmf.levels import piece_blocks
from smmf.partitions import PIECES, PLACES, CutTensor, Partition, Piece, check_pieces, exchange, init_pieces, piece_layout
from smmf.shards import levels_piece_rounds, run_rounds
from smmf.state import CODES_M, COL_V, ROW_V, SCALES_M, STEP, MomentumCode, init_state

LEVELS = {"beta": 0.9, "vector_reshape": True, "magnitude_bits": 3, "momentum_shape": "square"}


def _piece_of(whole: dict, shape: tuple[int, ...], start: int, numel: int) -> dict:
    """The state a piece of elements ``start .. start + numel`` keeps, cut from a whole tensor's: V's factors whole,
    its own codes from its first element, the scales of the blocks it touches."""
    piece = Piece(0, shape, start, numel, 0)
    state = {key: torch.zeros(spec.shape, dtype=spec.dtype) for key, spec in piece_layout(piece, LEVELS, torch.float32).items()}
    state[ROW_V].copy_(whole[ROW_V])
    state[COL_V].copy_(whole[COL_V])
    codes = whole[CODES_M]
    nibbles = torch.stack([codes & 15, codes >> 4], dim=2).view(codes.shape[0], -1)[:, : math.prod(shape) // codes.shape[0]]
    nibbles = torch.nn.functional.pad(nibbles.reshape(-1)[start : start + numel], (0, numel % 2))
    state[CODES_M].copy_(nibbles[0::2] | (nibbles[1::2] << 4))
    blocks = piece_blocks(shape, math.prod(shape), start, numel, torch.device("cpu"))
    state[SCALES_M].copy_(whole[SCALES_M].reshape(-1)[blocks.first : blocks.last + 1])
    state[STEP] = whole[STEP]
    return state


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("shape", [(300, 129), (2100,), (7, 300)], ids=["rows-of-129", "vector", "rows-of-300"])
def test_levels_pieces_that_cut_blocks_step_as_the_whole_tensor(backend: str, shape: tuple[int, ...]) -> None:
    """Three pieces cut mid-block and mid-byte (odd starts), their rounds added up as the ranks' all-reduce adds
    them: every step the codes and scales are the whole tensor's on the same backend, and the weights take the same
    update (the order of V's sums aside); stochastic rounding of the levels, 5 steps."""
    if backend == "numba" and "numba" not in FUSED_BACKENDS:
        pytest.skip("needs numba")
    from smmf.kernels import load_backend

    fused = load_backend("numba") if backend == "numba" else None
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(shape, generator=gen)
    whole_state, whole = init_state(weight, LEVELS), weight.clone()
    numel = weight.numel()
    cuts = [0, numel // 3 + 1, numel // 2 + 3, numel]
    ranges = [(lo, hi - lo) for lo, hi in zip(cuts[:-1], cuts[1:])]
    pieces = [weight.reshape(-1)[lo:hi].clone() for lo, hi in zip(cuts[:-1], cuts[1:])]
    states = [_piece_of(whole_state, shape, lo, count) for lo, count in ranges]
    for step in range(1, 6):
        cfg = StepConfig(lr=1e-2, beta1=0.9, beta2=1 - step ** -0.8, eps=1e-8, weight_decay=0.01,
                         decoupled_weight_decay=True, maximize=False, stochastic_rounding=False,
                         code=MomentumCode.LEVELS, levels_salt=1000 + step)
        grad = torch.randn(shape, generator=gen)
        before = whole.clone()
        whole_state[STEP] += 1
        if fused is None:
            torch_step_(whole, grad, whole_state, cfg)
        else:
            fused.steps_([(whole, grad, whole_state, cfg)])
        rounds = [levels_piece_rounds(fused, pieces[r], grad.reshape(-1)[lo : lo + count], states[r], cfg, shape, lo,
                                      ranges, r) for r, (lo, count) in enumerate(ranges)]

        def add_up(_: int, yielded: list) -> list:
            total = [sum(parts) for parts in zip(*yielded)]
            return [total] * len(yielded)

        run_rounds(rounds, 1, add_up)
        for state, (lo, count) in zip(states, ranges):
            expected = _piece_of(whole_state, shape, lo, count)
            assert torch.equal(state[CODES_M], expected[CODES_M]) and torch.equal(state[SCALES_M], expected[SCALES_M])
            torch.testing.assert_close(state[ROW_V], whole_state[ROW_V], rtol=1e-5, atol=0)
        assert updates_close(torch.cat(pieces), whole.reshape(-1), before.reshape(-1)).all()


def test_a_partition_refuses_pieces_that_do_not_tile_a_tensor() -> None:
    with pytest.raises(RuntimeError, match="do not tile"):
        exchange([Piece(0, (10, 3), 0, 20, 0)], rank=0, world=1, process_group=None)
    partition = exchange([Piece(0, (10, 3), 0, 30, 0), Piece(1, (4,), 0, 4, 30)], rank=0, world=1, process_group=None)
    assert partition.cut == () and [piece.whole for piece in partition.pieces] == [True, True]


def test_a_partitions_state_must_be_its_pieces() -> None:
    """What the step checks before it changes anything: the pieces this rank holds (a checkpoint of another layout),
    the keys SMMF keeps (another optimizer's, as DeepSpeed's universal checkpoint loads them), the layout options."""
    flat = torch.zeros(40)
    cut = CutTensor(0, (10, 3), ((0, 20), (20, 10)))
    partition = Partition((Piece(0, (10, 3), 0, 20, 0), Piece(1, (10,), 0, 10, 20)), (cut,), 0, 2, None)
    held = init_pieces(partition, LEVELS, flat)
    check_pieces(partition, LEVELS, flat, held, "here")
    assert held[PIECES][0][CODES_M].shape == (10,)  # 20 codes, two per byte
    with pytest.raises(RuntimeError, match="universal checkpoint"):
        check_pieces(partition, LEVELS, flat, {**held, "exp_avg": torch.zeros(40)}, "here")
    with pytest.raises(RuntimeError, match="another number of ranks"):
        check_pieces(partition, LEVELS, flat, {**held, PLACES: {0: ((10, 3), 0, 30), 1: ((10,), 0, 10)}}, "here")
    with pytest.raises(RuntimeError, match="cannot change mid-run"):
        check_pieces(partition, {**LEVELS, "magnitude_bits": 0}, flat, held, "here")


CUT_CASES = {"paper": ((129, 37), {}), "natural": ((129, 37), {"momentum_shape": "natural"}),
             "flag": ((300, 7), {"magnitude_bits": 1}), "levels": ((7, 300), {"magnitude_bits": 3}),
             "levels-vector": ((2100,), {"magnitude_bits": 3}), "no-first-moment": ((129, 37), {"beta": None}),
             "dense-vector": ((2100,), {"vector_reshape": False})}


@pytest.mark.parametrize("case", CUT_CASES)
def test_a_tensors_state_cut_into_pieces_joins_back_whole_bit_for_bit(case: str) -> None:
    """A plain SMMF's state of a tensor after 3 steps, cut into pieces mid-byte, mid-row and mid-block
    (``cut_piece_state``, what a ZeRO rank holding each piece keeps), then joined (``join_piece_states``): every
    tensor of the state as it was, for every code of M; each piece laid out as ``piece_layout`` says."""
    from smmf import SMMF
    from smmf.partitions import cut_piece_state, join_piece_states

    shape, options = CUT_CASES[case]
    gen = torch.Generator().manual_seed(5)
    param = torch.nn.Parameter(torch.randn(shape, generator=gen))
    optimizer = SMMF([param], lr=1e-2, backend="torch", **options)
    for _ in range(3):
        param.grad = torch.randn(shape, generator=gen)
        optimizer.step()
    whole, group, numel = optimizer.state[param], optimizer.param_groups[0], param.numel()
    cuts = [0, 8 * (numel // 24) + 3, numel // 2 + 1, numel - 129, numel]
    pieces = []
    for start, end in zip(cuts[:-1], cuts[1:]):
        piece = Piece(0, shape, start, end - start, 0)
        state = cut_piece_state(whole, piece, group, torch.float32)
        layout = piece_layout(piece, group, torch.float32)
        assert set(state) == set(layout) | {STEP} and state[STEP] == 3
        assert all(tuple(state[key].shape) == spec.shape and state[key].dtype == spec.dtype for key, spec in layout.items())
        for key in BIT_FIELDS & state.keys():  # each element's bit, read back from the flat packing directly
            assert torch.equal(unpack_signs(state[key], end - start), unpack_signs(whole[key], numel)[start:end]), key
        pieces.append((start, end - start, state))
    joined = join_piece_states(pieces[::-1], shape, group, torch.float32, "a test")  # in any order
    assert joined.keys() == whole.keys() and joined[STEP] == 3
    for key, value in whole.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(joined[key], value), key


def test_the_levels_cut_is_the_state_a_piece_keeps() -> None:
    """``cut_piece_state`` of the levels code against this file's own cut (``_piece_of``), which the rounds of a
    piece were checked against above: the same codes and scales for pieces that cut blocks and bytes."""
    from smmf.partitions import cut_piece_state

    shape = (7, 300)
    whole = init_state(torch.zeros(shape), LEVELS)
    gen = torch.Generator().manual_seed(0)
    whole[CODES_M].copy_(torch.randint(0, 256, whole[CODES_M].shape, generator=gen, dtype=torch.uint8))
    whole[SCALES_M].copy_(torch.rand(whole[SCALES_M].shape, generator=gen))
    for start, count in [(0, 1), (1, 300), (299, 2), (257, 1000), (1500, 600)]:
        mine = cut_piece_state(whole, Piece(0, shape, start, count, 0), LEVELS, torch.float32)
        theirs = _piece_of(whole, shape, start, count)
        assert torch.equal(mine[CODES_M], theirs[CODES_M]) and torch.equal(mine[SCALES_M], theirs[SCALES_M])


def test_pieces_that_do_not_tile_a_tensor_or_differ_in_step_are_not_joined() -> None:
    from smmf.partitions import join_piece_states

    group = {**LEVELS, "beta": 0.9}
    whole = init_state(torch.zeros(10, 10), group)
    state = {**whole, STEP: 2}
    with pytest.raises(ValueError, match="do not tile it"):
        join_piece_states([(0, 40, state), (50, 50, state)], (10, 10), group, torch.float32, "parameter 3")
    with pytest.raises(ValueError, match="different steps"):
        join_piece_states([(0, 50, state), (50, 50, {**state, STEP: 3})], (10, 10), group, torch.float32, "p")
