"""Fused SMMF step on CUDA (Triton), the Triton backend of :class:`smmf.kernels.Backend`: the
contract of the numba kernel, on GPU tiles, many tensors per launch.

Contract (same as :func:`smmf.functional.torch_step_`): each ``param`` (fp32, bf16, fp16, or
complex with such a real view) is updated in place from its ``grad``; its state — ``row_m``/
``col_m``/``row_v``/``col_v``, the fp32 factors of the n̂×m̂ square-matricized view (M's in its own
view under ``momentum_shape="natural"``), ``sign_m``, the packed sign bits, and under
``magnitude_bits=1`` ``flag_m`` (packed like the signs) and the flag's gains — is rewritten in place.
``state['step']`` is already advanced. :func:`triton_steps_` takes a whole list of such tensors:
an optimizer step is a fixed number of launches whatever the number of tensors, as fused AdamW is one.

The launches, all deterministic (no floating-point atomics: a resumed run is bit-identical to an
uninterrupted one):

1. The step kernel of the launch set's code of M (:mod:`.sign`, :mod:`.flag`, :mod:`.none`; the pieces they
   share in :mod:`.step`): one program per work item, a (tensor, band of rows, column tile) triple. It
   walks its band in ``BR × BC`` tiles: reads the gradient, the weight and the sign bits once,
   rebuilds M̂ and V̂ from the factors, writes the weight and the new sign bits, and writes partial
   sums of |M| and V — per row of each tile (one slot per column tile) and per column of its band
   (one slot per band) — into an fp32 buffer of ~2/BC + 2/BAND_ROWS of the parameters' elements.
2. ``finish.finish_kernel``: per tensor and moment, sums the partials in a fixed order and writes the row
   factors and the column factors divided by the total (``smmf.matrix.nnmf_from_sums``).

With M in its natural shape, or with the magnitude flag, ``sums.momentum_sums_kernel`` sums |M| in M's
own view first (from the state before the step), so the step kernel only reads M's factors. The
flag needs the *new* factors before it can encode (F = [|M| > r cᵀ]), so for it the finish kernel
first writes them into the partial buffer, the step kernel decodes M with the old code and encodes
it against them (new sign and flag bits, and per work item the four sums of the levels' least-squares
fits), and ``finish.flag_finish_kernel`` copies the new factors into the state and makes the levels: five
launches.

Sign bits are laid out as :func:`smmf.matrix.pack_signs` specifies. When m̂ is a multiple of 8
every row is whole sign bytes and a tile reads and writes its own bytes. Otherwise a byte can
straddle two tiles; the kernel then ORs the new bits, 32 at a time, into a zeroed int32 scratch (OR
commutes, so this stays deterministic), which the finish kernel copies over the state: N/8 extra
bytes for those tensors only (twice that with the flag's bits).

Each tensor is described by one row of int64 in a table, a column per field (the ``T_*``
constants, :data:`TABLE_FIELDS`): the addresses of w, g, signs, row_m, col_m, row_v, col_v, then n,
m, column tiles, bands, its first work item, where its (V's) partial sums start and where its sign
scratch starts, the elements lo .. hi of the row-major flattening that w, g and the sign bits hold
(0 .. n·m, or an FSDP2 shard's range, whose first and last rows may be partial), M's own view:
columns, rows, column tiles, bands, the first work item of :func:`.sums.momentum_sums_kernel` and where
M's partial sums start (V's view unless ``momentum_shape="natural"``), and for the flag: the
addresses of its bits and gains, where the new factors of |M| and the gain sums sit in the
partial buffer, and where its bit scratch starts (0 without the flag). The
scalars of a launch (lr, β1_t, β2_t, …) are arguments, so tensors whose step configuration (or sign
alignment, or code of M) differs go to separate launches. They stay seven arguments, not a small array the
kernel reads: loaded, each is a register held through the loop, and under the 80-register cap the step kernels
spilled 8–40 bytes more a thread (``tests/triton_compile.py``). What a launch leaves out is an argument given as
None, which Triton compiles away: the bit scratch (every row is whole sign bytes), the NaN/inf count (NaN/inf
gradients are not zeroed) and the bf16 rounding keys (rounding to nearest).

An FSDP2 shard (:func:`triton_shard_step_`) is one launch over its rows; the finish kernel then
leaves the raw row and column sums in the factor vectors (rows the shard lacks get 0), for the caller
to add up across ranks and normalize, as the numba kernel's shards do; with the natural shape the
momentum sums kernel runs over the shard's rows of M's view first. Under the magnitude flag a shard
takes two calls (:func:`triton_flag_shard_pass_`), for the caller to add up the shards' sums of |M|
between them: the sums kernel, then the step kernel against the new factors.

The block-levels code of M (``magnitude_bits=3``) is coded by rows of the param, a view the step kernel
does not walk: its tensors take the kernels of :mod:`.levels`, many tensors per launch from the same table
(:func:`.table.levels_layout`): V's sums over its square view, the step over M's blocks, then the finish
kernel for V's factors — three launches per launch set, an FSDP2 shard's included.

Read top to bottom: :mod:`.table` (tile shape, the table's columns, launch geometry), :mod:`.tiles`
(element pieces the kernels share), :mod:`.step` (what the step kernels of every code share), :mod:`.sign`,
:mod:`.flag` and :mod:`.none` (a step kernel per code of M), :mod:`.sums` (the momentum sums kernel),
:mod:`.finish` (the finish kernels), :mod:`.levels` (the levels code's kernels), :mod:`.host` (launches).
"""

from __future__ import annotations

from .host import BACKEND, triton_flag_shard_pass_, triton_shard_step_, triton_step_, triton_steps_

__all__ = ["BACKEND", "triton_flag_shard_pass_", "triton_shard_step_", "triton_step_", "triton_steps_"]
