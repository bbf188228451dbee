"""A registry of optimizers under test, in the manner of torch's ``OptimizerInfo`` / ``optim_db``.

Generic tests in ``test_optim_generic.py`` run every entry; ``torch.optim.Adam`` is the control.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from helpers import FUSED_BACKENDS, HAS_CUDA, device_of
from smmf import SMMF


@dataclass(frozen=True)
class ErrorInput:
    kwargs: dict[str, Any]
    error: type[Exception]
    match: str


@dataclass(frozen=True)
class OptimizerInput:
    """Constructor kwargs of one variant, with a readable ``desc`` for test ids (as torch's)."""

    desc: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    factory: Callable[..., torch.optim.Optimizer]
    inputs: list[OptimizerInput]  # the variants every generic test runs
    error_inputs: list[ErrorInput] = field(default_factory=list)
    supports_complex: bool = True
    atomic_step: bool = True  # a rejected step leaves the state untouched (Adam builds state first)
    device: str = "cpu"  # the device of the params each generic test hands it

    def __str__(self) -> str:
        return f"{self.name}-{self.device}"


SMMF_INPUTS: list[OptimizerInput] = [
    OptimizerInput("default", {}),
    OptimizerInput("adamw_decay", {"lr": 1e-2, "weight_decay": 0.1}),
    OptimizerInput("adam_l2_decay", {"lr": 1e-2, "weight_decay": 1e-4, "weight_decay_mode": "adam"}),
    OptimizerInput("no_first_moment", {"beta": None, "growth_rate": None}),
    OptimizerInput("dense_vectors", {"vector_reshape": False, "decay_rate": -0.8}),
    OptimizerInput("maximize", {"maximize": True}),
    OptimizerInput("tensor_lr", {"lr": torch.tensor(1e-3)}),
]

SMMF_ERRORS: list[ErrorInput] = [
    ErrorInput({"lr": -1.0}, ValueError, r"Invalid learning rate: -1.0"),
    ErrorInput({"lr": torch.tensor([1e-3, 1e-3])}, ValueError, r"Tensor lr must be 1-element"),
    ErrorInput({"beta": 1.0}, ValueError, r"Invalid beta: 1.0 \(must be None or in \[0, 1\)\)"),
    ErrorInput({"eps": -1e-8}, ValueError, r"Invalid epsilon value: -1e-08"),
    ErrorInput({"weight_decay": -0.1}, ValueError, r"Invalid weight_decay value: -0.1"),
    ErrorInput({"decay_rate": 0.5}, ValueError, r"Invalid decay_rate: 0.5 \(must be in \[-1, 0\]\)"),
    ErrorInput({"decay_rate": -1.5}, ValueError, r"Invalid decay_rate: -1.5"),
    ErrorInput({"growth_rate": 1.5}, ValueError, r"Invalid growth_rate: 1.5"),
    ErrorInput({"weight_decay_mode": "l2"}, ValueError, r"Unknown weight_decay_mode: 'l2'. It needs to be one of \['adamw', 'adam'\]"),
    ErrorInput({"vector_reshape": "yes"}, ValueError, r"vector_reshape should be a bool but is: 'yes'"),
    ErrorInput({"backend": "cuda"}, ValueError, r"Unknown backend: 'cuda'. It needs to be one of"),
]

DEVICES = ["cpu", "cuda"] if HAS_CUDA else ["cpu"]

optim_db: list[OptimizerInfo] = [
    *[
        OptimizerInfo(
            "Adam",
            torch.optim.Adam,
            inputs=[
                OptimizerInput("default", {}),
                OptimizerInput("weight_decay", {"lr": 1e-2, "weight_decay": 0.1}),
                OptimizerInput("maximize", {"maximize": True}),
                OptimizerInput("tensor_lr", {"lr": torch.tensor(1e-3)}),
            ],
            error_inputs=[ErrorInput({"lr": -1.0}, ValueError, r"Invalid learning rate: -1.0")],
            atomic_step=False,
            device=device,
        )
        for device in DEVICES
    ],
    *[OptimizerInfo("SMMF-torch", partial(SMMF, backend="torch"), SMMF_INPUTS, SMMF_ERRORS, device=d) for d in DEVICES],
    *[
        OptimizerInfo(f"SMMF-{b}", partial(SMMF, backend=b), SMMF_INPUTS, SMMF_ERRORS, device=device_of(b))
        for b in FUSED_BACKENDS
    ],
]
