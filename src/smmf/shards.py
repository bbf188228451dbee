"""A rank's piece of a parameter (an FSDP2 shard, a piece of a DeepSpeed ZeRO partition): its band of the
n̂×m̂ matrix and its step, taken in rounds.

A piece owns a contiguous range ``[start, start + numel)`` of the parameter's row-major flattening, hence a
band of rows of V's n̂×m̂ view (its first and last rows possibly partial) and of M's own view. It updates its
weights and its own bits alone, but its factors are sums over the whole matrix: its step is a generator
(:data:`Rounds`) that yields the tensors to add up across the ranks holding the parameter, receives their sums,
stores what they make, and returns the NaN/inf gradient elements it met. Whatever path runs a piece (the torch
path, a fused backend's shard pass), the rounds of a code of M yield the same tensors:

- no first moment, and the levels code on whole rows of the parameter: ``[V's row sums, V's column sums]``;
- the paper's code: ``[V's row sums, V's column sums, |M|'s row sums, |M|'s column sums]``;
- the magnitude flag: ``[|M|'s row sums, |M|'s column sums]``, then ``[its 4 gain sums, V's row sums, V's column
  sums]`` (the flag is fit against the new factors of |M|, so it needs the first round's sums);
- the levels code on a piece that may cut its blocks (:func:`levels_piece_rounds`): ``[V's row sums, V's column
  sums, two block maxima per rank]``.

Row sums are whole-length vectors, 0 for the rows a piece lacks, so their sum over ranks is the single-device
sum; so the factors, and therefore the updates, are the single-device ones. Callers lay out one buffer for the
rounds of every piece of a step and add it up in one collective per round (:func:`run_rounds`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Generator, Optional, Sequence

import torch
from torch import Tensor

from .band import Band
from .codes import CODES
from .codes.flag import flag_gains
from .functional import Nonfinite, StepConfig, prepare_grad_, write_back_
from .kernels.contract import Backend, FlagPass, LevelsPieces
from .levels import block_span, decode_piece_levels, encode_piece_levels, piece_block_maxima, piece_blocks
from .matrix import store_factors_
from .state import CODES_M, COL_M, COL_V, FLAG_GAINS_M, ROW_M, ROW_V, SCALES_M, real_view

__all__ = ["Rounds", "add_counts", "band_update", "fused_shard_rounds", "levels_piece_rounds", "run_rounds",
           "torch_shard_rounds"]

# A piece's step: yields the tensors to add up across ranks, is sent their sums, returns its NaN/inf count.
Rounds = Generator[list[Tensor], list[Tensor], Nonfinite]
# Sums partial row/column sums across the ranks that share a matrix.
Reducer = Callable[[list[Tensor]], list[Tensor]]


def band_rounds(g_flat: Tensor, state: dict[str, Any], cfg: StepConfig,
                band: Band) -> Generator[list[Tensor], list[Tensor], Tensor]:
    """:func:`smmf.functional._factored_update` on a band, in rounds (the module docstring): V's band here, M's and
    the rounds by its code (:meth:`smmf.codes.Code.band_rounds`); returns the owned elements' direction
    ``M / (√V + ε)``, flat, with the factors (and the flag's gains) stored.

    ``band`` is in V's (square) view; M has its own band, the same elements in M's view (its rows are
    dim 0 under ``momentum_shape="natural"``). The levels code codes M by rows of the param: the band
    must hold whole rows of it (an FSDP2 ``Shard(0)`` shard), its codes and scales being its own."""
    g = band.to_matrix(g_flat)
    v = torch.outer(state[ROW_V][band.row0 : band.row1], state[COL_V]).mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
    band.zero_padding_(v)
    v_sums = band.sums(v)
    denominator = band.owned(v.sqrt_().add_(cfg.eps))  # at the owned elements
    return (yield from CODES[cfg.code].band_rounds(g_flat, state, cfg, band, v_sums, denominator))


def band_update(g_flat: Tensor, state: dict[str, Any], cfg: StepConfig, band: Band, reduce: Reducer) -> Tensor:
    """:func:`band_rounds` with each round's sums added up by ``reduce``: the owned elements' direction, flat."""
    rounds = band_rounds(g_flat, state, cfg, band)
    sums = next(rounds)
    while True:
        try:
            sums = rounds.send(reduce(sums))
        except StopIteration as done:
            return done.value


def torch_shard_rounds(weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig, start: int) -> Rounds:
    """The step of a piece on the torch path, in rounds: ``weight`` and ``grad`` hold the elements ``start ..``
    of the param's row-major flattening, ``state`` its rank-local state (whole factor vectors, its own bits).
    As :func:`smmf.functional.torch_step_`, the weights are written in their dtype (bf16 rounded by the
    elements' index in the whole param)."""
    real = real_view(weight)
    work = real.to(state[ROW_V].dtype).contiguous()
    g, nonfinite = prepare_grad_(grad, work, cfg)
    band = Band.of_range(state[ROW_V].numel(), state[COL_V].numel(), start, work.numel())
    direction = yield from band_rounds(g.view(-1), state, cfg, band)
    work.view(-1).add_(direction, alpha=-cfg.lr)
    if work is not real:
        write_back_(real, work, rounding_key=cfg.rounding_key_for(real.dtype), first=start)
    return nonfinite


def fused_shard_rounds(backend: Backend, weight: Tensor, grad: Tensor, state: dict[str, Any], cfg: StepConfig,
                       start: int) -> Rounds:
    """The step of a piece on a fused ``backend`` (:meth:`smmf.kernels.Backend.shard_step_`, and the magnitude
    flag's two passes), in rounds. ``weight`` as for :func:`torch_shard_rounds`; a strided one goes through a
    contiguous copy. The levels code: a piece of whole rows of the param (its codes and scales its own)."""
    work = weight if weight.is_contiguous() else weight.contiguous()
    code = CODES[cfg.code]
    if not code.flag_passes:
        found = backend.shard_step_(work, grad, state, cfg, start)
        if work is not weight:
            weight.copy_(work)
        keys = code.shard_sums
        sums = yield [state[key] for key in keys]
        for row_key, col_key, row_sums, col_sums in zip(keys[::2], keys[1::2], sums[::2], sums[1::2]):
            store_factors_(state, row_key, col_key, row_sums, col_sums)
        return found
    flag = FlagPass(0, torch.empty_like(state[ROW_M]), torch.empty_like(state[COL_M]), state[ROW_M].new_empty(4))
    counts = [backend.flag_shard_pass_(work, grad, state, cfg, start, flag)]
    # V's raw sums come from the pass that steps the weights; kept aside when that is the first, whose pass
    # after reads neither V nor its factors.
    v_sums = [state[ROW_V].clone(), state[COL_V].clone()] if backend.updating_flag_pass(cfg) == 0 else None
    new_row_m, new_col_m = yield [flag.new_row_m, flag.new_col_m]
    store_factors_({ROW_M: flag.new_row_m, COL_M: flag.new_col_m}, ROW_M, COL_M, new_row_m, new_col_m)
    flag = flag._replace(number=1)
    counts.append(backend.flag_shard_pass_(work, grad, state, cfg, start, flag))
    if work is not weight:
        weight.copy_(work)
    sums = yield [flag.gain_sums] + (v_sums or [state[ROW_V], state[COL_V]])
    store_factors_(state, ROW_V, COL_V, sums[1], sums[2])
    state[ROW_M].copy_(flag.new_row_m)
    state[COL_M].copy_(flag.new_col_m)
    state[FLAG_GAINS_M].copy_(flag_gains(sums[0]))
    return add_counts(counts)


def levels_piece_rounds(backend: Optional[LevelsPieces], weight: Tensor, grad: Tensor, state: dict[str, Any],
                        cfg: StepConfig, shape: tuple[int, ...], start: int, ranges: Sequence[tuple[int, int]],
                        rank: int) -> Rounds:
    """The levels code's step (``magnitude_bits=3``) of a piece that may start and end inside blocks of M's code, in
    one round: V's sums, and the largest |M| of the piece's first and last blocks in slots ``2·rank`` and
    ``2·rank + 1`` of ``2·len(ranges)`` (those of the other ranks 0), so that one sum across ranks gathers every
    rank's; each cut block's scale is then the largest over the ranks that hold a part of it, as on one device.
    ``shape``: the param's; ``ranges``: ``(start, numel)`` of its piece on each rank (this one's at ``rank``).
    ``state`` holds this piece's codes (two per byte from its first element) and the scales of the blocks it
    touches (:func:`smmf.levels.piece_blocks`). On ``backend``'s kernel where given (the same element math as its
    step of a whole tensor), else on the torch path."""
    assert cfg.beta1 is not None, "the levels code is a code of M"
    numel = weight.numel()
    if backend is not None:
        found, ends = backend.levels_piece_pass_(weight, grad, state, cfg, shape, start)
        sums = yield [state[ROW_V], state[COL_V], _end_slots(ends.tops, len(ranges), rank)]
        store_factors_(state, ROW_V, COL_V, sums[0], sums[1])
        backend.levels_piece_ends_(state, cfg, shape, start, numel, ends,
                                   _ends_over_ranks(shape, start, numel, ranges, sums[2], ends.tops))
        return found
    real = real_view(weight)
    work = real.to(state[ROW_V].dtype).contiguous()
    g, nonfinite = prepare_grad_(grad, work, cfg)
    g = g.view(-1)
    blocks = piece_blocks(shape, math.prod(shape), start, numel, work.device)
    m = decode_piece_levels(state[CODES_M], state[SCALES_M], blocks, work.dtype)
    m.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
    band = Band.of_range(state[ROW_V].numel(), state[COL_V].numel(), start, numel)
    v = torch.outer(state[ROW_V][band.row0 : band.row1], state[COL_V]).mul_(cfg.beta2)
    gm = band.to_matrix(g)
    v.addcmul_(gm, gm, value=1.0 - cfg.beta2)
    band.zero_padding_(v)
    v_sums = band.sums(v)
    work.view(-1).add_(m / band.owned(v.sqrt_().add_(cfg.eps)), alpha=-cfg.lr)
    maxima = piece_block_maxima(m, blocks)
    tops = torch.stack([maxima[0], maxima[-1]])
    sums = yield v_sums + [_end_slots(tops, len(ranges), rank)]
    store_factors_(state, ROW_V, COL_V, sums[0], sums[1])
    maxima[0], maxima[-1] = _ends_over_ranks(shape, start, numel, ranges, sums[2], tops).unbind()
    codes, scales = encode_piece_levels(m, maxima, blocks, cfg.levels_salt, start)
    state[CODES_M].copy_(codes)
    state[SCALES_M].copy_(scales)
    if work is not real:
        write_back_(real, work, rounding_key=cfg.rounding_key_for(real.dtype), first=start)
    return nonfinite


def _end_slots(tops: Tensor, world: int, rank: int) -> Tensor:
    """This rank's largest |M| of its piece's first and last blocks in its two of ``2·world`` slots."""
    slots = tops.new_zeros(2 * world)
    slots[2 * rank : 2 * rank + 2] = tops
    return slots


def _ends_over_ranks(shape: tuple[int, ...], start: int, numel: int, ranges: Sequence[tuple[int, int]],
                     slots: Tensor, tops: Tensor) -> Tensor:
    """The largest |M| of the piece's first and last blocks over every rank holding a part of them, from the
    ranks' summed slots (:func:`_end_slots`): a piece's other blocks are its own alone."""
    total = math.prod(shape)
    mine = block_span(shape, total, start, numel)
    out = tops.clone()
    for other, (other_start, other_numel) in enumerate(ranges):
        if other_numel:
            for end, block in enumerate(block_span(shape, total, other_start, other_numel)):
                for at, my_block in enumerate(mine):
                    if block == my_block:
                        out[at] = torch.maximum(out[at], slots[2 * other + end])
    return out


def run_rounds(rounds: Sequence[Optional[Rounds]], count: int,
               add_up: Callable[[int, list[Optional[list[Tensor]]]], list[Optional[list[Tensor]]]]) -> list[Nonfinite]:
    """Advance every piece's rounds together, ``count`` rounds: at round ``r``, ``add_up(r, yielded)`` gets what
    each piece yielded (None for a piece that is absent or done) and returns each one's sums (None where it
    yielded none). ``add_up`` is called ``count`` times whatever this rank holds, so that every rank makes the
    same collectives. Returns the NaN/inf counts of the pieces."""
    live = {i: gen for i, gen in enumerate(rounds) if gen is not None}
    found: list[Nonfinite] = []
    sent: dict[int, Optional[list[Tensor]]] = {i: None for i in live}
    for r in range(count + 1):
        yielded: list[Optional[list[Tensor]]] = [None] * len(rounds)
        for i in list(live):
            try:
                yielded[i] = live[i].send(sent[i])  # type: ignore[arg-type]  # None starts a generator
            except StopIteration as done:
                found.append(done.value)
                del live[i]
        if r == count:
            break
        summed = add_up(r, yielded)
        sent = {i: summed[i] for i in live}
    assert not live, "a piece's step took more rounds than its code has"
    return found


def add_counts(found: Sequence[Nonfinite]) -> Nonfinite:
    """The NaN/inf counts of several steps added up (None where none counted)."""
    counted = [n for n in found if n is not None]
    return sum(counted[1:], counted[0]) if counted else None

