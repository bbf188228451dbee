"""``SMMF``: the optimizer contract (validation, lazy state, checkpoints); the math is elsewhere."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterable, Literal, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import options as registry
from .checkpoint import (bits_by_rows, bits_in_memory_layout, check_loadable, loaded_state, options_kept)
from .dispatch import Kernel, Route, mark_written, route, step_kernel
from .engine import Engine, EngineStep, find_engine, stepping_to_make_state
from .functional import StepConfig
from .nonfinite import NonfiniteMonitor
from .options import StepConfigs, fill_optional, validate_group, warn_fp16_rounding
from .params import GivenParams, Places, check_grad, reject_flattened, reject_non_float
from .sharding import is_dtensor
from .state import LAYOUT_OPTIONS, STEP, MomentumCode, check_state_fits, init_state, momentum_code

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
# A graph break under torch.compile, in the lazy form torch's own optimizers use: it imports dynamo at the first
# call, where ``torch.compiler.disable`` imports it as it decorates, which slowed ``import smmf`` (docs/design.md),
# and dynamo never traces into it. The public decorator where a torch lacks it.
_graph_break: Callable[[Callable[..., Any]], Callable[..., Any]] = getattr(torch, "_disable_dynamo",
                                                                      torch.compiler.disable)


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
            on every path and rank (:func:`smmf.noise.rounding_key`): DDP replicas stay equal and
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
            says whether |M| is above r cᵀ, and two per-tensor gains scale r cᵀ where it is / is not,
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
        self._init_runtime()
        super().__init__(params, defaults)
        self._all_groups: list[dict[str, Any]] = self.param_groups  # the whole list, which an engine may cut

    def _init_runtime(self) -> None:
        """What the optimizer keeps beside torch's: each kept where a pickle made before it lacks it."""
        kept = self.__dict__
        self._places: Places = kept.get("_places") or Places()
        self._checked: dict[int, tuple[tuple, tuple]] = kept.get("_checked") or {}  # see _check_options
        self._nonfinite: NonfiniteMonitor = kept.get("_nonfinite") or NonfiniteMonitor()
        self._warned_fp16_rounding: bool = kept.get("_warned_fp16_rounding", False)
        self._engine: Engine = kept.get("_engine") or Engine()  # smmf.engine: the step inside backward, ZeRO
        # The params given, with their place over the groups as given, weakly held: an engine may swap them for
        # its own tensors and free them (Accelerate's FSDP2 shards), or put flat buffers of them in the groups.
        self._given: GivenParams = kept.get("_given") or GivenParams()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            validate_group(self.param_groups[-1])
            params = self.param_groups[-1]["params"]  # a param given twice is stepped once (torch warns)
            for param in params:
                reject_non_float(param)
                reject_flattened(param)
            self._engine.attach(params)  # the step inside backward hooks them, or refuses before any change
        except (ValueError, RuntimeError, TypeError):
            self.param_groups.pop()
            raise
        self._given.add(params, sum(len(group["params"]) for group in self.param_groups[:-1]))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            fill_optional(group)
        fresh = "_given" not in self.__dict__
        self._init_runtime()
        if fresh:
            for index, group in enumerate(self.param_groups):
                self._given.add(group["params"], sum(len(g["params"]) for g in self.param_groups[:index]))
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
        if self._engine.steps_itself:
            self._engine.before_step()  # the step inside backward steps the params from their hooks
        elif self.state or not stepping_to_make_state():
            try:
                self.step_params([(group, p) for group in self.param_groups for p in group["params"]
                                  if p.grad is not None])
            except BaseException:
                self._engine_now().after_failed_step()
                raise
        return loss

    def routes(self) -> list[Route]:
        """Which path steps each param of each group, and why: the backend and kernel (:mod:`smmf.dispatch`), the
        launch the kernel makes of it (a fused backend's shared launches, by size, dtype, layout and code of M),
        for users asking where a step's time goes. A param without state is described as its first step would
        take it; nothing is stepped or stored, and no collective is made. An engine's tensors (DeepSpeed ZeRO's
        flat buffers) are named as such (ZeRO-3 puts its buffers in the groups only while it steps them)."""
        found = []
        for g, group in enumerate(self.param_groups):
            for i, param in enumerate(group["params"]):
                where = (g, i, tuple(param.shape), param.dtype, param.device)
                engines = None if self._given.holds(param) else self._engine_now().route(where, param)
                found.append(engines or route(where, group, param, self.state.get(param)))
        return found

    def _engine_now(self) -> Engine:
        """The engine: the one installed, or the one whose tensors a group holds in place of the params given,
        found at the first sight of a tensor the optimizer was not given (:func:`smmf.engine.find_engine`)."""
        if type(self._engine) is Engine:
            self._engine = find_engine(self) or self._engine
        return self._engine

    def _engines(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` in a group is an engine's, which that engine steps (a DeepSpeed ZeRO buffer)."""
        return not self._given.holds(tensor) and self._engine_now().holds(tensor)

    def _check_options(self, group: dict[str, Any]) -> None:
        """Check a group's options again when they changed since the last check (schedulers and frameworks
        write ``param_groups``): the constructor's checks, and messages, and the engine's state of the group
        against its layout options. A tensor ``lr`` is checked at every step, since it may change in place."""
        key = self._checked.get(id(group))
        if isinstance(group.get("lr"), Tensor) or key is None or key[0] != _options_key(group):
            validate_group(group)  # raises before the key is kept: a refused value is checked again next step
            layout = tuple(group[name] is None if name == "beta" else group[name] for name in LAYOUT_OPTIONS)
            if key is None or key[1] != layout:  # a scheduler's new lr does not check the engine's state again
                self._engine.check_layout(group)
            if not self._warned_fp16_rounding:
                self._warned_fp16_rounding = warn_fp16_rounding(group)
            groups = self._engine_now().groups(self.param_groups)
            if len(self._checked) > 2 * len(groups):  # forget groups that are gone
                live = {id(g) for g in groups}
                self._checked = {ident: value for ident, value in self._checked.items() if ident in live}
            self._checked[id(group)] = (_options_key(group), layout)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; under :func:`smmf.step_in_backward` it does
        nothing (the gradients belong to the hooks' accumulation window: ``reset()`` drops them)."""
        if not self._engine.steps_itself:
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
        failing; an interrupt) restores the count of every tensor not yet written, while the tensors
        already written keep their update."""
        if grads is not None and len(grads) != len(params):
            raise ValueError(f"step_params got {len(grads)} gradients for {len(params)} params")
        work, engine_steps = _checked_steps(self, params, grads)  # a rejected step changes no param or state
        self._nonfinite.poll()
        _run_steps(self, work, engine_steps)

    def _places_now(self) -> dict[int, tuple[int, dict[str, Any]]]:
        """Each param's position over the param groups and its group, by ``id`` (:class:`smmf.params.Places`)."""
        return self._places.now(self.param_groups)

    def state_dict(self) -> dict[str, Any]:
        """As torch's, except the packed bits of FSDP2 shards: by rows of the parameter, placed like it
        (:func:`smmf.sharding.bits_for_checkpoint`), so ``torch.distributed.checkpoint`` loads them on
        any number of ranks. Under :func:`smmf.step_in_backward` the params unfrozen since its install get
        their state first, as DCP's template step would make it in the ordinary loop."""
        self._engine.before_state_dict()
        state_dict = super().state_dict()
        bits_by_rows(self.param_groups, state_dict)
        return {**state_dict, **self._engine_now().saved_extras()}

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
            state_dict = state_dict if result is None else result
        state_dict = bits_in_memory_layout(self.param_groups, self._engine_now().tensorwise_to_own(state_dict))
        held = {id(p) for group in self.param_groups for p in group["params"] if self._engines(p)}
        param_of = check_loadable(self.param_groups, self.defaults, state_dict, self._engine, held)
        # An engine's tensors' states are restored by the engine, not by torch's loader.
        engines = {pid: saved for pid, saved in state_dict["state"].items() if id(param_of[pid][0]) in held}
        plain = {pid: saved for pid, saved in state_dict["state"].items() if pid not in engines}
        # How each shard's state is placed (init_state refuses an unsupported placement: before the load).
        made = {pid: init_state(param, options) for pid, (param, options) in param_of.items() if is_dtensor(param)}
        kept = options_kept(self.param_groups)
        _load_with_torch(self, {**state_dict, "state": plain})
        # torch's loader ran __setstate__, whose defaults filled the keys the checkpoint lacks: the
        # constructor's values win over those.
        runtime = registry.names(from_checkpoint=False)
        for group, saved, own in zip(self.param_groups, state_dict["param_groups"], kept):
            group.update({key: value for key, value in own.items() if key not in saved or key in runtime})
        for pid, saved in plain.items():
            param, options = param_of[pid]
            self.state[param] = loaded_state(param, options, saved, made.get(pid, {}))
        for pid, saved in engines.items():
            self.state[param_of[pid][0]] = self._engine.load(*param_of[pid], saved)
        self._engine.loaded([param_of[pid][0] for pid in engines])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

# A given param's checked step: (group, param, ordinal, grad, state before, state, code of M, kernel).
_ParamStep = tuple[dict[str, Any], Tensor, int, Tensor, Optional[dict[str, Any]], dict[str, Any], MomentumCode, Kernel]


def _load_with_torch(optimizer: SMMF, state_dict: dict[str, Any]) -> None:
    """torch's loader, without the hooks: :meth:`SMMF.load_state_dict` runs them around its own restore."""
    hooks = (optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks)
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        Optimizer.load_state_dict(optimizer, state_dict)
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks = hooks


def _checked_steps(optimizer: SMMF, params: list[tuple[dict[str, Any], Tensor]], grads: Optional[list[Tensor]]
                   ) -> tuple[list[_ParamStep], list[EngineStep]]:
    """Every given param's step, and every engine tensor's, checked before any of them runs."""
    places = optimizer._places.now(optimizer.param_groups)
    for group in {id(group): group for group, _ in params}.values():
        optimizer._check_options(group)
    work, engine_steps = [], []
    seen: set[int] = set()  # a param a group holds twice is stepped once
    for (group, param), grad in zip(params, grads if grads is not None else [p.grad for _, p in params]):
        if grad is None or id(param) in seen:
            continue
        seen.add(id(param))
        check_grad(param, grad)
        if optimizer._engines(param):
            engine_steps.append(optimizer._engine.prepare(group, param, grad))
            continue
        ordinal = optimizer._places.ordinal(optimizer.param_groups, param, group, places)
        before = optimizer.state.get(param)
        code = momentum_code(param, group)
        if before:
            check_state_fits(param, group, before, code)
        state: dict[str, Any] = before if before else init_state(param, group)
        work.append((group, param, ordinal, grad, before, state, code, step_kernel(group["backend"], param, code)))
    optimizer._engine.before_steps(engine_steps)
    return work, engine_steps


def _run_steps(optimizer: SMMF, work: list[_ParamStep], engine_steps: list[EngineStep]) -> None:
    """Run checked steps: kernels that take many tensors per launch (``kernel.batched``) get them all at once. A
    step that raises puts back the count of every tensor not yet written (their update is lost with it)."""
    batches: dict[Kernel, list[tuple[Tensor, Tensor, dict[str, Any], StepConfig]]] = {}
    configs = StepConfigs()
    pending: dict[int, tuple[Tensor, Optional[dict[str, Any]]]] = {}  # the param steps not yet run, by id
    began: list[EngineStep] = []  # the engine steps begun and not done
    met = 0  # NaN/inf elements the host counts: warned once for the whole step, not for its first tensor
    try:
        for group, param, ordinal, grad, before, state, code, kernel in work:
            pending[id(param)] = (param, before)
            if state is not before:
                optimizer.state[param] = state
            state[STEP] += 1
            item = (param, grad, state, configs.of(group, state[STEP], code, ordinal, param.dtype))
            if kernel.batched:
                batches.setdefault(kernel, []).append(item)
            else:
                met += optimizer._nonfinite.host_count(kernel.steps_([item]))
                del pending[id(param)]
                mark_written(kernel, [(param, state)])
        for kernel, items in batches.items():
            nonfinite = kernel.steps_(items)
            mark_written(kernel, [(param, state) for param, _, state, _ in items])
            for param, *_ in items:
                del pending[id(param)]
            met += optimizer._nonfinite.host_count(nonfinite)
        for engine_step in engine_steps:
            began.append(engine_step)
            met += optimizer._nonfinite.host_count(engine_step.run(configs))
            began.pop()
        optimizer._nonfinite.report(met)
    except BaseException:
        for param, before in pending.values():
            if before:
                before[STEP] -= 1
            else:
                optimizer.state.pop(param, None)
        for engine_step in began:
            engine_step.undo()
        raise


_MISSING = object()


def _options_key(group: dict[str, Any]) -> tuple:
    """A group's options as :meth:`SMMF._check_options` compares them: each value with its type (``True`` is not
    ``1``, ``3`` not ``3.0``), a tensor by identity, a missing key as missing."""
    return tuple((type(value), id(value) if isinstance(value, Tensor) else value)
                 for value in (group.get(option.name, _MISSING) for option in registry.OPTIONS))
