"""DeepSpeed ZeRO's flat buffers: which pieces of the model's tensors each one holds.

DeepSpeed's ZeRO optimizers (stages 1, 2 and 3, and its ``BF16_Optimizer``) step their client optimizer on flat
fp32 buffers that they put in its param groups in place of the model's params. SMMF must not factorize such a
buffer as one tensor: :func:`find_partition` reads from DeepSpeed where each of the optimizer's params lies in a
buffer, so that each is stepped as on one device (:mod:`smmf.partitions`). DeepSpeed is never imported here; what
is read is what it attaches to the model's params:

- stages 1 and 2 (and ``BF16_Optimizer``): ``_dp_group``, the process group a param's group is partitioned
  over (set on every param of a group, those outside this rank's buffer too), and ``_hp_mapping``, which tells
  which buffer holds a fragment of the param; where each param lies is read from its ``.data``, a view of its
  group's flat buffer of bit16 weights, which the ranks cut into equal parts (this rank's, in fp32, is the
  buffer it steps);
- stage 3: each param's ``_z3_optimizer``, whose sub-groups list their params and buffers; a param's part on
  rank ``r`` of ``w`` is ``[r·p, (r + 1)·p)`` of its flattening, ``p = ⌈numel / w⌉``, laid end to end in the
  buffer (DeepSpeed pads each part to ``p``).

What SMMF does not cover is refused at the first step, before anything changes (:func:`refuse_unsupported`).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path
from types import FrameType
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .partitions import Partition, Piece, exchange, join_piece_states
from .schema import PIECES, PLACES

__all__ = ["check_checkpoint", "find_partition", "is_deepspeed_buffer", "load_checkpoint", "load_state",
           "stepping_to_make_state", "tensorwise_state"]

# The key of SMMF's state dict under ZeRO that says how many params each group was given (frozen ones too).
GIVEN_GROUPS = "given_group_sizes"


def is_deepspeed_buffer(tensor: Tensor, params: Sequence[Tensor]) -> bool:
    """Whether ``tensor`` looks like a flat buffer of DeepSpeed's (ZeRO-3 names its buffers with ``ds_id``; the
    params of a ZeRO-1/2 group carry ``_hp_mapping``)."""
    if "deepspeed" not in sys.modules:
        return False
    return hasattr(tensor, "ds_id") or any(hasattr(p, "_hp_mapping") or hasattr(p, "_z3_optimizer") for p in params)


def find_partition(flat: Tensor, params: Sequence[Tensor], ordinals: Mapping[int, int]) -> Optional[Partition]:
    """The :class:`~smmf.partitions.Partition` of ``flat`` if it is a DeepSpeed ZeRO buffer of the group whose
    params the optimizer was given (``params``; ``ordinals``: each given param's place by ``id``), else None.
    Makes one collective over the buffer's process group (every rank steps its buffers in the same order).
    Raises ``RuntimeError`` for a DeepSpeed buffer it cannot map, or a configuration SMMF does not cover."""
    if not is_deepspeed_buffer(flat, params):
        return None
    z3 = next((p._z3_optimizer for p in params if getattr(p, "_z3_optimizer", None) is not None), None)  # type: ignore[attr-defined]
    if z3 is not None:
        return _stage3(z3, flat, ordinals)
    linked = [p for p in params if hasattr(p, "_dp_group")]
    if not linked:
        raise _unmapped(flat)
    group = linked[0]._dp_group  # type: ignore[attr-defined]
    refuse_unsupported(getattr(linked[0], "_zero_optimizer", None) or _calling_zero_optimizer(), group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mapped = [p for p in linked if getattr(p, "_hp_mapping", None) is not None
              and _same_storage(p._hp_mapping.hp_fragment, flat)]  # type: ignore[attr-defined]
    if not mapped:  # this rank's part of the group is padding alone
        return exchange([], rank, world, group)
    return exchange(_fragments(flat, mapped[0], linked, ordinals, rank, world), rank, world, group)


def _fragments(flat: Tensor, member: Tensor, linked: Sequence[Tensor], ordinals: Mapping[int, int], rank: int,
               world: int) -> list[Piece]:
    """This rank's pieces of a ZeRO-1/2 group, from where its params lie in the group's flat buffer of bit16
    weights: each one's ``.data`` is a view of it (DeepSpeed's own layout, round-robin order and alignment
    padding included), which rank ``r`` of ``w`` partitions into ``w`` equal parts, ``flat`` being this rank's
    part in fp32. (DeepSpeed's ``_hp_mapping`` offsets are not used: under ``round_robin_gradients`` without
    alignment padding they follow the params' order, not the buffer's.)"""
    storage = member.data.untyped_storage()
    members = [p for p in linked if p.data.untyped_storage().data_ptr() == storage.data_ptr()]
    part = flat.numel()
    if storage.nbytes() != world * part * member.element_size():
        raise _unmapped(flat)
    pieces = []
    for param in members:
        first = int(param.data.storage_offset())
        lo, hi = max(first, rank * part), min(first + param.numel(), (rank + 1) * part)
        if lo < hi:
            pieces.append(Piece(ordinals[id(param)], tuple(param.shape), lo - first, hi - lo, lo - rank * part))
    return sorted(pieces, key=lambda piece: piece.offset)


def _stage3(z3: Any, flat: Tensor, ordinals: Mapping[int, int]) -> Partition:
    index = next((i for i, buffer in enumerate(z3.fp32_partitioned_groups_flat) if buffer is flat), None)
    if index is None:
        raise _unmapped(flat)
    group = z3.sub_group_process_groups[index]
    refuse_unsupported(z3, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    pieces, offset = [], 0
    for param in z3.fp16_groups[index]:
        if id(param) not in ordinals:
            raise RuntimeError("DeepSpeed ZeRO-3 steps a parameter that SMMF was not given: build SMMF with the "
                               "model's parameters, before deepspeed.initialize")
        part, numel = param.partition_numel(), param.ds_numel
        held = max(0, min(part, numel - rank * part))
        if held:
            pieces.append(Piece(ordinals[id(param)], tuple(param.ds_shape), rank * part, held, offset))
        offset += part
    if offset != flat.numel():
        raise _unmapped(flat)
    return exchange(pieces, rank, world, group)


def refuse_unsupported(zero_optimizer: Any, group: Any) -> None:
    """Raise ``RuntimeError`` for what SMMF does not cover under DeepSpeed (``zero_optimizer``: DeepSpeed's ZeRO
    optimizer where known): the optimizer state offloaded to NVMe; ZeRO-1/2's ``elastic_checkpoint``; ranks
    partitioned over a group smaller than the world (pipeline, tensor or expert parallelism)."""
    if getattr(zero_optimizer, "swap_optimizer", False):
        raise RuntimeError("SMMF does not support DeepSpeed's offload of the optimizer state to NVMe "
                           "(offload_optimizer.device='nvme'): its swapper moves flat tensors of the buffer's "
                           "size, and SMMF's state is a few vectors and bits per tensor. Offload to 'cpu', or keep "
                           "the state on the device: it is 1/16 to 1/60 of Adam's")
    if getattr(zero_optimizer, "elastic_checkpoint", False):
        raise RuntimeError("SMMF does not support DeepSpeed ZeRO's elastic_checkpoint, which merges and re-cuts the "
                           "optimizer state as flat tensors of the buffer's size: set "
                           "zero_optimization.elastic_checkpoint to false (its default)")
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise RuntimeError(f"SMMF under DeepSpeed ZeRO supports data parallelism over every rank; this buffer is "
                           f"partitioned over {dist.get_world_size(group)} of {dist.get_world_size()} ranks "
                           "(pipeline, tensor or expert parallelism), which is not supported: use ZeRO data "
                           "parallelism alone, or FSDP2")


def stepping_to_make_state() -> bool:
    """Whether DeepSpeed is stepping the optimizer only to make its state: its fp16 and bf16 wrappers without
    ZeRO (``FP16_UnfusedOptimizer``, ``FP16_Optimizer``) step it once at ``deepspeed.initialize`` with zero
    gradients (``initialize_optimizer_states``). Found up the call stack; False where DeepSpeed is not imported."""
    if "deepspeed" not in sys.modules:
        return False
    callers = _deepspeed_callers(sys._getframe(1))
    return any(frame.f_code.co_name == "initialize_optimizer_states" for frame, _ in callers)


def _deepspeed_callers(frame: Optional[FrameType]) -> Iterator[tuple[FrameType, Any]]:
    """Of ``frame`` and the 15 frames above it, those of methods of DeepSpeed's runtime objects, with the object."""
    for _ in range(16):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if type(owner).__module__.startswith("deepspeed.runtime."):
            yield frame, owner
        frame = frame.f_back


def _calling_zero_optimizer() -> Any:
    """The DeepSpeed optimizer whose method called SMMF (its ``step``, ``load_state_dict``), found up the call
    stack; None where none is. Only its settings are read (:func:`refuse_unsupported`): stages 1 and 2 attach
    none to the params they link."""
    callers = _deepspeed_callers(sys._getframe(1))
    return next((owner for _, owner in callers if hasattr(owner, "elastic_checkpoint")), None)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _unmapped(flat: Tensor) -> RuntimeError:
    return RuntimeError(
        f"SMMF got a flat buffer of {flat.numel()} elements from DeepSpeed whose pieces it cannot map to the "
        "model's parameters: factorizing it as one tensor would not be SMMF. SMMF supports DeepSpeed ZeRO stages "
        "1, 2 and 3 when built with the model's parameters before deepspeed.initialize (or by the Hugging Face "
        "Trainer or Accelerate)")


def check_checkpoint(engine: Any, load_dir: Union[str, os.PathLike], tag: Optional[str] = None) -> None:
    """Raise ``ValueError`` unless the DeepSpeed checkpoint ``load_dir``/``tag`` (``tag`` None: the one its
    ``latest`` file names) was saved at ``engine``'s number of data-parallel ranks and ZeRO stage, reading only
    the model-states file that holds the engine's settings. DeepSpeed cannot re-cut ZeRO's partitions at another
    world size: it refuses the load, or, under ZeRO-3 with frozen params, fails inside its module load with a size
    mismatch after it has changed some of the weights."""
    found = _tag_folder(load_dir, tag)
    # The engine's own file first (ZeRO's rank 0, or the one file without ZeRO): an expert's or a pipeline layer's
    # holds no settings.
    files = [path for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt")
             if (path := found / name).is_file()] or sorted(found.glob("*model_states.pt"))
    if not files:
        raise ValueError(f"{found} holds no DeepSpeed checkpoint (no *model_states.pt file)")
    saved = _load(files[0])
    # DeepSpeed saves the sequence-data-parallel world (the data-parallel one without sequence parallelism).
    world = getattr(engine, "seq_dp_world_size", getattr(engine, "dp_world_size", None))
    stage = engine.zero_optimization_stage()
    saved_world = saved.get("dp_world_size")
    saved_stage = (saved.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0)
    if stage and saved_world is not None and world is not None and saved_world != world:
        raise ValueError(f"{files[0].parent} was saved at {saved_world} data-parallel ranks and this engine runs "
                         f"{world}: DeepSpeed cannot re-cut ZeRO's partitions of the weights and SMMF's state. "
                         f"Resume at {saved_world} ranks")
    if saved_stage != stage:
        raise ValueError(f"{files[0].parent} was saved under ZeRO stage {saved_stage} and this engine runs stage "
                         f"{stage}: resume under stage {saved_stage}")


def load_checkpoint(engine: Any, load_dir: Union[str, os.PathLike], tag: Optional[str] = None,
                    **kwargs: Any) -> Any:
    """``engine.load_checkpoint(load_dir, tag, **kwargs)`` once :func:`check_checkpoint` found that it fits, so
    that a checkpoint of another world size or stage is refused before anything changes; what it returns. Without
    the optimizer's state (``load_module_only=True`` or ``load_optimizer_states=False``) below ZeRO-3, whose weights
    are whole on every rank, DeepSpeed loads at any world size: nothing is checked."""
    module_only = kwargs.get("load_module_only") or not kwargs.get("load_optimizer_states", True)
    if not (module_only and engine.zero_optimization_stage() < 3):
        check_checkpoint(engine, load_dir, tag)
    return engine.load_checkpoint(str(load_dir), tag=tag, **kwargs)


def _tag_folder(load_dir: Union[str, os.PathLike], tag: Optional[str]) -> Path:
    """The folder of checkpoint ``tag`` in ``load_dir`` (``tag`` None: the one its ``latest`` file names)."""
    folder = Path(load_dir)
    if tag is None:
        latest = folder / "latest"
        if not latest.is_file():
            raise ValueError(f"{folder} has no 'latest' file: name the checkpoint's tag")
        tag = latest.read_text().strip()
    return folder / str(tag)


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # not in the zipfile format, which mmap needs
        return torch.load(path, map_location="cpu", weights_only=False)


def _rank_of(path: Path) -> int:
    found = re.search(r"zero_pp_rank_(\d+)_", path.name)
    return int(found.group(1)) if found else 0


def tensorwise_state(load_dir: Union[str, os.PathLike], tag: Optional[str] = None) -> dict[str, Any]:
    """The plain ``SMMF.state_dict()`` of the model's params from a DeepSpeed checkpoint of SMMF under ZeRO
    (stages 1, 2 and 3, saved at any number of ranks; ``tag`` None: the one ``load_dir``'s ``latest`` file names):
    each tensor's state joined from the pieces its ranks saved (:func:`smmf.partitions.join_piece_states`), read
    on the CPU without launching ranks, as DeepSpeed's ``zero_to_fp32`` reads the weights. It loads into an SMMF
    of the same params in the same groups: with ``SMMF.load_state_dict`` in one process or on FSDP2's shards (each
    rank takes its rows), or under ZeRO at any number of ranks (:func:`load_state`). Raises ``ValueError`` for a
    checkpoint of another optimizer, one missing ranks' files and pieces that are not SMMF's state of their
    tensors."""
    found = _tag_folder(load_dir, tag)
    files = sorted(found.glob("*optim_states.pt"), key=_rank_of)
    if not files:
        raise ValueError(f"{found} holds no optimizer state of DeepSpeed ZeRO (no *optim_states.pt file): the weights "
                         "alone were saved, or it is not a ZeRO checkpoint")
    ranks = [_rank_of(path) for path in files]
    saved_world = _saved_world(found)
    if ranks != list(range(len(files))) or (saved_world is not None and saved_world != len(files)):
        raise ValueError(f"{found} holds the optimizer files of ranks {ranks}, and was saved at "
                         f"{saved_world or 'an unknown number of'} ranks: are the files of some ranks missing?")
    clients = [_client_state(path) for path in files]
    first = clients[0]
    groups = [{key: value for key, value in group.items() if key != "params"} for group in first["param_groups"]]
    group_of = {pid: index for index, group in enumerate(first["param_groups"]) for pid in group["params"]}
    pieces: dict[int, list[tuple[int, int, Any]]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    ordinal_group: dict[int, int] = {}
    for path, client in zip(files, clients):
        for pid, held in client["state"].items():
            for ordinal, (shape, start, numel) in held[PLACES].items():
                pieces.setdefault(ordinal, []).append((start, numel, held[PIECES][ordinal]))
                shapes[ordinal] = tuple(shape)
                ordinal_group[ordinal] = group_of[pid]
    state = {}
    for ordinal in sorted(pieces):
        group = groups[ordinal_group[ordinal]]
        state[ordinal] = join_piece_states(pieces[ordinal], shapes[ordinal], group, torch.float32,
                                           f"{found}: parameter {ordinal}", checked=True)
    sizes = first.get(GIVEN_GROUPS)
    if sizes is None:  # saved before SMMF recorded them
        sizes = _sizes_from_ordinals(ordinal_group, len(groups))
        warnings.warn(f"{found} does not record how many params each group was given (saved by an older smmf): the "
                      f"groups are taken to hold {sizes}, up to their last param with state; a frozen param after it "
                      "is counted in the next group, or left out after the last", UserWarning, stacklevel=2)
    if len(sizes) != len(groups):
        raise ValueError(f"{found}: {len(groups)} param groups, and the counts of {len(sizes)} recorded")
    param_groups, place = [], 0
    for group, size in zip(groups, sizes):
        param_groups.append({**group, "params": list(range(place, place + size))})
        place += size
    return {"state": state, "param_groups": param_groups}


def _saved_world(found: Path) -> Optional[int]:
    """The number of data-parallel ranks the checkpoint's first model-states file says it was saved at."""
    first = found / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if not first.is_file():
        return None
    world = _load(first).get("dp_world_size")
    return int(world) if world is not None else None


def _client_state(path: Path) -> dict[str, Any]:
    """One rank's ``SMMF.state_dict()`` in a ZeRO checkpoint, checked to be SMMF's pieces."""
    saved = _load(path).get("optimizer_state_dict", {})
    client = saved.get("base_optimizer_state") or saved.get("optimizer_state_dict")  # ZeRO-1/2, ZeRO-3
    if not isinstance(client, dict) or not {"state", "param_groups"} <= set(client):
        raise ValueError(f"{path} holds no optimizer state dict of the client optimizer (an elastic checkpoint of "
                         "ZeRO-1/2, which SMMF refuses, or not a DeepSpeed ZeRO checkpoint)")
    for held in client["state"].values():
        if not (isinstance(held, dict) and {PIECES, PLACES} <= set(held)):
            keys = sorted(held) if isinstance(held, dict) else type(held).__name__
            raise ValueError(f"{path} holds another optimizer's state (keys {keys}), not SMMF's pieces of the "
                             "model's tensors")
    return client


def _sizes_from_ordinals(ordinal_group: dict[int, int], groups: int) -> list[int]:
    """Each group's count of params from the ordinals its pieces name, for a checkpoint saved before SMMF saved the
    counts: up to its last stepped param (a frozen param after it is counted in the next group)."""
    ends = [0] * groups
    for ordinal, group in ordinal_group.items():
        ends[group] = max(ends[group], ordinal + 1)
    for index in range(1, groups):
        ends[index] = max(ends[index], ends[index - 1])
    return [end - start for start, end in zip([0] + ends[:-1], ends)]


def load_state(engine: Any, state_dict: dict[str, Any]) -> None:
    """Load a plain SMMF state dict of the model's params (:func:`tensorwise_state`'s, or a single-process or FSDP2
    run's full one) into the SMMF that DeepSpeed ``engine`` steps under ZeRO, at any number of ranks and stage:
    each rank cuts its pieces from it. Every rank calls it (the buffers' pieces are gathered at first sight). Load
    the weights before (``deepspeed.initialize`` of a model holding them): ZeRO's fp32 masters are made from
    them."""
    zero = engine.optimizer
    client = getattr(zero, "optimizer", None)
    if client is None or not hasattr(client, "_given"):
        raise ValueError("load_state loads SMMF's state into a DeepSpeed engine whose client optimizer is SMMF")
    refuse_unsupported(zero, None)  # the settings a first step would check (ZeRO-1/2 have taken none yet)
    stage3 = hasattr(zero, "_set_fp32_optimizer_param_groups")  # ZeRO-3 puts its buffers in the groups to load
    if stage3:
        zero._set_fp32_optimizer_param_groups()
    try:
        client.load_state_dict(state_dict)
    finally:
        if stage3:
            zero._clear_fp32_optimizer_param_groups()

