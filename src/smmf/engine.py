"""The optimizer's extension point: what an engine above :class:`~smmf.SMMF` may adapt, and how it is found.

An engine changes who steps the params or what the param groups hold, and the optimizer knows none of them: the
step inside backward (:mod:`smmf.backward`) steps each param from its gradient hook; DeepSpeed ZeRO
(:mod:`smmf.zero_engine`) puts flat buffers of the params in the groups in place of the params. The optimizer holds
one :class:`Engine` and calls its hooks at fixed points; this base class is the plain optimizer's behaviour, which
each hook keeps unless an engine overrides it. An engine that installs itself (the step inside backward) takes the
optimizer's slot; one whose library puts its own tensors in the groups is found by :func:`find_engine` when the
optimizer first meets a tensor it was not given, and its code is imported only then.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, Optional, Protocol

from torch import Tensor

from .schema import PIECES

if TYPE_CHECKING:
    from .dispatch import Route, RouteWhere
    from .options import StepConfigs

__all__ = ["Engine", "EngineStep", "find_engine", "stepping_to_make_state"]

# The libraries whose engines put their own tensors in an optimizer's groups, with the module of their adapter:
# ``engine_for(optimizer)``, the adapter where the library is in use, and ``stepping_to_make_state()``.
_TENSOR_ENGINES = {"deepspeed": "smmf.zero_engine"}

class EngineStep(Protocol):
    """The step of one tensor an engine put in a group, checked and ready to run (:meth:`Engine.prepare`)."""

    def run(self, configs: StepConfigs) -> Any:
        """Step it in place, each param it holds with its config from ``configs``, and bump the versions of what it
        wrote; return the NaN/inf elements met."""

    def undo(self) -> None:
        """Put back the step counts it advanced (a step that raised, before or after it ran)."""


class Engine:
    """An engine's hooks into an optimizer; the base is the plain optimizer (nothing adapted)."""

    #: ``step()`` only runs the closure and ``zero_grad()`` does nothing: the engine steps the params itself.
    steps_itself = False
    def attach(self, params: list[Tensor]) -> None:
        """Adapt ``add_param_group``'s params, or raise before anything changes (the group is then dropped)."""

    def before_step(self) -> None:
        """Called by ``step()`` where the engine :attr:`steps_itself`, in its place (raise to refuse the call)."""

    def before_state_dict(self) -> None:
        """Called as ``state_dict()`` starts."""

    def saved_extras(self) -> dict[str, Any]:
        """What ``state_dict()`` saves beside ``state`` and ``param_groups`` for the engine."""
        return {}

    def tensorwise_to_own(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A state dict of the params' own, tensor-wise states (a plain SMMF's) in the form this engine's groups
        load; any other state dict as it is."""
        return state_dict

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor``, which the optimizer was not given, is this engine's (stepped by :meth:`prepare`)."""
        return False

    def route(self, where: RouteWhere, tensor: Tensor) -> Optional[Route]:
        """How ``tensor``, not given, is stepped, for :meth:`~smmf.SMMF.routes` (``where``: a route's first fields),
        without a collective; None: as a param."""
        return None

    def prepare(self, group: dict[str, Any], tensor: Tensor, grad: Tensor) -> EngineStep:
        """The checked step of a tensor this engine :meth:`holds` (raise, changing nothing, to refuse it)."""
        raise NotImplementedError

    def before_steps(self, steps: list[EngineStep]) -> None:
        """Called once every tensor of a step was checked, before anything is written, with the engine's steps."""

    def groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every param group, also while the engine shows the optimizer a part of them (``groups``)."""
        return groups

    def after_failed_step(self) -> None:
        """Called when ``step()`` raised: leave the groups as the user sees them between steps."""

    def check_layout(self, group: dict[str, Any]) -> None:
        """``group``'s layout options changed: raise if the engine's state of it no longer fits them."""

    def check_saved(self, states: dict[Any, Any], holds_any: bool) -> None:
        """Refuse, before anything else is checked, a checkpoint's ``states`` that only an engine can load where the
        optimizer's groups hold none of its tensors (``holds_any`` false)."""
        if not holds_any and any(isinstance(saved, dict) and PIECES in saved for saved in states.values()):
            raise ValueError(
                f"the loaded state dict holds the SMMF state of DeepSpeed ZeRO partitions (one rank's pieces of the "
                f"model's tensors under a flat buffer per group, '{PIECES}' by tensor), and this optimizer steps "
                "the model's own parameters. Load it where it was saved (engine.load_checkpoint under DeepSpeed, "
                "with the same ZeRO stage and number of ranks), or join the ranks' pieces into this optimizer's "
                "form with smmf.zero.tensorwise_state (`smmf zero-to-plain`)")

    def check_loaded(self, tensor: Tensor, options: dict[str, Any], saved: Any, where: str) -> None:
        """Raise ``ValueError`` unless ``saved`` is a state this engine can load for its ``tensor``."""

    def load(self, tensor: Tensor, options: dict[str, Any], saved: Any) -> dict[str, Any]:
        """The state of the engine's ``tensor`` made from a checked checkpoint's ``saved``."""
        raise NotImplementedError

    def loaded(self, tensors: list[Tensor]) -> None:
        """Called once a checkpoint's state of the engine's ``tensors`` is in place."""


def find_engine(optimizer: Any) -> Optional[Engine]:
    """The adapter of an engine that puts its own tensors in ``optimizer``'s groups, where its library is imported;
    None where none is."""
    for library, module in _TENSOR_ENGINES.items():
        if library in sys.modules:
            engine: Optional[Engine] = importlib.import_module(module).engine_for(optimizer)
            if engine is not None:
                return engine
    return None


def stepping_to_make_state() -> bool:
    """Whether an engine steps the optimizer only to make its state, with zero gradients (SMMF makes its state at
    the first real step)."""
    for library, module in _TENSOR_ENGINES.items():  # a loop, not a generator: the engine reads the call stack
        if library in sys.modules and importlib.import_module(module).stepping_to_make_state():
            return True
    return False
