"""The part of a param's n×m matrix that a piece of it holds (an FSDP2 shard, a piece of a DeepSpeed ZeRO partition):
its rows, the elements it owns, their sums as whole-length vectors, and its own packed bits."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .matrix import factor_sums, pack_signs

__all__ = ["Band", "store_bits_"]


@dataclass(frozen=True)
class Band:
    """The part of the n×m matrix that a tensor holds: rows ``[row0, row1)``, of whose row-major
    flattening the tensor owns ``numel`` elements from ``first`` on (a shard's first and last rows
    may be partial)."""

    rows: int
    cols: int
    row0: int
    row1: int
    first: int
    numel: int

    @classmethod
    def of_range(cls, rows: int, cols: int, start: int, numel: int) -> "Band":
        row0 = start // cols if cols else 0
        row1 = -(-(start + numel) // cols) if numel else row0
        return cls(rows, cols, row0, row1, start - row0 * cols, numel)

    @property
    def start(self) -> int:
        """The first owned element in the row-major flattening."""
        return self.row0 * self.cols + self.first

    def in_view(self, rows: int, cols: int) -> "Band":
        """The same elements in another rows × cols view of the tensor."""
        return Band.of_range(rows, cols, self.start, self.numel)

    @property
    def padded(self) -> bool:
        return self.first != 0 or self.numel != (self.row1 - self.row0) * self.cols

    def to_matrix(self, flat: Tensor) -> Tensor:
        if not self.padded:
            return flat.view(self.row1 - self.row0, self.cols)
        out = flat.new_zeros(self.row1 - self.row0, self.cols)
        out.view(-1)[self.first : self.first + self.numel] = flat
        return out

    def owned(self, matrix: Tensor) -> Tensor:
        """The owned elements of a band matrix, flat."""
        return matrix.reshape(-1)[self.first : self.first + self.numel]

    def zero_padding_(self, matrix: Tensor) -> None:
        if self.padded:
            flat = matrix.view(-1)
            flat[: self.first] = 0
            flat[self.first + self.numel :] = 0

    def sums(self, matrix: Tensor) -> list[Tensor]:
        """The band matrix's row sums, as a whole-length vector (0 for the rows it lacks), and column
        sums; each element capped as on the whole matrix (:func:`smmf.matrix.factor_sums`)."""
        row_sums, col_sums = factor_sums(matrix, numel=self.rows * self.cols)
        full_rows = matrix.new_zeros(self.rows)
        full_rows[self.row0 : self.row1] = row_sums
        return [full_rows, col_sums]


def store_bits_(packed: Tensor, bits: Tensor) -> None:
    """This rank's bits, packed, at the start of its (padded) byte range."""
    values = pack_signs(bits)
    packed[: values.numel()].copy_(values)
