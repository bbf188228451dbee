"""The params an optimizer steps: which it takes, the gradients it trusts, and each one's place over the groups."""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

from torch import Tensor

from .sharding import is_dtensor

__all__ = ["GivenParams", "Places", "check_grad", "reject_flattened", "reject_non_float"]


def reject_non_float(param: Tensor) -> None:
    if not (param.is_floating_point() or param.is_complex()):
        raise ValueError(f"SMMF optimizes floating-point or complex parameters, got a {param.dtype} parameter")


def reject_flattened(param: Tensor) -> None:
    """SMMF's factorization depends on each tensor's true shape: a flattened buffer would be
    factorized as one meaningless matrix. FSDP1 marks the params it flattens (with or without
    ``use_orig_params``). DeepSpeed ZeRO's buffers are mapped back to the model's params at the first
    step (:mod:`smmf.zero_engine`)."""
    if getattr(param, "_fsdp_flattened", False) or type(param).__name__ == "FlatParameter":
        raise RuntimeError(
            "SMMF got a parameter flattened by FSDP1 (FullyShardedDataParallel): its factorization needs "
            "each parameter's own shape. Use FSDP2 (torch.distributed.fsdp.fully_shard), which SMMF supports."
        )
    if is_dtensor(param) and param.is_complex():  # the shard steps count real elements; FSDP2 counts complex ones
        raise RuntimeError(
            "SMMF does not take complex DTensor (FSDP2) parameters: shard the real view "
            "(torch.view_as_real) or keep the complex parameter unsharded"
        )


def check_grad(param: Tensor, grad: Tensor) -> None:
    """The kernels trust a gradient to be dense and to match its param in shape, dtype and device."""
    if grad.is_sparse:
        raise RuntimeError("SMMF does not support sparse gradients")
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        raise RuntimeError(
            f"a parameter of shape {tuple(param.shape)} ({param.dtype}, {param.device}) has a gradient of shape "
            f"{tuple(grad.shape)} ({grad.dtype}, {grad.device}); they must match"
        )


class GivenParams:
    """The params an optimizer was given, each with its place over the groups as given, held weakly: an engine
    may swap them for its own tensors (Accelerate's FSDP2 shards, DeepSpeed ZeRO's flat buffers) and free them, as
    it would under torch's optimizers."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        self.group_sizes: list[int] = []  # each group's count of params as given, in order

    def add(self, params: Iterable[Tensor], first_place: int) -> None:
        params = list(params)
        self.group_sizes.append(len(params))
        for place, param in enumerate(params, first_place):
            self._refs[id(param)] = (weakref.ref(param), place)
        if len(self._refs) > 64 and len(self._refs) > 2 * len(self.places()):  # forget the freed ones
            self._refs = {ident: entry for ident, entry in self._refs.items() if entry[0]() is not None}

    def holds(self, param: Tensor) -> bool:
        entry = self._refs.get(id(param))
        return entry is not None and entry[0]() is param

    def live(self) -> list[Tensor]:
        return [param for ref, _ in self._refs.values() if (param := ref()) is not None]

    def places(self) -> dict[int, int]:
        """Each live param's place, by ``id``."""
        return {ident: place for ident, (ref, place) in self._refs.items() if ref() is not None}


class Places:
    """Each param's position over the param groups (the same on every rank and after a resume: the levels' dither
    and the rounding noise salt by it) and its group, by ``id``: mapped once, not per param (the step inside
    backward steps one param a call), and again when the groups or their lists of params changed
    (``load_state_dict``'s new dicts, ``add_param_group``, a list edited in place)."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._places: dict[int, tuple[int, dict[str, Any]]] = {}

    def now(self, groups: list[dict[str, Any]], again: bool = False) -> dict[int, tuple[int, dict[str, Any]]]:
        """The map for ``groups``, made again when they changed or ``again``."""
        key = tuple((id(g), id(g["params"]), len(g["params"])) for g in groups)
        if again or self._key != key:
            pairs = ((g, p) for g in groups for p in g["params"])
            self._key, self._places = key, {id(p): (i, g) for i, (g, p) in enumerate(pairs)}
        return self._places

    def ordinal(self, groups: list[dict[str, Any]], param: Tensor, group: dict[str, Any],
                places: dict[int, tuple[int, dict[str, Any]]]) -> int:
        """``param``'s position (``places``: :meth:`now`, taken once a step), refusing a param that ``group`` does
        not hold."""
        place = places.get(id(param))
        if place is None or place[1] is not group:
            place = self.now(groups, again=True).get(id(param))  # a param swapped in place for another
            if place is None or place[1] is not group:
                where = "none of the optimizer's param groups" if place is None else "another param group"
                raise ValueError(f"step_params got a parameter of shape {tuple(param.shape)} with a group it is not "
                                 f"in: it is in {where} (add it with add_param_group, and pass its own group)")
        return place[0]
