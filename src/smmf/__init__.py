"""SMMF: Square-Matricized Momentum Factorization, a memory-efficient PyTorch optimizer."""

from .optimizer import SMMF

__all__ = ["SMMF", "__version__"]
__version__ = "0.1.0"
