"""The pieces of tensors a DeepSpeed ZeRO partition holds (smmf.partitions, smmf.shards), in one process: the levels
code's pieces that cut its blocks step as the whole tensor does, on numba and on the torch path; a partition's
checks refuse what is not its pieces' state. (DeepSpeed itself: tests/test_deepspeed.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import FUSED_BACKENDS, updates_close
from smmf.functional import StepConfig, torch_step_
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
