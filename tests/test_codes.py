"""Each code of M is one unit (smmf.codes): registered once, asked rather than named by the rest of the core, and
its declared rounds of sums are the ones its steps make."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from smmf.band import Band
from smmf.codes import CODES, MAGNITUDE_BITS, SCHEMA, choose
from smmf.functional import StepConfig
from smmf.options import step_config
from smmf.shards import band_rounds, levels_piece_rounds
from smmf.state import STEP, MomentumCode, init_state, matrix_shape, momentum_code, momentum_matrix_shape

SRC = Path(__file__).resolve().parents[1] / "src" / "smmf"
# Where a code may be named: its own modules, the schema that names them, and the kernel backends' registries of
# their kernels per code.
NAMES_CODES = ("codes", "schema.py", "kernels")

GROUP = {"lr": 1e-2, "beta": 0.9, "decay_rate": -0.8, "growth_rate": 0.999, "eps": 1e-8, "weight_decay": 0.0,
         "weight_decay_mode": "adamw", "maximize": False, "stochastic_rounding": False, "nonfinite_grads": "zero",
         "momentum_rounding": "nearest", "vector_reshape": True, "momentum_shape": "square", "magnitude_bits": 0}
OPTIONS = {MomentumCode.NO_M: {"beta": None}, MomentumCode.SIGN: {}, MomentumCode.FLAG: {"magnitude_bits": 1},
           MomentumCode.LEVELS: {"magnitude_bits": 3}}


def _names_a_code(path: Path) -> list[str]:
    """The lines of ``path`` that name a member of MomentumCode (``MomentumCode.SIGN``, ...)."""
    members = {code.name for code in MomentumCode}
    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in members
            and isinstance(node.value, ast.Name) and node.value.id == "MomentumCode"]


def test_the_core_asks_a_code_rather_than_naming_it() -> None:
    """Outside the codes, the schema and the kernel backends no module branches on which code a param has: it asks
    the code (``CODES[cfg.code]``), so that a new code is its own module and its kernels."""
    named = [line for path in SRC.rglob("*.py") if path.relative_to(SRC).parts[0] not in NAMES_CODES + ("bench",)
             for line in _names_a_code(path)]
    assert not named, f"modules that name a code of M: {named}"


def test_every_code_is_registered_once_under_its_name() -> None:
    assert set(CODES) == set(MomentumCode)
    assert all(code.member is member for member, code in CODES.items())
    assert SCHEMA == {member: code.fields for member, code in CODES.items()}
    picked = [code.magnitude_bits for code in CODES.values() if code.magnitude_bits is not None]
    assert sorted(picked) == list(MAGNITUDE_BITS) and len(set(picked)) == len(picked)
    for bits in MAGNITUDE_BITS:
        assert CODES[choose(False, True, bits)].magnitude_bits == bits
    assert CODES[choose(True, True, 0)].elementwise and not CODES[choose(False, False, 3)].fields[0].first_moment


def _answer(yielded: list[torch.Tensor]) -> list[torch.Tensor]:
    """A round's sums as one rank holding the whole matrix gets them: its own."""
    return [t.clone() for t in yielded]


@pytest.mark.parametrize("code", [MomentumCode.NO_M, MomentumCode.SIGN, MomentumCode.FLAG], ids=lambda c: c.value)
@pytest.mark.parametrize("shape", [(6, 10), (12, 5, 2)], ids=["matrix", "natural-3d"])
def test_a_bands_rounds_add_up_what_its_code_declares(code: MomentumCode, shape: tuple[int, ...]) -> None:
    """The torch path's rounds on a band yield, round by round, tensors of the sizes the code declares
    (``Code.round_sizes``, by which a ZeRO partition lays out one all-reduce for every cut tensor)."""
    group = {**GROUP, **OPTIONS[code], "momentum_shape": "natural"}
    param = torch.zeros(shape)
    assert momentum_code(param, group) is code
    state = init_state(param, group)
    state[STEP] = 1
    cfg = step_config(group, 1, code)
    rows, cols = matrix_shape(param)
    rounds = band_rounds(torch.randn(23), state, cfg, Band.of_range(rows, cols, 7, 23))  # elements 7 .. 30
    sizes, sums = [], None
    while True:
        try:
            yielded = rounds.send(sums)  # type: ignore[arg-type]  # None starts the generator
        except StopIteration:
            break
        sizes.append([t.numel() for t in yielded])
        sums = _answer(yielded)
    assert sizes == CODES[code].round_sizes(rows, cols, *momentum_matrix_shape(param, group), 1)


def test_a_levels_piece_adds_up_what_its_code_declares() -> None:
    """The levels code's piece that cuts its blocks yields V's sums and two block maxima per rank."""
    group = {**GROUP, "magnitude_bits": 3}
    shape, world = (3, 300), 3
    from smmf.partitions import Piece, piece_layout

    piece = Piece(0, shape, 250, 400, 0)
    state = {key: torch.zeros(spec.shape, dtype=spec.dtype) for key, spec in piece_layout(piece, group, torch.float32).items()}
    state[STEP] = 1
    cfg: StepConfig = step_config(group, 1, MomentumCode.LEVELS)
    rounds = levels_piece_rounds(None, torch.zeros(400), torch.randn(400), state, cfg, shape, 250,
                                 [(0, 250), (250, 400), (650, 250)], 1)
    yielded = next(rounds)
    rows, cols = matrix_shape(torch.zeros(shape))
    assert [[t.numel() for t in yielded]] == CODES[MomentumCode.LEVELS].round_sizes(rows, cols, 0, 0, world)
