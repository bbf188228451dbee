"""The optimizer step inside backward: each parameter is updated, and its gradient freed, as soon as
its gradient is ready — so at most a few gradients exist at once instead of all of them.

With SMMF's tiny state, training memory is then about weights + activations. The optimizer object
stays an ordinary one: ``param_groups`` (and so ``torch.optim.lr_scheduler``), ``state_dict`` and
``load_state_dict`` work and checkpoints are interchangeable with the ordinary loop.

What "the same as the ordinary loop" takes, and how it is kept:

- **Windows are counted per backward, not per parameter.** ``accumulation_steps=k``: the k-th
  backward of a window steps each parameter in its hook; a parameter the k-th micro-batch did not
  reach, but an earlier one did, is stepped when that backward ends (with whatever else still holds a
  gradient), as ``optimizer.step()`` after k backwards would.
- **The group is looked up when the hook fires**, so ``load_state_dict``, schedulers and
  ``add_param_group`` (its params get hooks too) act on the next step.
- **Reentrant backwards** (activation checkpointing with ``use_reentrant=True`` runs a backward per
  segment inside the outer one): a parameter whose gradient arrives in one is stepped once, when the
  outermost backward ends, after all its contributions.
- **A backward that raises** leaves the parameters it already stepped stepped; the window is then
  open and the next backward refuses to run until :meth:`StepInBackward.reset` discards it.
- **``step()`` and ``zero_grad()`` leave the hooked parameters alone**: their gradients belong to
  the hooks' window, so a loop that calls them after every micro-batch takes the same steps.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
import weakref
from types import FrameType
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .backward_ranks import ModuleSync, is_ddp, is_fsdp2, managed_elsewhere
from .engine import Engine
from .optimizer import SMMF
from .sharding import is_dtensor, local, shard_info
from .state import LAYOUT_OPTIONS, check_state_fits, init_state

__all__ = ["step_in_backward", "StepInBackward"]

_ENGINE = torch.autograd.Variable._execution_engine
# The frames of a Python autograd Function's backward (activation checkpointing's among them) and of
# a run of the autograd engine: a hook that fires with an engine run above the first on the stack
# runs in a backward launched from inside another.
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__
_ENGINE_RUN = torch.autograd.graph._engine_run_backward.__code__


def _enclosing_backward_node() -> Any:
    """The node of the outermost backward whose own backward launched the one running now (reentrant
    checkpointing), or ``None`` when the running backward is the outermost. A Function whose backward
    calls the hook itself, with no engine run between (FSDP2's reduce-scatter fires the hooks of the
    sharded params from its post-backward Function), does not enclose it."""
    node, nested = None, False
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _ENGINE_RUN:
            nested = True
        elif frame.f_code is _FUNCTION_BACKWARD and nested:
            node, nested = frame.f_locals.get("self"), False
        frame = frame.f_back
    return node


class _EndOfBackward:
    """Queued on the outermost backward; the engine drops it unrun when that backward raises, so a
    dead weak reference to it means the backward failed. Until it is queued (a backward whose first
    hook fired in a reentrant one), the graph task it was made in tells a later backward apart."""

    def __init__(self, owner: StepInBackward) -> None:
        self.owner = owner
        self.graph_task = torch._C._current_graph_task_id()  # ids grow: a later backward's are larger
        self.queued = False

    def queue(self) -> None:
        if not self.queued:
            self.queued = True
            _ENGINE.queue_callback(self)

    def __call__(self) -> None:
        self.owner._end_of_backward()


class _EndOfReentrant:
    """Queued on each reentrant backward that reaches a hook: run, it closes; dropped unrun, that
    backward (and so the outer one) raised."""

    def __init__(self, owner: StepInBackward, graph_task: int) -> None:
        self.owner, self.graph_task = owner, graph_task

    def __call__(self) -> None:
        self.owner._reentrant_open.pop(self.graph_task, None)


# The attribute by which a hooked param keeps its StepInBackward alive (see _Hook).
_KEEPS_ALIVE = "_smmf_step_in_backward"


class _KeepAlive:
    """What a hooked param holds in its attribute :data:`_KEEPS_ALIVE`: its handle. A copy or a pickle
    of the param (``copy.deepcopy(model)``, ``torch.save(model)``) gets an empty one: the copy is not
    hooked, and the handle (a lock, the optimizer) is neither copied nor pickled."""

    __slots__ = ("handle",)

    def __init__(self, handle: Optional["StepInBackward"] = None) -> None:
        self.handle = handle

    def __deepcopy__(self, memo: dict[int, Any]) -> "_KeepAlive":
        return _KeepAlive()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _KeepAlive, ()


class _Hook:
    """The hook a param holds: its handle by weak reference. Autograd keeps a param's hooks where the
    garbage collector cannot see them, so a strong reference there (param → hook → handle → optimizer
    → param) would make a cycle that is never collected: a model dropped with its optimizer would stay
    in memory. The param keeps the handle alive instead through an attribute (:data:`_KEEPS_ALIVE`),
    which the collector does see."""

    __slots__ = ("handle", "warned")

    def __init__(self, handle: "StepInBackward") -> None:
        self.handle = weakref.ref(handle)
        self.warned = False

    def __call__(self, param: Tensor) -> None:
        handle = self.handle()
        if handle is not None:
            handle._hook(param)
        elif not self.warned:  # only if the attribute was deleted or replaced: say so once per param
            self.warned = True
            warnings.warn(f"the step inside backward of a param of shape {tuple(param.shape)} is gone: its handle "
                          f"was freed (the param's {_KEEPS_ALIVE!r} attribute was removed), so its gradient "
                          "now accumulates as in the ordinary loop", RuntimeWarning, stacklevel=2)


class StepInBackward(Engine):
    """The hooks :func:`step_in_backward` registered: :meth:`remove` restores the ordinary loop,
    :meth:`reset` discards a window a failed backward left open. The optimizer's engine (:mod:`smmf.engine`) while
    installed: its ``step()`` only runs the closure and its ``zero_grad()`` does nothing."""

    steps_itself = True

    def __init__(self, optimizer: SMMF, accumulation_steps: int, module: Optional[nn.Module] = None,
                 clip_grad_norm: Optional[float] = None) -> None:
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.clip_grad_norm = clip_grad_norm
        self._lock = threading.RLock()  # CPU and CUDA params' hooks (and DDP's futures) fire on other threads
        self._handles: dict[Tensor, Any] = {}
        self._micro = 0  # backwards completed in the current window
        self._ending: Optional[weakref.ref[_EndOfBackward]] = None  # set while a backward runs
        self._stepped: set[Tensor] = set()  # stepped in the running backward
        self._reentrant: set[Tensor] = set()  # got a gradient inside a reentrant backward, ever
        self._late: set[Tensor] = set()  # got gradient after their step in the running backward
        self._failed = False  # a backward ended in an error: reset() before the next one
        self._reentrant_open: dict[int, weakref.ref[_EndOfReentrant]] = {}  # by graph task id
        self._layouts: dict[int, tuple[Any, ...]] = {}  # each group's layout options at the last backward
        params = {p for group in optimizer.param_groups for p in group["params"]}
        self._sync = ModuleSync(self, module, params) if module is not None else None
        try:
            for group in optimizer.param_groups:
                self.attach(group["params"])
        except BaseException:
            self.remove()  # DDP keeps its communication hook: unhooked, it averages as DDP's own
            raise

    @property
    def active(self) -> bool:
        return self.optimizer._engine is self

    def attach(self, params: list[Tensor]) -> None:
        """Hook ``params`` (the optimizer's :meth:`~SMMF.add_param_group` calls this), or refuse them
        before anything changes. Frozen ones get a hook too, which fires once they are unfrozen (under
        DDP, the params DDP reduces are stepped by its communication hook instead). The state of every
        param that takes gradients is made now, as the first step would make it:
        ``torch.distributed.checkpoint``'s state dicts make a missing state by calling ``step()`` with
        zero gradients on those params, which does nothing here. Frozen params get none, as there, so
        that a checkpoint of either loop has the keys the other's asks for (one unfrozen later gets its
        state at its first step, or from :meth:`make_missing_state`)."""
        _refuse_unreduced(self._sync.module if self._sync is not None else None, params)
        for param in params:
            if not param.is_leaf:  # torch takes a non-leaf that retains its grad; its hook cannot be registered
                raise ValueError("step_in_backward steps leaf tensors only (a post-accumulate-grad hook needs a leaf): "
                                 f"a parameter of shape {tuple(param.shape)} is not one")
        made = self._missing_state()  # may refuse (a DTensor's placement): before anything changes
        if self._sync is not None:
            self._sync.adopt(params)
        self.optimizer.state.update(made)
        elsewhere = managed_elsewhere(self._sync)
        for param in params:
            if param in self._handles or param in elsewhere:
                continue
            frozen = not param.requires_grad
            if frozen:
                param.requires_grad_(True)
            try:
                self._handles[param] = param.register_post_accumulate_grad_hook(_Hook(self))
                setattr(param, _KEEPS_ALIVE, _KeepAlive(self))
            finally:
                if frozen:
                    param.requires_grad_(False)

    def _missing_state(self) -> dict[Tensor, dict[str, Any]]:
        """The state of each param that takes gradients and has none yet, as its first step makes it."""
        return {param: init_state(param, group) for group in self.optimizer.param_groups for param in group["params"]
                if param.requires_grad and not self.optimizer.state.get(param)}

    def make_missing_state(self) -> None:
        """Make the state of params unfrozen since install (``SMMF.state_dict`` calls this): DCP's state
        dicts only make state when the optimizer has none at all, and the template of a checkpoint's load
        would otherwise lack theirs."""
        self.optimizer.state.update(self._missing_state())

    before_state_dict = make_missing_state

    def before_step(self) -> None:
        """``optimizer.step()`` steps nothing: the hooks did. It refuses DeepSpeed ZeRO, which steps the optimizer
        itself."""
        _refuse_deepspeed_buffers(self.optimizer)

    def remove(self) -> None:
        """Unhook: ``step()`` and ``zero_grad()`` act again; gradients accumulated in an unfinished
        window stay in ``.grad`` for the ordinary loop to use."""
        with self._lock:
            for param, handle in self._handles.items():
                handle.remove()
                if getattr(getattr(param, _KEEPS_ALIVE, None), "handle", None) is self:
                    delattr(param, _KEEPS_ALIVE)
            self._handles = {}
            if self.active:
                self.optimizer._engine = Engine()
            if self._sync is not None:
                self._sync.remove()

    def reset(self) -> None:
        """Discard the current window: every gradient of the optimizer's params is dropped and the
        count of micro-batches restarts (after a backward that raised, or to drop a partial window)."""
        with self._lock:
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
            self._micro, self._ending, self._failed = 0, None, False
            self._stepped.clear()
            self._late.clear()
            self._reentrant_open.clear()

    def _hook(self, param: Tensor) -> None:
        # Fires once per backward for each param, after its uses in that backward have been summed in.
        with self._lock:
            enclosing = _enclosing_backward_node()
            self._note_backward(enclosing)
            if self._micro + 1 < self.accumulation_steps:
                return  # accumulating: the window closes on a later backward
            if param in self._stepped:  # refused when this backward ends (all such params then known)
                self._late.add(param)
                self._reentrant.add(param)  # from now on stepped when each backward ends
                return
            if enclosing is not None or param in self._reentrant:
                self._reentrant.add(param)  # stepped when the outermost backward ends
                return
            self.step_now([param])
            self._stepped.add(param)

    def step_now(self, params: list[Tensor], grads: Optional[list[Tensor]] = None) -> None:
        """Step ``params`` (with ``grads`` in place of their ``.grad``), then free their ``.grad``."""
        with self._lock:
            if self.clip_grad_norm is not None:
                for param, grad in zip(params, grads if grads is not None else [p.grad for p in params]):
                    if grad is not None:
                        clip_tensor_norm_(param, grad, self.clip_grad_norm)
            # Each param with its group as the optimizer holds it now (load_state_dict replaces the dicts).
            places = self.optimizer._places_now()
            # A param taken out of every group since its hook was installed is left alone, with its gradient,
            # as the loop's optimizer.step() leaves it.
            kept = [i for i, p in enumerate(params) if id(p) in places]
            if len(kept) < len(params):
                params = [params[i] for i in kept]
                grads = None if grads is None else [grads[i] for i in kept]
            self.optimizer.step_params([(places[id(p)][1], p) for p in params], grads)
            if grads is None:
                for param in params:
                    param.grad = None

    def _backward_reached(self, grad: Any) -> None:
        """A backward reached the module's output: counted even when no param hook fires in it."""
        with self._lock:
            self._note_backward(_enclosing_backward_node())

    def _note_backward(self, enclosing: Any) -> None:
        """Make sure the end of the outermost backward is seen; refuse to go on after a failed one."""
        if any(end() is None for end in self._reentrant_open.values()):
            self._failed = True  # a reentrant backward raised: so did the one around it
        if enclosing is not None and not self._failed:
            graph_task = torch._C._current_graph_task_id()
            if graph_task not in self._reentrant_open:
                end = _EndOfReentrant(self, graph_task)
                self._reentrant_open[graph_task] = weakref.ref(end)
                _ENGINE.queue_callback(end)
        ending = self._ending() if self._ending is not None else None
        if ending is not None and not self._failed:
            if ending.queued:
                return  # this backward's end is queued
            if enclosing is not None:
                return  # another reentrant backward inside the same outer one
            if torch._C._current_graph_task_id() < ending.graph_task:
                ending.queue()  # the outer backward that the reentrant one ran inside
                return
            # An outer backward started after the one that made ``ending``: that one raised before
            # its end was queued (its graph, kept alive by the caller, still holds ``ending``).
        if self._ending is not None or self._failed:
            self._failed = True
            raise RuntimeError(
                "a backward pass raised before step_in_backward's window ended: the parameters it had stepped "
                "stay stepped, the others hold partial gradients. Call reset() on the handle step_in_backward "
                "returned to discard them, then go on."
            )
        try:
            self._check_layouts()
        except RuntimeError:
            self._failed = True  # this backward's first gradient is in: reset() drops it
            raise
        ending = _EndOfBackward(self)
        self._ending = weakref.ref(ending)
        if enclosing is None:
            ending.queue()
            return
        # In a reentrant backward a callback would run at its end, not the outermost's: queue it from
        # the outer backward, when a node that takes the enclosing node's gradients runs.
        handles: list[Any] = []

        def queue_on_outer(*_: Any) -> None:
            for handle in handles:
                handle.remove()
            if self._ending is not None and self._ending() is ending:
                ending.queue()

        handles.extend(node.register_prehook(queue_on_outer) for node, _ in enclosing.next_functions if node is not None)

    def _check_layouts(self) -> None:
        """At the start of a backward: a group option that decides the state's layout, changed since
        the last backward, is refused before any parameter of this backward is stepped."""
        seen = {}
        for group in self.optimizer.param_groups:
            options = tuple(group.get(key) for key in LAYOUT_OPTIONS)
            if self._layouts.get(id(group)) != options:
                for param in group["params"]:
                    if self.optimizer.state.get(param):
                        check_state_fits(param, group, self.optimizer.state[param])
            seen[id(group)] = options
        self._layouts = seen

    def _end_of_backward(self) -> None:
        with self._lock:
            self._ending = None
            self._stepped.clear()
            if self._late:
                late, self._late, self._failed = len(self._late), set(), True
                raise RuntimeError(
                    f"step_in_backward stepped {late} parameter(s) with the gradient they had, then they got more "
                    "gradient in the same backward, inside a reentrant backward (activation checkpointing with "
                    "use_reentrant=True of a parameter also used outside the checkpoint). From now on they are "
                    "stepped when each backward ends: call reset() on the handle and go on, or use "
                    "use_reentrant=False."
                )
            self._micro += 1
            if self._micro < self.accumulation_steps:
                return
            self._micro = 0
            # What the hooks left: params this micro-batch did not reach, and those deferred by reentrancy.
            elsewhere = managed_elsewhere(self._sync)
            left = [p for group in self.optimizer.param_groups for p in group["params"]
                    if p.grad is not None and p not in elsewhere]
            try:
                self.step_now(left)
            except BaseException:
                self._failed = True  # their gradients stay for reset() to drop
                raise


def clip_tensor_norm_(param: Tensor, grad: Tensor, max_norm: float) -> None:
    """Scale ``grad`` in place to an L2 norm of at most ``max_norm``, as ``clip_grad_norm_`` does for
    this one tensor: the norm of the whole tensor (an FSDP2 shard's squares summed across its ranks)."""
    info = shard_info(param)
    piece = local(grad)
    if info is not None and info.sharded:
        squares = torch.linalg.vector_norm(piece, 2).pow(2)
        torch.distributed.all_reduce(squares, group=info.mesh.get_group())
        norm = squares.sqrt()
    else:
        norm = torch.linalg.vector_norm(piece, 2)
    piece.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def _refuse_deepspeed_buffers(optimizer: SMMF) -> None:
    if "deepspeed" in sys.modules:
        from .zero_engine import holds_buffers

        if holds_buffers(optimizer):
            raise RuntimeError(
                "the step inside backward cannot run under DeepSpeed ZeRO: ZeRO steps the optimizer itself, on flat "
                "buffers of the parameters, after its own gradient reduction. Remove step_in_backward and let the "
                "engine step")


def _refuse_unreduced(module: Optional[nn.Module], params: list[Tensor]) -> None:
    """Across ranks, refuse plain ``params`` whose step would see this rank's gradient alone: all of them
    without ``module``, those outside it with it (DTensors are FSDP2's, which reduce-scatters them)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return
    if module is None:
        if not all(is_dtensor(p) for p in params):
            raise RuntimeError(
                "step_in_backward needs the module that reduces the gradients across ranks: each param's step would "
                "otherwise see this rank's gradient before the all-reduce. Pass module=<your DistributedDataParallel "
                "model>, or use the ordinary optimizer.step()."
            )
        return
    in_module = set(module.parameters())
    outside = [p for p in params if p not in in_module and not is_dtensor(p)]
    if outside:
        raise RuntimeError(
            f"{len(outside)} of the optimizer's parameters are not in the module given to step_in_backward: their "
            "step would see this rank's gradient before any all-reduce. Give the optimizer only the module's "
            "parameters, or use the ordinary optimizer.step()."
        )


def step_in_backward(optimizer: SMMF, accumulation_steps: int = 1, module: Optional[nn.Module] = None,
                     clip_grad_norm: Optional[float] = None) -> StepInBackward:
    """Run ``optimizer``'s step for each parameter inside backward, and free its gradient.

    ``accumulation_steps=k`` accumulates k backward passes (micro-batches) and steps during the k-th;
    the gradients then live from the first to the k-th, as in ordinary accumulation. One backward is
    one micro-batch, whichever parameters it reaches (a backward that reaches none of the optimizer's
    parameters is not counted). The loop is ``loss.backward()`` per micro-batch; ``optimizer.step()``
    and ``optimizer.zero_grad()`` may stay in it and do nothing to the hooked parameters.

    ``module``: across ranks, the ``DistributedDataParallel`` or FSDP2 (``fully_shard``) model that
    reduces the gradients. Under DDP it is required: each bucket's parameters are stepped when its
    all-reduce completes (their ``.grad`` then holds zeros: DDP keeps its buckets). Under FSDP2 each
    shard is stepped when its reduce-scatter is done, with or without ``module``; given it, the first
    k−1 micro-batches of a window run without gradient sync (do not switch sync yourself then).

    ``clip_grad_norm``: clip each parameter's gradient to this L2 norm before its step, as
    ``torch.nn.utils.clip_grad_norm_([param], clip_grad_norm)`` would (per tensor, the whole tensor's
    norm across ranks), on the window's accumulated gradient. Clipping by the global norm cannot work
    here: that norm is known only once every gradient exists.

    After a backward that raised, call ``reset()`` on the returned handle before the next one: it
    discards the unfinished window (parameters the failed backward had stepped stay stepped).

    What cannot work, and fails or is refused: global-norm gradient clipping (the norm is not known
    until every gradient exists; clip per tensor with ``clip_grad_norm``); ``torch.amp.GradScaler`` (the step would run on scaled gradients before the
    scaler could check them; ``scaler.step`` then fails with its "No inf checks were recorded"
    error); plain parameters reduced across ranks without ``module`` (the step would see this rank's
    gradient before the all-reduce: refused while a process group of more than one rank exists); DDP built
    with ``find_unused_parameters=True`` (a parameter one rank leaves unused would be stepped on the other
    ranks only); installing twice on one optimizer.
    """
    if not isinstance(optimizer, SMMF):
        raise TypeError(f"step_in_backward takes an smmf.SMMF optimizer, not {type(optimizer).__name__}")
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps should be an int >= 1 but is: {accumulation_steps!r}")
    if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and not isinstance(clip_grad_norm, bool)
                                           and 0 < clip_grad_norm < math.inf):
        raise ValueError(f"clip_grad_norm should be a finite number > 0 or None but is: {clip_grad_norm!r}")
    if module is not None and not (is_ddp(module) or is_fsdp2(module)):
        raise TypeError("module should be the DistributedDataParallel or FSDP2 (fully_shard) model that reduces the "
                        f"gradients, not {type(module).__name__}")
    if module is not None and is_ddp(module) and module.find_unused_parameters:
        raise ValueError(
            "step_in_backward cannot take a DistributedDataParallel model built with find_unused_parameters=True: "
            "a parameter that one rank leaves unused has no gradient there when its bucket is reduced, so the "
            "other ranks would step it and that one not, and the replicas would drift apart. Build DDP without it "
            "(DDP then reports a parameter left unused), or use the ordinary optimizer.step()."
        )
    _refuse_deepspeed_buffers(optimizer)
    _refuse_unreduced(module, [p for group in optimizer.param_groups for p in group["params"]])
    if isinstance(optimizer._engine, StepInBackward):
        raise RuntimeError(
            "step_in_backward is already installed on this optimizer; call remove() on its handle before "
            "installing it again"
        )
    handle = StepInBackward(optimizer, accumulation_steps, module, float(clip_grad_norm) if clip_grad_norm else None)
    optimizer._engine = handle
    return handle
