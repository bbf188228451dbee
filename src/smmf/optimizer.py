"""``SMMF``: the optimizer contract (validation, lazy state, checkpoints); the math is elsewhere."""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Optional, Union, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from .dispatch import Kernel, Route, explain, step_kernel
from .functional import StepConfig
from .levels import rounding_key, step_salt
from .matrix import packed_sign_bytes
from . import options as registry
from .options import fill_optional, validate_group
from .schedules import beta1_at, beta2_at
from .schema import PIECES, PLACES
from .sharding import (bits_for_checkpoint, bits_from_checkpoint, has_rows_layout, is_dtensor, placed_like, rows_from_flat,
                       shard_info)
from .state import (
    BIT_FIELDS,
    LAYOUT_OPTIONS,
    MOMENTUM_CODE_DEFAULTS,
    STEP,
    MomentumCode,
    check_loaded_state,
    check_state_fits,
    init_state,
    momentum_code,
    state_layout,
)

if TYPE_CHECKING:
    from .backward import StepInBackward
    from .partitions import Partition

__all__ = ["RECOMMENDED", "RECOMMENDED_BF16", "SMMF"]

ParamsT = Union[Iterable[Tensor], Iterable[dict[str, Any]]]

RECOMMENDED: dict[str, Any] = {"magnitude_bits": 3, "momentum_rounding": "stochastic", "decay_rate": -0.8,
                               "growth_rate": None}
"""The options beyond the paper that we recommend, as ``SMMF`` keyword arguments: ``SMMF(params, **smmf.RECOMMENDED)``.
M in the block-levels code (``magnitude_bits=3``, 4.125 bits per parameter) with its levels rounded stochastically,
β2's decay rate γ = −0.8 and β1 held at ``beta``; weight decay stays decoupled, as AdamW's. On the language models
we measured it keeps AdamW's loss where the paper's code does not; for CNNs ``dict(smmf.RECOMMENDED,
decay_rate=-0.5)`` is the steadier choice. The evidence, with the tasks each setting was chosen and confirmed on:
docs/beyond-the-paper.md, docs/high-lr.md, docs/momentum-diagnosis.md. The default of ``SMMF`` stays the paper's
algorithm. A plain dict: take ``dict(smmf.RECOMMENDED)`` to change it."""
RECOMMENDED_BF16: dict[str, Any] = {**RECOMMENDED, "stochastic_rounding": True}
"""``smmf.RECOMMENDED`` for bf16 weights stepped without an fp32 copy: the same options, and each updated weight
rounded to bf16 stochastically (round to nearest loses every update under half a bf16 ulp of the weight; the
rounding leaves fp32 and fp64 weights alone). The quality it keeps against fp32 weights, per task and phase of
training, and the bytes per parameter: docs/training.md."""
# Keys that torch adds to param groups: learning-rate schedulers (``swa_lr``: ``swa_utils.SWALR``), and
# ``param_names`` in an optimizer built from ``named_parameters()`` (torch >= 2.6).
_TORCH_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr", "base_lr", "max_momentum", "base_momentum", "swa_lr",
                     "param_names")
_IN_BACKWARD_UNDER_DEEPSPEED = (
    "the step inside backward cannot run under DeepSpeed ZeRO: ZeRO steps the optimizer itself, on flat buffers of "
    "the parameters, after its own gradient reduction. Remove step_in_backward and let the engine step")
# A graph break under torch.compile, in the lazy form torch's own optimizers use: it imports dynamo at the first
# call, where ``torch.compiler.disable`` imports it as it decorates, which slowed ``import smmf`` (docs/design.md),
# and dynamo never traces into it. The public decorator where a torch lacks it.
_graph_break: Callable[[Callable[..., Any]], Callable[..., Any]] = getattr(torch, "_disable_dynamo",
                                                                      torch.compiler.disable)


_MISSING = object()


def _options_key(group: dict[str, Any]) -> tuple:
    """A group's options as :meth:`SMMF._check_options` compares them: each value with its type (``True`` is not
    ``1``, ``3`` not ``3.0``), a tensor by identity, a missing key as missing."""
    return tuple((type(value), id(value) if isinstance(value, Tensor) else value)
                 for value in (group.get(option.name, _MISSING) for option in registry.OPTIONS))


def _is_pieces_state(saved: Any) -> bool:
    """Whether a param's saved state is a DeepSpeed ZeRO buffer's (its pieces', :mod:`smmf.partitions`)."""
    return isinstance(saved, dict) and PIECES in saved


def _reject_non_float(param: Tensor) -> None:
    if not (param.is_floating_point() or param.is_complex()):
        raise ValueError(f"SMMF optimizes floating-point or complex parameters, got a {param.dtype} parameter")


def _check_grad(param: Tensor, grad: Tensor) -> None:
    """The kernels trust a gradient to be dense and to match its param in shape, dtype and device."""
    if grad.is_sparse:
        raise RuntimeError("SMMF does not support sparse gradients")
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        raise RuntimeError(
            f"a parameter of shape {tuple(param.shape)} ({param.dtype}, {param.device}) has a gradient of shape "
            f"{tuple(grad.shape)} ({grad.dtype}, {grad.device}); they must match"
        )


class NonfiniteMonitor:
    """Warns once when a step met NaN/inf gradient elements (``nonfinite_grads="zero"``).

    Kernels report how many elements they zeroed: a number, or a CUDA tensor that is copied to the
    host without waiting and read at a later step once it has arrived (so a CUDA warning comes a
    step late, and no step ever synchronizes for it).
    """

    def __init__(self) -> None:
        self.warned = False
        self.pending: list[tuple[Tensor, Any]] = []

    def report(self, count: Union[int, Tensor, None]) -> None:
        if self.warned or count is None:
            return
        if isinstance(count, Tensor):
            host = torch.empty(count.shape, dtype=count.dtype, pin_memory=True)
            host.copy_(count, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
            self.pending.append((host, arrived))
        elif count:
            self._warn(count)

    def poll(self) -> None:
        still = []
        for host, arrived in self.pending:
            if not arrived.query():
                still.append((host, arrived))
            elif not self.warned and (count := int(host.sum())):
                self._warn(count)
        self.pending = still

    def _warn(self, count: int) -> None:
        self.warned = True
        self.pending = []
        warnings.warn(
            f"SMMF met {count} NaN/inf gradient element(s) in one step and treated them as zero gradients "
            "(nonfinite_grads='zero'; 'propagate' lets them through). Warned once per optimizer.",
            RuntimeWarning,
            stacklevel=3,
        )


def _mark_written(kernel: Kernel, written: list[tuple[Tensor, dict[str, Any]]]) -> None:
    """Bump the autograd version of what a fused kernel wrote through raw pointers (each param and
    its state), as an in-place torch op would (the torch path's own in-place ops do it); one call
    for them all, as this runs for every param at every step."""
    if kernel.raw_writes:
        _bump_versions([t for param, state in written for t in (param, *state.values()) if isinstance(t, Tensor)])


def _mark_buffer_written(buffer: Tensor, held: dict[str, Any]) -> None:
    """:func:`_mark_written` for a DeepSpeed ZeRO buffer (its pieces are views of it) and its pieces' state."""
    _bump_versions([buffer] + [t for state in held[PIECES].values() for t in state.values() if isinstance(t, Tensor)])


def _bump_versions(tensors: list[Tensor]) -> None:
    if _VERSION_BUMP_TAKES_MANY:
        torch.autograd.graph.increment_version(tensors)
    else:
        for tensor in tensors:
            torch.autograd.graph.increment_version(tensor)


def _version_bump_takes_many() -> bool:
    """Whether this torch's ``increment_version`` takes a list (newer than the oldest torch supported)."""
    try:
        torch.autograd.graph.increment_version([torch.zeros(1)])
    except (TypeError, RuntimeError):
        return False
    return True


_VERSION_BUMP_TAKES_MANY = _version_bump_takes_many()


def _reject_flattened(param: Tensor) -> None:
    """SMMF's factorization depends on each tensor's true shape: a flattened buffer would be
    factorized as one meaningless matrix. FSDP1 marks the params it flattens (with or without
    ``use_orig_params``). DeepSpeed ZeRO's buffers are mapped back to the model's params at the first
    step (:mod:`smmf.zero`)."""
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


class GivenParams:
    """The params an optimizer was given, each with its place over the groups as given, held weakly: an engine
    may swap them for its own tensors (Accelerate's FSDP2 shards, DeepSpeed ZeRO's flat buffers) and free them, as
    it would under torch's optimizers."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[weakref.ref[Tensor], int]] = {}

    def add(self, params: Iterable[Tensor], first_place: int) -> None:
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


class SMMF(Optimizer):
    r"""Square-Matricized Momentum Factorization (Park & Lee, AAAI-25).

    .. math::
       \begin{aligned}
         &\textbf{input}: \eta \text{ (lr)}, \beta_1 \text{ (beta)}, \lambda \text{ (growth\_rate)},
            \gamma \text{ (decay\_rate)}, \epsilon, w \text{ (weight\_decay)} \\
         &\textbf{initialize}: r_M, c_M, S_M, r_V, c_V \leftarrow 0;\;
            (\hat n, \hat m) \leftarrow \text{square-matricize}(\text{numel}(W)) \\
         &\textbf{for}\: t = 1, 2, \ldots \\
         &\quad \bar G \leftarrow \nabla_W f \text{ viewed as } \hat n \times \hat m
            \;(+\, w W \text{ in adam mode});\quad
            W \leftarrow W (1 - \eta w) \text{ in adamw mode} \\
         &\quad \beta_{1,t} \leftarrow \beta_1 \lambda^{t-1};\quad \beta_{2,t} \leftarrow 1 - t^{\gamma} \\
         &\quad M \leftarrow \beta_{1,t}\, S_M \odot (r_M c_M^\top) + (1 - \beta_{1,t}) \bar G \\
         &\quad V \leftarrow \beta_{2,t}\, r_V c_V^\top + (1 - \beta_{2,t}) \bar G^2 \\
         &\quad S_M \leftarrow [M \ge 0];\; (r_M, c_M) \leftarrow \text{NNMF}(|M|);\;
            (r_V, c_V) \leftarrow \text{NNMF}(V) \\
         &\quad W \leftarrow W - \eta\, M / (\sqrt{V} + \epsilon) \\
       \end{aligned}

    ``NNMF(A)`` is the rank-1 factorization ``r = A·1``, ``c = 1ᵀA / 1ᵀA1`` and
    ``(n̂, m̂)`` minimizes ``n̂ + m̂`` over ``n̂·m̂ = numel``. The state of a tensor is
    ``ceil(n̂·m̂/8)`` bytes of signs plus four fp32 vectors (fp64 for fp64 params).

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate η, a float or a 1-element tensor (default: 1e-3).
        beta: first-moment coefficient β1; ``None`` keeps no first moment (default: 0.9).
        eps: added to ``sqrt(V)`` (default: 1e-8).
        weight_decay: weight-decay coefficient (default: 0).
        decay_rate: γ in ``β2_t = 1 − t^γ``, in [−1, 0]; −0.5 for CNNs, −0.8 for
            Transformers (default: −0.5).
        growth_rate: λ in ``β1_t = β1·λ^(t−1)``; ``None`` keeps β1 constant (default: 0.999).
        vector_reshape: square-matricize 1-D tensors too; ``False`` keeps dense M and V for
            them (a complex vector is stepped as its n×2 real view, and factored) (default: True).
        weight_decay_mode: ``"adamw"`` (decoupled) or ``"adam"`` (L2 added to the gradient;
            use a coefficient ~1000–2000× smaller) (default: ``"adamw"``).
        maximize: maximize the objective instead of minimizing it (default: False).
        stochastic_rounding: round bf16 parameters stochastically when writing the update
            back, with noise that the step and the param's place in the optimizer decide, the same
            on every path and rank (:func:`smmf.levels.rounding_key`): DDP replicas stay equal and
            a resume is exact; torch's generator is left alone (default: False).
        nonfinite_grads: what a NaN or ±inf gradient element does. ``"zero"``: it counts as a zero
            gradient for that element alone (its moments decay, the rest of the tensor is updated
            as usual) and a warning is issued once; ``"propagate"``: it flows into the update as in
            plain torch — a NaN makes the whole tensor NaN, since its factors are sums over it; an inf,
            capped in those sums, makes only its own weight NaN. A NaN weight stays alone either way,
            unless L2 decay adds it to its gradient (docs/robustness.md) (default: ``"zero"``).
        momentum_shape: beyond the paper, opt-in. ``"square"``: M is factorized in the square
            matricization, as in the paper; ``"natural"``: in the tensor's own shape (dim 0 × the
            rest; a conv weight: out_channels × the rest; 1-D tensors stay square), which lets the
            factors hold a per-unit magnitude. V stays square either way (default: ``"square"``).
        magnitude_bits: beyond the paper, opt-in. ``0``: |M| ≈ r cᵀ; ``1``: one more bit per element
            says whether |M| is above r cᵀ, and two per-tensor levels scale r cᵀ where it is / is not,
            so that small momentum coordinates are no longer given their row's average; ``3``: M is
            coded by rows of the tensor, a sign and a 3-bit level per element and a bf16 scale per
            128 elements (4.125 bits per parameter, :mod:`smmf.levels`; ``momentum_shape`` does not
            apply) (default: 0). See docs/beyond-the-paper.md for what each buys;
            ``smmf.RECOMMENDED`` is the measured recommendation.
        momentum_rounding: how ``magnitude_bits=3`` rounds |M| to its levels: ``"nearest"``, or
            ``"stochastic"`` (unbiased: the level above with the probability of the remainder,
            drawn from a hash of the step and the element's index, so runs repeat and resume
            exactly); it keeps small momentum coordinates that nearest rounding sets to 0. Other codes
            of M ignore it, so a group may override ``magnitude_bits`` under ``**smmf.RECOMMENDED``; a
            loaded checkpoint's value is taken, like its ``lr`` (default: ``"nearest"``).
        backend: ``"auto"`` (the Triton kernel for CUDA params and the numba kernel for CPU
            params — FSDP2 shards included — each when installed; the
            torch path for what they do not cover: dense 1-D state, fp64 on CUDA, fp16 and complex on
            CPU), or one of ``"torch"``, ``"numba"``,
            ``"triton"``, which raises for a param of a device or dtype it cannot take (dense 1-D state
            and complex CPU params take the torch path whatever is named) (default: ``"auto"``).

    .. note::
        The sign matrix is stored 8 signs per byte (uint8), as the paper counts it; the
        authors' code stores one ``bool`` per element. The sign is ``M >= 0`` as in the paper
        (the authors' code tests ``M > 0``).

    .. note::
        ε is added outside the square root, ``M / (sqrt(V) + ε)``, as in Adam; Alg. 1 of the
        paper writes ``sqrt(V + ε)``. No bias correction is applied (β2_1 = 0, so V_1 = G²).

    .. note::
        Factors stay fp32 for bf16/fp16 parameters and the math runs in fp32, so ε does not
        underflow; :meth:`load_state_dict` keeps fp32 factors and uint8 signs (plain torch
        would cast them to the parameter dtype). Complex parameters are optimized through
        ``torch.view_as_real``.

    Paper: https://arxiv.org/abs/2412.08894
    """

    def __init__(
        self,
        params: ParamsT,
        lr: Union[float, Tensor] = 1e-3,
        beta: Optional[float] = 0.9,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decay_rate: float = -0.5,
        growth_rate: Optional[float] = 0.999,
        vector_reshape: bool = True,
        weight_decay_mode: Literal["adamw", "adam"] = "adamw",
        *,
        maximize: bool = False,
        stochastic_rounding: bool = False,
        nonfinite_grads: Literal["zero", "propagate"] = "zero",
        momentum_shape: Literal["square", "natural"] = "square",
        magnitude_bits: Literal[0, 1, 3] = 0,
        momentum_rounding: Literal["nearest", "stochastic"] = "nearest",
        backend: Literal["auto", "torch", "numba", "triton"] = "auto",
    ) -> None:
        given = locals()
        # The registry's options (smmf.options), at the values given here (tests/test_options.py: the same names
        # and defaults as this signature).
        defaults: dict[str, Any] = {option.name: given.get(option.name, option.default) for option in registry.OPTIONS}
        validate_group(defaults)
        self._places: Optional[tuple[tuple, dict[int, tuple[int, dict[str, Any]]]]] = None  # see _places_now
        self._checked: dict[int, tuple[tuple, tuple]] = {}  # see _check_options
        self._nonfinite = NonfiniteMonitor()
        self._warned_fp16_rounding = False
        self._step_in_backward: Optional[StepInBackward] = None
        # The params given, with their place over the groups as given: DeepSpeed ZeRO puts flat buffers of them in
        # the groups (smmf.zero), whose pieces are mapped back to these. Weakly held: an engine that swaps them for
        # its shards (FSDP2 under Accelerate) frees them.
        self._given = GivenParams()
        self._partitions: dict[int, tuple[weakref.ref[Tensor], Optional[Partition]]] = {}
        self._buffer_groups: dict[int, int] = {}  # a ZeRO buffer's group, by its place in _all_groups
        super().__init__(params, defaults)
        self._all_groups = self.param_groups  # see _full_groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            validate_group(self.param_groups[-1])
            params = self.param_groups[-1]["params"]  # a param given twice is stepped once (torch warns)
            for param in params:
                _reject_non_float(param)
                _reject_flattened(param)
            if self._step_in_backward is not None:  # refuses before it changes anything
                self._step_in_backward.attach(params)
        except (ValueError, RuntimeError, TypeError):
            self.param_groups.pop()
            raise
        self._given.add(params, sum(len(group["params"]) for group in self.param_groups[:-1]))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            fill_optional(group)
        self.__dict__.setdefault("_nonfinite", NonfiniteMonitor())
        self.__dict__.setdefault("_places", None)
        self.__dict__.setdefault("_checked", {})
        self.__dict__.setdefault("_step_in_backward", None)
        if "_given" not in self.__dict__:
            self._given = GivenParams()
            self._given.add([p for group in self.param_groups for p in group["params"]], 0)
        self.__dict__.setdefault("_partitions", {})
        self.__dict__.setdefault("_buffer_groups", {})
        self.__dict__.setdefault("_warned_fp16_rounding", False)
        self._all_groups = self.param_groups  # torch's load_state_dict sets new groups through here

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss.

        Under :func:`smmf.step_in_backward` the hooks step the parameters: this only runs ``closure``. The step
        DeepSpeed without ZeRO makes at ``deepspeed.initialize`` on fp16 or bf16 weights, with zero gradients, to
        make the optimizer's state, is not taken: SMMF makes its state at the first real step, so that the run
        steps as the plain loop does (no weight decay before training, β2's schedule from the first batch)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.state and self._step_in_backward is None and "deepspeed" in sys.modules:
            from .zero import stepping_to_make_state

            if stepping_to_make_state():
                return loss
        if self._step_in_backward is None:
            try:
                self.step_params([(group, p) for group in self.param_groups for p in group["params"]
                                  if p.grad is not None])
            except BaseException:
                if self._full_groups() is not self.param_groups:  # DeepSpeed ZeRO-1/2 restores them only on success
                    self.param_groups = self._all_groups
                raise
        elif self.holds_deepspeed_buffers():
            raise RuntimeError(_IN_BACKWARD_UNDER_DEEPSPEED)
        return loss

    def holds_deepspeed_buffers(self) -> bool:
        """Whether DeepSpeed ZeRO has put flat buffers in this optimizer's groups in place of its params."""
        given = self._given.live()
        return any(self._is_deepspeed_buffer(p, given) for group in self.param_groups for p in group["params"])

    def _is_deepspeed_buffer(self, param: Tensor, given: list[Tensor]) -> bool:
        """Whether ``param`` looks like a DeepSpeed ZeRO buffer (``given``: the live params given), read from what
        DeepSpeed attaches, without mapping its pieces (no collective)."""
        if self._given.holds(param) or "deepspeed" not in sys.modules:
            return False
        from .zero import is_deepspeed_buffer

        return is_deepspeed_buffer(param, given)

    def routes(self) -> list[Route]:
        """Which path steps each param of each group, and why: the backend and kernel (:mod:`smmf.dispatch`), the
        launch the kernel makes of it (a fused backend's shared launches, by size, dtype, layout and code of M),
        for users asking where a step's time goes. A param without state is described as its first step would
        take it; nothing is stepped or stored, and no collective is made. DeepSpeed ZeRO buffers are named as
        such (ZeRO-3 puts its buffers in the groups only while it steps them)."""
        found = []
        given = self._given.live()
        for g, group in enumerate(self.param_groups):
            for i, param in enumerate(group["params"]):
                where = (g, i, tuple(param.shape), param.dtype, param.device)
                if self._is_deepspeed_buffer(param, given):
                    found.append(Route(*where, code="per piece", kernel="DeepSpeed ZeRO partition", launch="pieces",
                                       why="a flat buffer DeepSpeed put in this group: each piece of a tensor is "
                                       "stepped as that tensor (whole) or by the shard passes (cut)"))
                    continue
                code = momentum_code(param, group)
                kernel, why = explain(group["backend"], param, code)
                launch, how = kernel.name, "one tensor at a time"
                if kernel.backend is not None and not is_dtensor(param):
                    state = self.state.get(param) or init_state(param, group)
                    cfg = self._step_config(group, state.get(STEP, 0) + 1, code)
                    launch, how = kernel.backend.launch_of(param, state, cfg)
                elif kernel.backend is not None:
                    how = "this rank's shard, one all-reduce of the sums for every shard of the step"
                found.append(Route(*where, code=code.value, kernel=kernel.name, launch=launch, why=f"{why}; {how}"))
        return found

    def _check_options(self, group: dict[str, Any]) -> None:
        """Check a group's options again when they changed since the last check (schedulers and frameworks
        write ``param_groups``): the constructor's checks, and messages, and the state of the group's DeepSpeed
        ZeRO buffers against its layout options. A tensor ``lr`` is checked at every step, since it may change in
        place."""
        key = self._checked.get(id(group))
        if isinstance(group.get("lr"), Tensor) or key is None or key[0] != _options_key(group):
            validate_group(group)  # raises before the key is kept: a refused value is checked again next step
            layout = tuple(group[name] is None if name == "beta" else group[name] for name in LAYOUT_OPTIONS)
            if key is None or key[1] != layout:  # a scheduler's new lr does not check the buffers again
                self._check_buffer_layouts(group)
            self._warn_fp16_rounding(group)
            groups = self._full_groups()
            if len(self._checked) > 2 * len(groups):  # forget groups that are gone
                live = {id(g) for g in groups}
                self._checked = {ident: value for ident, value in self._checked.items() if ident in live}
            self._checked[id(group)] = (_options_key(group), layout)

    def _warn_fp16_rounding(self, group: dict[str, Any]) -> None:
        """``stochastic_rounding`` rounds bf16 weights only: say so, once per optimizer, for a group that asks for
        it over fp16 weights (rounded to nearest)."""
        if group["stochastic_rounding"] and not self._warned_fp16_rounding and any(
                p.dtype == torch.float16 for p in group["params"]):
            self._warned_fp16_rounding = True
            warnings.warn("SMMF's stochastic_rounding=True rounds bf16 weights only: this group's fp16 weights are "
                          "rounded to nearest. For low-precision weights stepped without an fp32 copy, use bf16 "
                          "(smmf.RECOMMENDED_BF16); for fp16, keep fp32 master weights (torch.autocast and "
                          "GradScaler, or DeepSpeed's fp16)", UserWarning, stacklevel=2)

    def _full_groups(self) -> list[dict[str, Any]]:
        """Every param group, also while DeepSpeed ZeRO-1/2 has cut ``param_groups`` to the one it steps (it
        steps one group a call); a list of other groups put in their place becomes the groups."""
        groups, full = self.param_groups, self._all_groups
        if groups is not full:
            if len(groups) < len(full) and all(any(g is f for f in full) for g in groups) and any(
                    not self._given.holds(p) for g in groups for p in g["params"]):  # ZeRO's buffers, not params
                return full
            self._all_groups = groups  # a user's or framework's own list (params it was given)
        return groups

    def _check_engine_groups(self) -> None:
        """Under DeepSpeed ZeRO, which steps one group (or sub-group) a call: every group's options and the
        layouts of the buffers stepped before, checked before the first of them steps, so that a refusal in
        any group leaves every group as it was."""
        for group in self._full_groups():
            self._check_options(group)

    def _note_buffer_groups(self, buffers: Iterable[Tensor]) -> None:
        """Remember the group of each DeepSpeed ZeRO buffer (stepped, or loaded from a checkpoint), by its place:
        :meth:`_check_buffer_layouts` checks their state when another group steps."""
        place = {id(p): i for i, group in enumerate(self._full_groups()) for p in group["params"]}
        for buffer in buffers:
            if id(buffer) in place:
                self._buffer_groups[id(buffer)] = place[id(buffer)]

    def _check_buffer_layouts(self, group: dict[str, Any]) -> None:
        """The state of every DeepSpeed ZeRO buffer of ``group`` stepped before still fits its options."""
        if not self._buffer_groups:
            return
        from .partitions import check_pieces
        groups = self._full_groups()
        for ident, index in list(self._buffer_groups.items()):
            if index < len(groups) and groups[index] is group:
                ref, partition = self._partitions[ident]
                buffer = ref()
                held = self.state.get(buffer) if buffer is not None else None
                if buffer is not None and held and partition is not None:
                    check_pieces(partition, group, buffer, held,
                                 f"a DeepSpeed ZeRO buffer of {buffer.numel()} elements in param group {index}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; under :func:`smmf.step_in_backward` it does
        nothing (the gradients belong to the hooks' accumulation window: ``reset()`` drops them)."""
        if self._step_in_backward is None:
            super().zero_grad(set_to_none)

    @_graph_break  # the kernels take Python scalars and raw data: torch.compile breaks the graph here
    @torch.no_grad()
    def step_params(self, params: list[tuple[dict[str, Any], Tensor]], grads: Optional[list[Tensor]] = None) -> None:
        """The step of some of the params, each with its group: what :meth:`step` does for all of
        them, and :func:`smmf.step_in_backward` for one as soon as its gradient is ready. ``grads``,
        when given, are the params' gradients in place of their ``.grad`` (DDP's reduced bucket).

        Like an in-place torch op, it bumps the version of every tensor it writes, so autograd
        refuses a graph that saved a weight before the step. A step that raises before its kernels
        write (a bad gradient or state, no kernel for a param) leaves the params, their state and
        its ``step`` count as they were. One that raises after some launches wrote (numba compiling
        a kernel for a new dtype or code at its first use, after the shared launches ran, and
        failing; an interrupt) restores every count, while the tensors already written keep
        their update."""
        if grads is not None and len(grads) != len(params):
            raise ValueError(f"step_params got {len(grads)} gradients for {len(params)} params")
        # Check everything before touching anything: a rejected step changes no param or state.
        places = self._places_now()
        for group in {id(group): group for group, _ in params}.values():
            self._check_options(group)
        work = []
        # DeepSpeed ZeRO's flat buffers: (group, buffer, grad, partition, state before, state)
        buffers: list[tuple[dict[str, Any], Tensor, Tensor, Partition, Optional[dict[str, Any]], dict[str, Any]]] = []
        seen: set[int] = set()  # a param a group holds twice is stepped once
        for (group, param), grad in zip(params, grads if grads is not None else [p.grad for _, p in params]):
            if grad is None or id(param) in seen:
                continue
            seen.add(id(param))
            _check_grad(param, grad)
            partition = self._partition_of(param)
            if partition is not None:  # a DeepSpeed ZeRO buffer: its pieces, by smmf.partitions
                from .partitions import check_pieces, init_pieces

                held = self.state.get(param)
                if held:
                    check_pieces(partition, group, param, held, f"a DeepSpeed ZeRO buffer of {param.numel()} elements")
                buffers.append((group, param, grad, partition, held, held if held else init_pieces(partition, group, param)))
                continue
            ordinal = self._ordinal(param, group, places)
            before = self.state.get(param)
            code = momentum_code(param, group)
            if before:
                check_state_fits(param, group, before, code)
            state: dict[str, Any] = before if before else init_state(param, group)
            work.append((group, param, ordinal, grad, before, state, code, step_kernel(group["backend"], param, code)))
        if buffers:
            self._check_engine_groups()
            self._note_buffer_groups(buffer for _, buffer, *_ in buffers)
        self._nonfinite.poll()
        # Kernels that take many tensors per launch (``kernel.batched``) get them all at once.
        batches: dict[Kernel, list[tuple[Tensor, Tensor, dict[str, Any], StepConfig]]] = {}
        configs: dict[tuple[int, int, MomentumCode], StepConfig] = {}
        pending = []  # (param, its state before) of the steps not yet run: restored if one raises
        met = 0  # NaN/inf elements the host counts: warned once for the whole step, not for its first tensor
        counts = {id(state): state[STEP] for *_, held in buffers for state in held[PIECES].values()}
        try:
            for group, param, ordinal, grad, before, state, code, kernel in work:
                pending.append((param, before))
                if state is not before:
                    self.state[param] = state
                state[STEP] += 1
                cfg = self._config(configs, group, state[STEP], code, ordinal, param.dtype)
                if not kernel.batched:
                    nonfinite = kernel.steps_([(param, grad, state, cfg)])
                    pending.pop()
                    _mark_written(kernel, [(param, state)])
                    met += self._host_count(nonfinite)
                else:
                    batches.setdefault(kernel, []).append((param, grad, state, cfg))
            for kernel, items in batches.items():
                nonfinite = kernel.steps_(items)
                _mark_written(kernel, [(param, state) for param, _, state, _ in items])
                done = {id(param) for param, *_ in items}
                pending = [entry for entry in pending if id(entry[0]) not in done]
                met += self._host_count(nonfinite)
            for group, buffer, grad, partition, before, held in buffers:
                from .partitions import step_partition_

                pending.append((buffer, before))
                if held is not before:
                    self.state[buffer] = held
                nonfinite = step_partition_(buffer, grad, partition, held, group, functools.partial(
                    self._config, configs, group, dtype=buffer.dtype))
                pending.pop()
                _mark_buffer_written(buffer, held)
                met += self._host_count(nonfinite)
            self._nonfinite.report(met)
        except BaseException:
            for param, before in pending:
                if before and PIECES in before:  # a buffer: its pieces' counts, which its step advanced first
                    for state in before[PIECES].values():
                        state[STEP] = counts[id(state)]
                elif before:
                    before[STEP] -= 1
                else:
                    self.state.pop(param, None)
            raise

    def _config(self, configs: dict[tuple[int, int, MomentumCode], StepConfig], group: dict[str, Any], step: int,
                code: MomentumCode, ordinal: int, dtype: torch.dtype) -> StepConfig:
        """The step's configuration of the ``ordinal``-th param (of ``dtype``) at ``step``: its group's, made once
        per step count and code (``configs``), with the param's own dither and rounding noise where it draws them."""
        key = (id(group), step, code)
        cfg = configs.get(key) or configs.setdefault(key, self._step_config(group, step, code))
        rounded = cfg.rounds_stochastically(dtype)
        if cfg.levels_salt is not None or rounded:  # each param draws its own dither and rounding noise
            cfg = cfg.for_param(None if cfg.levels_salt is None else step_salt(step, ordinal),
                                rounding_key(step, ordinal) if rounded else None)
        return cfg

    def _partition_of(self, param: Tensor) -> Optional[Partition]:
        """The pieces of the given params that ``param`` holds if it is a DeepSpeed ZeRO buffer in their place
        (:mod:`smmf.zero`), else None; found at its first step (a collective over its ranks) and kept."""
        if self._given.holds(param):
            return None
        known = self._partitions.get(id(param))
        if known is not None and known[0]() is param:
            return known[1]
        from .zero import find_partition

        partition = find_partition(param, self._given.live(), self._given.places())
        ident = id(param)
        self._partitions[ident] = (weakref.ref(param, lambda _: self._forget_buffer(ident)), partition)
        return partition

    def _forget_buffer(self, ident: int) -> None:
        self._partitions.pop(ident, None)
        self._buffer_groups.pop(ident, None)

    def _host_count(self, nonfinite: Any) -> int:
        """A kernel's count of NaN/inf elements as a number to add up; a CUDA count goes to the monitor as it is."""
        if isinstance(nonfinite, Tensor):
            self._nonfinite.report(nonfinite)
            return 0
        return nonfinite or 0

    def _places_now(self, again: bool = False) -> dict[int, tuple[int, dict[str, Any]]]:
        """Each param's position over the param groups (the same on every rank and after a resume: the levels'
        dither salts by it) and its group, by ``id``: mapped once, not per param (the step inside backward calls
        per param), and again when the groups or their lists of params changed (``load_state_dict``'s new dicts,
        ``add_param_group``, a list edited in place) or ``again``."""
        groups = self.param_groups
        key = tuple((id(g), id(g["params"]), len(g["params"])) for g in groups)
        if again or self._places is None or self._places[0] != key:
            pairs = ((g, p) for g in groups for p in g["params"])
            self._places = (key, {id(p): (i, g) for i, (g, p) in enumerate(pairs)})
        return self._places[1]

    def _ordinal(self, param: Tensor, group: dict[str, Any], places: dict[int, tuple[int, dict[str, Any]]]) -> int:
        """``param``'s position (:meth:`_places_now`), refusing a param that ``group`` does not hold."""
        place = places.get(id(param))
        if place is None or place[1] is not group:
            place = self._places_now(again=True).get(id(param))  # a param swapped in place for another
            if place is None or place[1] is not group:
                where = "none of the optimizer's param groups" if place is None else "another param group"
                raise ValueError(f"step_params got a parameter of shape {tuple(param.shape)} with a group it is not "
                                 f"in: it is in {where} (add it with add_param_group, and pass its own group)")
        return place[0]

    @staticmethod
    def _step_config(group: dict[str, Any], step: int, code: MomentumCode) -> StepConfig:
        beta = group["beta"]
        return StepConfig(
            lr=float(group["lr"]),
            beta1=None if beta is None else beta1_at(beta, group["growth_rate"], step),
            beta2=beta2_at(group["decay_rate"], step),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group["weight_decay_mode"] == "adamw",
            maximize=group["maximize"],
            stochastic_rounding=group["stochastic_rounding"],
            code=code,
            zero_nonfinite=group["nonfinite_grads"] == "zero",
            levels_salt=step_salt(step) if code is MomentumCode.LEVELS and group["momentum_rounding"] == "stochastic"
            else None,
        )

    def state_dict(self) -> dict[str, Any]:
        """As torch's, except the packed bits of FSDP2 shards: by rows of the parameter, placed like it
        (:func:`smmf.sharding.bits_for_checkpoint`), so ``torch.distributed.checkpoint`` loads them on
        any number of ranks. Under :func:`smmf.step_in_backward` the params unfrozen since its install get
        their state first, as DCP's template step would make it in the ordinary loop."""
        if self._step_in_backward is not None:
            self._step_in_backward.make_missing_state()
        state_dict = super().state_dict()
        states = state_dict["state"] = dict(state_dict["state"])  # the entries stay the live state's
        for param, pid in self._saved_params(state_dict):
            if pid in states and has_rows_layout(param):
                states[pid] = {key: bits_for_checkpoint(value, param) if key in BIT_FIELDS else value
                               for key, value in states[pid].items()}
        return state_dict

    def _saved_params(self, state_dict: dict[str, Any]) -> Iterable[tuple[Tensor, Any]]:
        """Each param with its id in ``state_dict`` (groups and their params in order), once: a param a group
        holds twice has one id and one state."""
        seen = set()
        for group, saved in zip(self.param_groups, state_dict.get("param_groups") or []):
            for param, pid in zip(group["params"], saved.get("params", []) if isinstance(saved, dict) else []):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param, pid

    def _bits_in_memory_layout(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the bits saved by rows (:meth:`state_dict`) in this optimizer's own
        layout: this rank's elements of a shard, the flat packing of a whole tensor. A shard's bits in
        the per-rank layout of smmf 0.2 load only on the number of ranks that wrote them."""
        states = state_dict.get("state")
        if not isinstance(states, dict):
            return state_dict  # _check_loadable says what is wrong
        converted = dict(states)
        for param, pid in self._saved_params(state_dict):
            entry = states.get(pid)
            if not isinstance(entry, dict):
                continue
            info = shard_info(param)
            for key in BIT_FIELDS & entry.keys():
                value = entry[key]
                if not isinstance(value, Tensor):
                    continue
                if value.dim() == 2:
                    try:
                        value = bits_from_checkpoint(value, param)
                    except ValueError as err:
                        raise ValueError(f"parameter {pid}: state '{key}': {err}") from None
                    converted[pid] = {**converted[pid], key: value}
                elif (info is not None and info.sharded and not is_dtensor(value)
                      and value.numel() == packed_sign_bytes(param.numel())):
                    # An unsharded run's flat packing (where smmf 0.2's per-rank layout has as many bytes, its
                    # shards were byte-aligned and the two hold the same bytes, or this reading wins).
                    converted[pid] = {**converted[pid], key: bits_from_checkpoint(rows_from_flat(value, param), param)}
                elif info is not None and info.sharded and value.numel() != info.sign_bytes * info.world:
                    raise ValueError(
                        f"parameter {pid}: state '{key}' holds {value.numel()} bytes of bits laid out per rank "
                        f"(a checkpoint of smmf 0.2) for another number of ranks than these {info.world}: load it "
                        "on the number of ranks that saved it and save it again with this version, whose "
                        "checkpoints load on any number of ranks"
                    )
        return {**state_dict, "state": converted}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint whole or not at all, keeping fp32 factors and uint8 signs.

        Order: the load pre-hooks (each may return a new state dict), then validation of what they
        produced against the parameters — keys, shapes, dtypes, a finite whole ``step``, the group
        options — then the load, the restore of the state dtypes (plain torch would cast them to
        the param dtype), then the post-hooks, which see the final state. A checkpoint that does
        not fit raises ``ValueError`` and leaves the optimizer untouched. ``backend`` is a runtime
        choice: the constructor's is kept, whatever the checkpoint says.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict = self._bits_in_memory_layout(state_dict)
        param_of = self._check_loadable(state_dict)
        # DeepSpeed ZeRO buffers' states are restored below, not by torch's loader (which casts every tensor in
        # them to the buffer's dtype).
        buffers = {pid: saved for pid, saved in state_dict["state"].items() if self._partition_of(param_of[pid][0])}
        state_dict = {**state_dict, "state": {pid: saved for pid, saved in state_dict["state"].items()
                                              if pid not in buffers}}
        # How each shard's state is placed (init_state refuses an unsupported placement: before the load).
        made = {pid: init_state(param, options) for pid, (param, options) in param_of.items() if is_dtensor(param)}
        kept = [{key: group[key] for key in registry.names(optional=True)} for group in self.param_groups]
        # torch's loader, without the hooks: they run here, around our restore.
        hooks = (self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks)
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = OrderedDict(), OrderedDict()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = hooks
        # torch's loader ran __setstate__, whose defaults filled the keys the checkpoint lacks: the
        # constructor's values win over those.
        runtime = registry.names(from_checkpoint=False)
        for group, saved, own in zip(self.param_groups, state_dict["param_groups"], kept):
            for key, value in own.items():
                if key not in saved or key in runtime:
                    group[key] = value
        for pid, saved in state_dict["state"].items():
            param, options = param_of[pid]
            state = self.state[param]
            for key, spec in state_layout(param, options).items():
                value = placed_like(saved[key], made[pid][key]) if pid in made else saved[key]
                # Contiguous: the kernels index the 2-D state (the levels code's) as row-major.
                state[key] = value.to(param.device, spec.dtype, copy=True, memory_format=torch.contiguous_format)
            state[STEP] = int(cast(Any, saved[STEP]))
        for pid, saved in buffers.items():
            from .partitions import piece_layout

            buffer, options = param_of[pid]
            partition = self._partition_of(buffer)
            assert partition is not None
            self.state[buffer] = {
                PIECES: {piece.ordinal: {**{key: saved[PIECES][piece.ordinal][key].to(
                    buffer.device, spec.dtype, copy=True, memory_format=torch.contiguous_format)
                    for key, spec in piece_layout(piece, options, buffer.dtype).items()},
                    STEP: int(cast(Any, saved[PIECES][piece.ordinal][STEP]))} for piece in partition.pieces},
                PLACES: {piece.ordinal: piece.place for piece in partition.pieces}}
        self._note_buffer_groups(param_of[pid][0] for pid in buffers)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_loadable(self, state_dict: dict[str, Any]) -> dict[Any, tuple[Tensor, dict[str, Any]]]:
        """Raise ``ValueError`` unless ``state_dict`` fits this optimizer; map saved ids to params."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("an optimizer state dict has 'state' and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if isinstance(saved_state, dict) and any(_is_pieces_state(saved) for saved in saved_state.values()) and \
                not any(self._partition_of(param) for group in self.param_groups for param in group["params"]):
            raise ValueError(
                f"the loaded state dict holds the SMMF state of DeepSpeed ZeRO partitions (one rank's pieces of the "
                f"model's tensors under a flat buffer per group, '{PIECES}' by tensor), and this optimizer steps "
                "the model's own parameters. Load it where it was saved: engine.load_checkpoint under DeepSpeed, "
                "with the same ZeRO stage and number of ranks"
            )
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, "
                f"the optimizer has {len(self.param_groups)}"
            )
        required = set(registry.names(optional=False))
        param_of: dict[Any, tuple[Tensor, dict[str, Any]]] = {}
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"loaded parameter group {index} has {len(saved['params'])} parameters, "
                    f"the optimizer's has {len(group['params'])}"
                )
            missing = sorted(required - set(saved))
            foreign = sorted(set(saved) - set(self.defaults) - set(group) - {"params", *_TORCH_GROUP_KEYS})
            if missing or foreign:
                raise ValueError(
                    f"loaded parameter group {index} does not hold SMMF's options (lacks {missing}, has unknown "
                    f"{foreign}): is it another optimizer's state dict?"
                )
            # The options that decide the state's layout: a checkpoint written with others cannot be
            # continued (one without them was written with the paper's code).
            for key, default in MOMENTUM_CODE_DEFAULTS.items():
                if saved.get(key, default) != group[key]:
                    raise ValueError(
                        f"loaded parameter group {index} was written with {key}={saved.get(key, default)!r}, this "
                        f"optimizer's has {key}={group[key]!r}: its state has another layout. Build the optimizer "
                        f"with {key}={saved.get(key, default)!r} to continue that run"
                    )
            options = {**group, **{k: v for k, v in saved.items()
                                   if k not in ("params", *registry.names(from_checkpoint=False))}}
            validate_group(options)
            for param, pid in zip(group["params"], saved["params"]):
                param_of[pid] = (param, options)
                partition = self._partition_of(param)
                if partition is not None and pid in saved_state:
                    from .partitions import check_loaded_pieces

                    check_loaded_pieces(partition, options, param, saved_state[pid], f"parameter {pid}")
                elif pid in saved_state:
                    check_loaded_state(param, options, saved_state[pid], f"parameter {pid}")
        unknown = sorted(set(saved_state) - set(param_of), key=str)
        if unknown:
            raise ValueError(f"loaded state dict has state for parameters {unknown} that no group lists")
        return param_of
