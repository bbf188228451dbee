"""SMMF: Square-Matricized Momentum Factorization, a memory-efficient PyTorch optimizer."""

import typing as _typing

from . import memory
from .optimizer import RECOMMENDED, RECOMMENDED_BF16, SMMF

if _typing.TYPE_CHECKING:
    from .backward import StepInBackward, step_in_backward

__all__ = ["RECOMMENDED", "RECOMMENDED_BF16", "SMMF", "memory", "step_in_backward", "StepInBackward", "__version__"]
__version__ = "0.3.0.dev0"  # the one place the version is written (pyproject.toml reads it)


def __getattr__(name: str) -> _typing.Any:
    """The step inside backward, imported when first asked for: ``import smmf`` loads none of its code."""
    if name in ("step_in_backward", "StepInBackward"):
        from . import backward

        return getattr(backward, name)
    raise AttributeError(f"module 'smmf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
