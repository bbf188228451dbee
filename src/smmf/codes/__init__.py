"""The codes of M, one module each, registered once here: how a param's state keeps its moments, and every rule
that depends on it (:class:`Code`: its state's fields, the option value that picks it, its torch update, the sums
its pieces add up across ranks, a piece's state). Every other module asks the code of a step for these
(``CODES[cfg.code]``) rather than asking which code it is; each fused backend has its kernel for a code in one
module of its own.
"""

from __future__ import annotations

from ..schema import MomentumCode, StateField
from .base import Code
from .dense import DENSE
from .flag import FLAG
from .levels import LEVELS
from .no_m import NO_M
from .sign import SIGN

__all__ = ["BIT_FIELDS", "CODES", "Code", "FACTORED", "FACTORED_FIELDS", "MAGNITUDE_BITS", "SCHEMA", "choose"]

CODES: dict[MomentumCode, Code] = {code.member: code for code in (DENSE, NO_M, SIGN, FLAG, LEVELS)}
assert set(CODES) == set(MomentumCode), "every code of M is registered once"

# Each code's state tensors, in the order the kernels take them (Code.fields).
SCHEMA: dict[MomentumCode, tuple[StateField, ...]] = {member: code.fields for member, code in CODES.items()}

# The codes whose state is factored (all but the dense one): the fused backends' codes.
FACTORED: frozenset[MomentumCode] = frozenset(member for member, code in CODES.items() if not code.elementwise)

# The state fields of the factored codes, each once, in order: the Triton table's columns of state.
FACTORED_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(
    field.key for member in CODES if member in FACTORED for field in SCHEMA[member]))

# The fields of packed bits, one per element (StateField.bits).
BIT_FIELDS: frozenset[str] = frozenset(field.key for fields in SCHEMA.values() for field in fields if field.bits)

# The codes of a first moment, by the value of ``magnitude_bits`` that picks each.
_BY_MAGNITUDE_BITS = {code.magnitude_bits: member for member, code in CODES.items() if code.magnitude_bits is not None}
MAGNITUDE_BITS: tuple[int, ...] = tuple(sorted(_BY_MAGNITUDE_BITS))


def choose(elementwise: bool, first_moment: bool, magnitude_bits: int) -> MomentumCode:
    """The code of a param's state: Adam's dense one for a vector kept elementwise, V's factors alone without a first
    moment, else the code ``magnitude_bits`` picks."""
    if elementwise:
        return DENSE.member
    if not first_moment:
        return NO_M.member
    return _BY_MAGNITUDE_BITS.get(magnitude_bits, SIGN.member)
