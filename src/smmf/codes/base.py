"""What every code of M is made of: :class:`Code`, which each code's module subclasses once."""

from __future__ import annotations

from typing import Any, ClassVar, Generator, Optional, Protocol, Sequence

import torch
from torch import Tensor

from ..band import Band
from ..matrix import pack_signs, packed_sign_bytes, unpack_signs
from ..schema import COL_V, ROW_V, MomentumCode, StateField, TensorSpec

__all__ = ["BandRounds", "Code", "PieceState", "StepNumbers", "V_FIELDS"]

# V's rank-1 factors in its square view: every factored code keeps them, after M's.
V_FIELDS = (StateField(ROW_V, lambda d: (d.rows,), "factor"), StateField(COL_V, lambda d: (d.cols,), "factor"))

# The torch path's step of a band of rows (smmf.shards.band_rounds), from V's on: yields the tensors to add up
# across the ranks holding the matrix, is sent their sums, stores what they make and returns the band's owned
# elements' direction M / (√V + ε), flat.
BandRounds = Generator[list[Tensor], list[Tensor], Tensor]

# A piece's state with its place: the elements ``start .. start + numel`` of the param's row-major flattening.
PieceState = tuple[int, int, dict[str, Any]]


class StepNumbers(Protocol):
    """What a code's torch update reads of a step (:class:`smmf.functional.StepConfig` has them)."""

    @property
    def beta1(self) -> Optional[float]: ...

    @property
    def beta2(self) -> float: ...

    @property
    def eps(self) -> float: ...

    @property
    def levels_salt(self) -> Optional[int]: ...


class Code:
    """A code of M: how a param's state keeps its moments, and every rule that depends on it, in one module per
    code (:mod:`smmf.codes` registers each once).

    - ``member``: its name (:class:`smmf.schema.MomentumCode`), which the step's config carries to every path;
    - ``fields``: the tensors of its state (their keys, shape rules and dtypes), in the order the kernels take them;
    - ``magnitude_bits``: the value of the option that picks it among the codes of a first moment (None: another
      rule picks it, :func:`smmf.codes.choose`);
    - ``elementwise``: Adam's dense state (the vectors under ``vector_reshape=False``): the torch path steps it
      elementwise, a piece keeps its own elements' moments, and no sums cross ranks;
    - ``dithered``: it draws fresh noise at each step under ``momentum_rounding="stochastic"``
      (``StepConfig.levels_salt``);
    - ``by_param_rows``: its state is by rows of the param, in blocks: an FSDP2 shard of a vector (one row, cut
      anywhere) is stepped whole, and a piece that may cut its blocks takes rounds of its own
      (:func:`smmf.shards.levels_piece_rounds`);
    - ``shard_sums``: the factors whose raw sums a fused backend's shard pass leaves for the ranks to add up;
      ``flag_passes``: the shard takes the magnitude flag's two passes instead (:class:`smmf.kernels.FlagPass`).

    Its methods are its torch path (:meth:`elementwise_direction`, :meth:`torch_m`, :meth:`band_rounds`), the sizes of the sums its pieces add up
    across ranks (:meth:`round_sizes`) and a piece's state (:meth:`piece_layout`), which :meth:`cut` makes from
    the whole param's and :meth:`join` puts back together.
    """

    member: ClassVar[MomentumCode]
    fields: ClassVar[tuple[StateField, ...]]
    magnitude_bits: ClassVar[Optional[int]] = None
    elementwise: ClassVar[bool] = False
    dithered: ClassVar[bool] = False
    by_param_rows: ClassVar[bool] = False
    shard_sums: ClassVar[tuple[str, ...]] = (ROW_V, COL_V)
    flag_passes: ClassVar[bool] = False

    def elementwise_direction(self, g: Tensor, state: dict[str, Any], cfg: StepNumbers) -> Optional[Tensor]:
        """The torch path's direction of an elementwise state from the gradient ``g``; None for a factored one
        (:func:`smmf.functional._factored_update` makes V's, and asks :meth:`torch_m` for M)."""
        return None

    def torch_m(self, g: Tensor, state: dict[str, Any], cfg: StepNumbers) -> Optional[Tensor]:
        """The torch path on the whole n×m gradient matrix ``g`` (V's view): this step's M, in ``g``'s shape,
        with the state's M coded again from it; None without a first moment."""
        return None

    def band_rounds(self, g_flat: Tensor, state: dict[str, Any], cfg: StepNumbers, band: Band, v_sums: list[Tensor],
                    denominator: Tensor) -> BandRounds:
        """The torch path on ``band`` (V's view) of a param cut between ranks, after V's update: ``v_sums`` are V's
        band sums to add up, ``denominator`` √V + ε at the owned elements of ``g_flat``, the band's gradient."""
        raise NotImplementedError

    def round_sizes(self, rows: int, cols: int, m_rows: int, m_cols: int, world: int) -> list[list[int]]:
        """The sizes of the tensors each round of a piece's step adds up across ``world`` ranks, for V's
        ``rows`` × ``cols`` view and M's ``m_rows`` × ``m_cols`` one (:mod:`smmf.shards`)."""
        return [[rows, cols]]

    def piece_layout(self, layout: dict[str, TensorSpec], shape: tuple[int, ...], start: int,
                     numel: int) -> dict[str, TensorSpec]:
        """The state of a piece of a param of ``shape`` (``numel`` elements from ``start``), from the whole param's
        ``layout``: the factors whole, the packed bits of its own elements."""
        for field in self.fields:
            if field.bits and field.key in layout:
                layout[field.key] = TensorSpec((packed_sign_bytes(numel),), layout[field.key].dtype)
        return layout

    def cut(self, whole: dict[str, Any], shape: tuple[int, ...], start: int, numel: int) -> dict[str, Any]:
        """The state of the piece ``start .. start + numel`` of a param of ``shape`` whose whole state is ``whole``
        (tensors only), laid out as :meth:`piece_layout` lays it out: what a rank holding that piece keeps. Real
        params (ZeRO's buffers are real; ``start`` and ``numel`` count real elements)."""
        return {key: self._cut_own(key, shape, value, start, numel) if self._own(key) else value.clone()
                for key, value in whole.items()}

    def join(self, pieces: Sequence[PieceState], shape: tuple[int, ...], layout: dict[str, TensorSpec]) -> dict[str, Any]:
        """The whole state (``layout``: the param's) from the states of ``pieces`` that tile the param in order:
        the inverse of :meth:`cut`. A field that is not the elements' own (a factor) is the same in every piece of
        a tensor stepped across ranks: the first piece's is taken."""
        return {key: self._join_own(key, shape, pieces, spec) if self._own(key) else pieces[0][2][key].clone()
                for key, spec in layout.items()}

    def _own(self, key: str) -> bool:
        return next((field.own for field in self.fields if field.key == key), False)

    def _cut_own(self, key: str, shape: tuple[int, ...], value: Tensor, start: int, numel: int) -> Tensor:
        """A field of one packed bit per element (:func:`smmf.matrix.pack_signs`), from the piece's first."""
        return pack_signs(unpack_signs(value, start + numel)[start:])

    def _join_own(self, key: str, shape: tuple[int, ...], pieces: Sequence[PieceState], spec: TensorSpec) -> Tensor:
        return pack_signs(torch.cat([unpack_signs(state[key], numel) for _, numel, state in pieces])).view(spec.shape)

