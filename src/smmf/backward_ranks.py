"""The step inside backward across ranks: what :func:`smmf.step_in_backward` adds when it is given the
DDP or FSDP2 module that reduces the gradients.

- **DDP** all-reduces gradients in buckets after autograd has summed them on each rank, so a
  parameter's post-accumulate-grad hook would see this rank's gradient alone. A communication hook
  averages each bucket as DDP's own does, then steps the bucket's parameters with the averaged
  gradients when the all-reduce completes, and hands DDP zeros to write into ``.grad`` (DDP keeps its
  bucket buffers whatever the optimizer does; zeros make the next backward's accumulation start from
  nothing, as ``zero_grad`` would).
- **FSDP2** fires the hooks of the sharded parameters itself, after the reduce-scatter: the
  single-process hooks step each shard there and free its gradient.
- **Accumulation** (``accumulation_steps=k``): a forward pre-hook turns gradient sync off for the
  first k−1 micro-batches of each window and on for the k-th (DDP's ``no_sync``, FSDP2's
  ``set_requires_gradient_sync``), and a hook on the module's output counts the backwards that reach
  no parameter hook (those without sync).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

__all__ = ["ModuleSync", "Window", "is_ddp", "is_fsdp2"]


class Window(Protocol):
    """What :class:`ModuleSync` reads and calls of the step inside backward's handle
    (:class:`smmf.backward.StepInBackward`, which imports this module): its accumulation window and its step."""

    accumulation_steps: int
    _micro: int
    _failed: bool
    _lock: Any

    @property
    def active(self) -> bool: ...

    def remove(self) -> None: ...

    def step_now(self, params: list[Tensor], grads: Optional[list[Tensor]] = None) -> None: ...

    def _backward_reached(self, grad: Any) -> None: ...


def is_ddp(module: nn.Module) -> bool:
    return isinstance(module, nn.parallel.DistributedDataParallel)


def is_fsdp2(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 keeps it under _composable
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
        except ImportError:
            return False
    return isinstance(module, FSDPModule)


class ModuleSync:
    """The hooks on a DDP or FSDP2 ``module`` of one :class:`~smmf.backward.StepInBackward`."""

    def __init__(self, handle: Window, module: nn.Module, params: set[Tensor]) -> None:
        self.handle, self.module = handle, module
        self.ddp = is_ddp(module)
        # The params DDP reduces (its buckets'), and those of them that are the optimizer's, whose step the
        # communication hook takes; the module's other params keep DDP's averaged gradient (another
        # optimizer's) or their own (those DDP ignores or that were frozen: their own hooks step them).
        self.reduced = _ddp_reduced(module) if self.ddp else set()
        self.bucketed: set[Tensor] = self.reduced & params
        # Whether the backward of the last forward syncs, and so closes the window: decided at that
        # forward (DDP may all-reduce in its own end-of-backward callback, after the count has moved on).
        self.closes = handle.accumulation_steps == 1
        if self.ddp:  # first: DDP refuses a second communication hook, before anything else is hooked
            ddp: Any = module
            # DDP keeps the hook in C++, where the garbage collector cannot see it: holding this sync
            # strongly would make a cycle (the DDP module → the hook → this sync → the module) that is
            # never collected. The handle keeps the sync alive; once both are gone, DDP's averaging.
            # (A lambda: DDP checks the hook's annotations against the classes, not the strings ours are.)
            sync = weakref.ref(self)
            ddp.register_comm_hook(ddp.process_group, lambda group, bucket: _comm_hook(sync, group, bucket))
        self._handles = [module.register_forward_pre_hook(self._set_sync),
                         module.register_forward_hook(self._count_backward)]

    def adopt(self, params: list[Tensor]) -> None:
        """Take ``params`` added to the optimizer after install (:meth:`~smmf.SMMF.add_param_group`): under
        DDP the communication hook steps those of the module, as those given at install."""
        self.bucketed |= self.reduced.intersection(params)

    def remove(self) -> None:
        """Unhook; DDP cannot drop a communication hook, so ours then averages as DDP's own does."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._set_sync(self.module, ())
        self.bucketed = set()

    def _set_sync(self, module: Any, args: Any) -> None:
        handle = self.handle
        sync = not handle.active or handle._micro + 1 >= handle.accumulation_steps
        self.closes = sync
        if self.ddp:
            module.require_backward_grad_sync = sync
        else:
            module.set_requires_gradient_sync(sync)

    def _count_backward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Make every backward through the module's output count, hooks or not."""
        if not (torch.is_grad_enabled() and self.handle.active):
            return
        tensors = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self.handle._backward_reached, mode="any")

    def _reduce_and_step(self, group: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        closes = self.closes and self.handle.active
        return _average(group, bucket).then(lambda done: self._step_bucket(bucket, done.value()[0], closes))

    def _step_bucket(self, bucket: dist.GradBucket, reduced: Tensor, closes: bool) -> Tensor:
        with self.handle._lock:  # the future may complete on another thread than autograd's
            grads = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients())
                     if p in self.bucketed and p.grad is not None]
            if not grads or not closes:
                return reduced  # DDP writes the averaged gradients into .grad, as without the hook
            try:
                self.handle.step_now([p for p, _ in grads], [g for _, g in grads])
            except BaseException:
                self.handle._failed = True  # the next backward refuses until reset()
                raise
            for _, grad in grads:  # views of the bucket: only the stepped params' gradients become zeros
                grad.zero_()
            return reduced


def _ddp_reduced(ddp: Any) -> set[Tensor]:
    """The params a DDP model reduces in its buckets: as DDP chose them when it was built, those that
    required grad and are not in its ``parameters_to_ignore``. DDP keeps no list of them, so the choice is
    made again here from the flags as they are now (DDP does not support changing them after it is built)."""
    ignored: set[str] = getattr(ddp, "parameters_to_ignore", set())
    return {p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored}


def _comm_hook(sync: weakref.ref[ModuleSync], group: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    live = sync()
    if live is None:
        return _average(group, bucket).then(lambda done: done.value()[0])
    return live._reduce_and_step(group, bucket)


def _average(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[list[Tensor]]:
    """DDP's own averaging of a bucket: divide, then sum over the ranks."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    reduced = dist.all_reduce(buffer, group=group, async_op=True)
    assert reduced is not None
    return reduced.get_future()


def managed_elsewhere(sync: Optional[ModuleSync]) -> set[Tensor]:
    """The params that DDP's communication hook steps: no post-accumulate-grad hook for them."""
    return sync.bucketed if sync is not None else set()
