"""SMMF: Square-Matricized Momentum Factorization, a memory-efficient PyTorch optimizer."""

from . import memory
from .backward import StepInBackward, step_in_backward
from .optimizer import RECOMMENDED, RECOMMENDED_BF16, SMMF

__all__ = ["RECOMMENDED", "RECOMMENDED_BF16", "SMMF", "memory", "step_in_backward", "StepInBackward", "__version__"]
__version__ = "0.3.0.dev0"  # the one place the version is written (pyproject.toml reads it)
