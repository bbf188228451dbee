"""An optimizer's state dict: checked whole before anything loads, its bits by rows of the param where sharded.

The packed bits of an FSDP2 shard are saved by rows of the parameter, placed like it
(:func:`smmf.sharding.bits_for_checkpoint`), so ``torch.distributed.checkpoint`` loads them on any number of ranks;
a load turns them back into this optimizer's own layout. :func:`check_loadable` refuses what does not fit before the
optimizer changes anything.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from . import options as registry
from .engine import Engine
from .matrix import packed_sign_bytes
from .options import validate_group
from .sharding import (bits_for_checkpoint, bits_from_checkpoint, has_rows_layout, is_dtensor, placed_like,
                       rows_from_flat, shard_info)
from .codes import BIT_FIELDS
from .state import MOMENTUM_CODE_DEFAULTS, STEP, check_loaded_state, state_layout

__all__ = ["ParamOf", "bits_by_rows", "bits_in_memory_layout", "check_loadable", "check_smmf_group", "loaded_state",
           "saved_params"]

# Each saved param id's param and the options its checkpoint is continued with.
ParamOf = dict[Any, tuple[Tensor, dict[str, Any]]]

# Keys that torch adds to param groups: learning-rate schedulers (``swa_lr``: ``swa_utils.SWALR``), and
# ``param_names`` in an optimizer built from ``named_parameters()`` (torch >= 2.6).
_TORCH_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr", "base_lr", "max_momentum", "base_momentum", "swa_lr",
                     "param_names")


def saved_params(groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> Iterator[tuple[Tensor, Any]]:
    """Each param of ``groups`` with its id in ``state_dict`` (groups and their params in order), once: a param a
    group holds twice has one id and one state."""
    seen = set()
    for group, saved in zip(groups, state_dict.get("param_groups") or []):
        for param, pid in zip(group["params"], saved.get("params", []) if isinstance(saved, dict) else []):
            if id(param) not in seen:
                seen.add(id(param))
                yield param, pid


def bits_by_rows(groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """Put the packed bits of each FSDP2 shard in ``state_dict`` by rows of its param, in place (the entries of
    ``state_dict["state"]`` are replaced, not changed: they stay the live state's)."""
    states = state_dict["state"] = dict(state_dict["state"])
    for param, pid in saved_params(groups, state_dict):
        if pid in states and has_rows_layout(param):
            states[pid] = {key: bits_for_checkpoint(value, param) if key in BIT_FIELDS else value
                           for key, value in states[pid].items()}


def bits_in_memory_layout(groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with the bits saved by rows in the layout of ``groups``' params: this rank's elements of a
    shard, the flat packing of a whole tensor. A shard's bits in the per-rank layout of smmf 0.2 load only on the
    number of ranks that wrote them."""
    states = state_dict.get("state")
    if not isinstance(states, dict):
        return state_dict  # check_loadable says what is wrong
    converted = dict(states)
    for param, pid in saved_params(groups, state_dict):
        entry = states.get(pid)
        if isinstance(entry, dict):
            for key in BIT_FIELDS & entry.keys():
                if isinstance(entry[key], Tensor):
                    converted[pid] = {**converted[pid], key: _bits_in_memory(entry[key], param, pid, key)}
    return {**state_dict, "state": converted}


def _bits_in_memory(value: Tensor, param: Tensor, pid: Any, key: str) -> Tensor:
    info = shard_info(param)
    if value.dim() == 2:
        try:
            return bits_from_checkpoint(value, param)
        except ValueError as err:
            raise ValueError(f"parameter {pid}: state '{key}': {err}") from None
    if info is not None and info.sharded and not is_dtensor(value) and value.numel() == packed_sign_bytes(param.numel()):
        # An unsharded run's flat packing (where smmf 0.2's per-rank layout has as many bytes, its shards were
        # byte-aligned and the two hold the same bytes, or this reading wins).
        return bits_from_checkpoint(rows_from_flat(value, param), param)
    if info is not None and info.sharded and value.numel() != info.sign_bytes * info.world:
        raise ValueError(
            f"parameter {pid}: state '{key}' holds {value.numel()} bytes of bits laid out per rank (a checkpoint of "
            f"smmf 0.2) for another number of ranks than these {info.world}: load it on the number of ranks that "
            "saved it and save it again with this version, whose checkpoints load on any number of ranks"
        )
    return value


def check_loadable(groups: list[dict[str, Any]], defaults: dict[str, Any], state_dict: Any, engine: Engine,
                   held: set[int]) -> ParamOf:
    """Raise ``ValueError`` unless ``state_dict`` fits an optimizer of ``groups`` (and ``defaults``) whose engine is
    ``engine``, which holds the tensors of ``held`` (by ``id``); map saved ids to params and the options they
    continue with."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError("an optimizer state dict has 'state' and 'param_groups'")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if isinstance(saved_state, dict):
        engine.check_saved(saved_state, bool(held))
    if len(saved_groups) != len(groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer has {len(groups)}")
    param_of: ParamOf = {}
    for index, (group, saved) in enumerate(zip(groups, saved_groups)):
        options = _continued_options(index, group, saved, defaults)
        for param, pid in zip(group["params"], saved["params"]):
            param_of[pid] = (param, options)
            if pid in saved_state and id(param) in held:
                engine.check_loaded(param, options, saved_state[pid], f"parameter {pid}")
            elif pid in saved_state:
                check_loaded_state(param, options, saved_state[pid], f"parameter {pid}")
    unknown = sorted(set(saved_state) - set(param_of), key=str)
    if unknown:
        raise ValueError(f"loaded state dict has state for parameters {unknown} that no group lists")
    return param_of


def check_smmf_group(index: int, group: dict[str, Any], saved: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the saved param group ``saved`` holds SMMF's options (those an old checkpoint
    may lack aside) and no key SMMF, ``group`` and torch do not know."""
    missing = sorted(set(registry.names(optional=False)) - set(saved))
    foreign = sorted(set(saved) - set(defaults) - set(group) - {"params", *_TORCH_GROUP_KEYS})
    if missing or foreign:
        raise ValueError(f"loaded parameter group {index} does not hold SMMF's options (lacks {missing}, has unknown "
                         f"{foreign}): is it another optimizer's state dict?")


def _continued_options(index: int, group: dict[str, Any], saved: dict[str, Any],
                       defaults: dict[str, Any]) -> dict[str, Any]:
    """The options a saved group continues with: its own, but for the runtime choices, which stay ``group``'s."""
    if len(group["params"]) != len(saved["params"]):
        raise ValueError(f"loaded parameter group {index} has {len(saved['params'])} parameters, the optimizer's has "
                         f"{len(group['params'])}")
    check_smmf_group(index, group, saved, defaults)
    # The options that decide the state's layout: a checkpoint written with others cannot be continued (one
    # without them was written with the paper's code).
    for key, default in MOMENTUM_CODE_DEFAULTS.items():
        if saved.get(key, default) != group[key]:
            raise ValueError(
                f"loaded parameter group {index} was written with {key}={saved.get(key, default)!r}, this "
                f"optimizer's has {key}={group[key]!r}: its state has another layout. Build the optimizer "
                f"with {key}={saved.get(key, default)!r} to continue that run")
    options = {**group, **{k: v for k, v in saved.items() if k not in ("params", *registry.names(from_checkpoint=False))}}
    validate_group(options)
    return options


def loaded_state(param: Tensor, options: dict[str, Any], saved: dict[str, Any], made: dict[str, Any]) -> dict[str, Any]:
    """A param's state from its checked ``saved`` state, in the dtypes of its layout (torch's loader casts every
    tensor to the param's dtype) and placed like ``made`` (an FSDP2 shard's new state), else like the param."""
    state: dict[str, Any] = {}
    for key, spec in state_layout(param, options).items():
        value = placed_like(saved[key], made[key]) if made else saved[key]
        # Contiguous: the kernels index the 2-D state (the levels code's) as row-major.
        state[key] = value.to(param.device, spec.dtype, copy=True, memory_format=torch.contiguous_format)
    state[STEP] = int(saved[STEP])
    return state


def options_kept(groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's options that an old checkpoint may lack, whose values the optimizer keeps then."""
    return [{key: group[key] for key in registry.names(optional=True)} for group in groups]
