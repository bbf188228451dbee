"""Worker functions for the DeepSpeed tests: DeepSpeed on CPU (``DS_ACCELERATOR=cpu``) over gloo, N ranks. Each
trains a small MLP whose tensors ZeRO's partitions cut mid-row, mid-byte and mid-block, and rank 0 writes what the
parent test compares with the same training in one process (its reference, :func:`single_process`)."""

from __future__ import annotations

import os
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

STEPS = 5
MICRO = 2  # each rank's micro-batch
IN, OUT = 37, 7
LR, WEIGHT_DECAY = 1e-2, 0.01
# (name, SMMF options, DeepSpeed settings: stage, accumulation, clip, bf16, zero_optimization's others)
Case = tuple[str, dict[str, Any], dict[str, Any]]


class MLP(nn.Module):
    """Tensors of 4773, 129, 129, 129, 38700, 300, 2100 and 7 elements: rows of 37, 129 and 300 elements, so that the
    levels code's blocks of 128 are cut too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, 129)
        self.norm = nn.LayerNorm(129)
        self.fc2 = nn.Linear(129, 300)
        self.fc3 = nn.Linear(300, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(self.norm(torch.tanh(self.fc1(x))))))


def make_model() -> MLP:
    torch.manual_seed(0)
    return MLP()


def batch(step: int, micro: int, size: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``micro``-th micro-batch at ``step`` (rank r's k-th of a step is micro-batch k·world + r)."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(size, IN, generator=gen), torch.randn(size, OUT, generator=gen)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y)


def single_process(options: dict[str, Any], world: int, accumulation: int = 1, clip: float = 0.0,
                   steps: int = STEPS) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same training in one process, each step's gradient the mean over the ranks' micro-batches (as
    DeepSpeed averages them), clipped by its global norm as DeepSpeed clips it: the params after ``steps`` steps,
    and before."""
    from smmf import SMMF

    model = make_model()
    optimizer = SMMF(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **options)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulation * world):
            (loss_fn(model, *batch(step, micro)) / (accumulation * world)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], start


def init(rank: int, world: int, port: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)  # the parent's reference runs on one thread too: the kernels' sums follow the threads
    import deepspeed

    with redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def config(stage: int, world: int, accumulation: int = 1, clip: float = 0.0, bf16: bool = False, fp16: bool = False,
           **zero: Any) -> dict[str, Any]:
    """DeepSpeed's configuration; ``gradient_clipping`` always set (DeepSpeed clips at 1.0 unless it is); fp16 with
    a static loss scale of 1 (no step skipped)."""
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
            "train_batch_size": MICRO * accumulation * world, "gradient_clipping": clip,
            "zero_optimization": {"stage": stage, **zero}, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False, "bf16": {"enabled": bf16},
            **({"fp16": {"enabled": True, "loss_scale": 1.0}} if fp16 else {}), "steps_per_print": 10**9}


def _two_groups(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": [*model.fc1.parameters(), *model.norm.parameters()]},
            {"params": [*model.fc2.parameters(), *model.fc3.parameters()]}]


def engine_for(options: dict[str, Any], world: int, settings: dict[str, Any]):
    """DeepSpeed's engine of a fresh model and SMMF; with ``settings["callable"]``, SMMF built by DeepSpeed from a
    client callable (``optimizer=lambda params: SMMF(params, ...)``); ``"frozen"``: the first layer frozen;
    ``"two_groups"``: SMMF's params in two groups."""
    import deepspeed

    from smmf import SMMF

    settings = dict(settings)
    by_deepspeed = settings.pop("callable", False)
    settings.pop("checked", None)  # reloads'
    model = make_model()
    if settings.pop("frozen", False):
        model.fc1.requires_grad_(False)
    groups = _two_groups(model) if settings.pop("two_groups", False) else [p for p in model.parameters()
                                                                             if p.requires_grad]
    build = lambda params: SMMF(params, lr=LR, weight_decay=WEIGHT_DECAY, **options)  # noqa: E731
    client: Any = build if by_deepspeed else build(groups)
    with redirect_stdout(sys.stderr):
        engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=client, config=config(world=world, **settings),
                                                     model_parameters=model.parameters() if by_deepspeed else None)
    return engine, engine.optimizer.optimizer


def train(engine, steps: range, rank: int, world: int, accumulation: int = 1) -> None:
    dtype = next(engine.module.parameters()).dtype
    for step in steps:
        for micro in range(accumulation):
            x, y = batch(step, micro * world + rank)
            engine.backward(loss_fn(engine, x.to(dtype), y))
            engine.step()


def full_params(engine) -> list[torch.Tensor]:
    """Every param's fp32 master, whole, on every rank (a collective). Stages 1 and 2 in fp32: the model's params,
    which DeepSpeed gathers after each step (its ``_hp_mapping``, which ``safe_get_full_fp32_param`` reads, does not
    follow ``round_robin_gradients``)."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = [p for p in engine.module.parameters() if p.requires_grad]
    if engine.zero_optimization_stage() < 3 and params[0].dtype == torch.float32:
        return [p.detach().clone() for p in params]
    return [safe_get_full_fp32_param(p).detach().clone().float() for p in params]


def masters(engine) -> list[torch.Tensor]:
    """Every param's fp32 master (DeepSpeed's partition of it), whole, on every rank (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).detach().clone().float() for p in engine.module.parameters() if p.requires_grad]


def local_weights(engine) -> list[torch.Tensor]:
    """This rank's copy of every weight of the module, frozen ones too: its part under ZeRO-3 (no collective)."""
    return [getattr(p, "ds_tensor", p).detach().clone() for p in engine.module.parameters()]


def _state_tensors(optimizer) -> list[torch.Tensor]:
    return [t.clone() for held in optimizer.state.values() for state in held["pieces"].values()
            for t in state.values() if torch.is_tensor(t)]


# ---- jobs: each runs its cases on every rank and returns what rank 0 keeps


def equality(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case trained STEPS steps: the full params, and the shapes of the state of each piece rank 0 holds."""
    results = {}
    for name, options, settings in cases:
        engine, optimizer = engine_for(options, world, settings)
        train(engine, range(STEPS), rank, world, settings.get("accumulation", 1))
        shapes = {ordinal: {key: tuple(value.shape) for key, value in state.items() if torch.is_tensor(value)}
                  for held in optimizer.state.values() for ordinal, state in held["pieces"].items()}
        results[name] = {"params": full_params(engine), "pieces": shapes}
        engine.destroy()
    return results


def bf16_by_hand(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case under DeepSpeed's bf16 mixed precision (bf16 weights, its fp32 master copy), STEPS steps; rank 0
    also steps the masters by hand, whole tensors in one process, with the gradient DeepSpeed hands its optimizer
    (reduced across ranks in bf16 by DeepSpeed, then made fp32). After each step: the largest difference between the
    two over their update since the start (norms by tensor); whether the model's bf16 weights are the masters
    rounded to nearest."""
    from deepspeed.utils import safe_get_full_grad

    from smmf import SMMF

    results = {}
    for name, options, settings in cases:
        engine, _ = engine_for(options, world, dict(settings, bf16=True))
        masters = [p.requires_grad_() for p in full_params(engine)]
        start = [m.detach().clone() for m in masters]
        by_hand = SMMF(masters, lr=LR, weight_decay=WEIGHT_DECAY, **options)
        gaps, rounded = [], True
        for step in range(STEPS):
            x, y = batch(step, rank)
            engine.backward(loss_fn(engine, x.bfloat16(), y))
            grads = [safe_get_full_grad(p).detach().float().clone() for p in engine.module.parameters()]
            engine.step()
            got = full_params(engine)
            if settings["stage"] < 3:  # stage 3 keeps only partitions of the bf16 weights
                rounded &= all(torch.equal(p.detach(), g.bfloat16()) for p, g in zip(engine.module.parameters(), got))
            for master, grad in zip(masters, grads):
                master.grad = grad
            by_hand.step()
            gaps.append(max(((g - m).norm() / (m - s).norm()).item() for g, m, s in zip(got, masters, start)))
        results[name] = {"gaps": gaps, "rounded": rounded}
        engine.destroy()
    return results


def checkpoints(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case trained 6 steps straight, and again saved at step 3 by ``engine.save_checkpoint`` (into ``out``),
    loaded into fresh objects by ``engine.load_checkpoint`` and trained on: both runs' full params."""
    results = {}
    for name, options, settings in cases:
        accumulation = settings.get("accumulation", 1)
        engine, _ = engine_for(options, world, settings)
        train(engine, range(6), rank, world, accumulation)
        straight = full_params(engine)
        engine.destroy()
        engine, _ = engine_for(options, world, settings)
        train(engine, range(3), rank, world, accumulation)
        with redirect_stdout(sys.stderr):
            engine.save_checkpoint(str(out / name), tag="step3")
        engine.destroy()
        engine, _ = engine_for(options, world, settings)
        with redirect_stdout(sys.stderr):
            engine.load_checkpoint(str(out / name), tag="step3")
        train(engine, range(3, 6), rank, world, accumulation)
        results[name] = {"straight": straight, "resumed": full_params(engine)}
        engine.destroy()
    return results


def reloads(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case's checkpoint of :func:`checkpoints` (maybe of another number of ranks) loaded after a step of
    fresh objects, by ``engine.load_checkpoint`` or, with ``settings["checked"]``, by ``smmf.zero.load_checkpoint``:
    the error the load raised (or None), and whether SMMF's state, DeepSpeed's fp32 masters and the module's
    weights stayed as they were."""
    import smmf.zero

    results = {}
    for name, options, settings in cases:
        engine, optimizer = engine_for(options, world, settings)
        train(engine, range(1), rank, world)
        state, params, weights = _state_tensors(optimizer), masters(engine), local_weights(engine)
        error: Optional[str] = None
        try:
            with redirect_stdout(sys.stderr):
                if settings.get("checked"):
                    smmf.zero.load_checkpoint(engine, out / name, tag="step3")
                else:
                    engine.load_checkpoint(str(out / name), tag="step3")
        except Exception as err:  # noqa: BLE001 - reported to the parent
            error = f"{type(err).__name__}: {err}"
        results[name] = {"error": error,
                         "same_state": all(torch.equal(a, b) for a, b in zip(state, _state_tensors(optimizer))),
                         "same_masters": all(torch.equal(a, b) for a, b in zip(params, masters(engine))),
                         "same_weights": all(torch.equal(a, b) for a, b in zip(weights, local_weights(engine)))}
        engine.destroy()
    return results


def refusals(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case built and stepped once: the error ``deepspeed.initialize`` or the first step raised (or None), and
    whether the params stayed as they were and SMMF kept no state. A case whose options hold ``"foreign state"``
    first steps, then finds under its buffer the keys DeepSpeed's universal checkpoint loads (Adam's); one with
    ``"step in backward"`` installs it on the engine's SMMF (refused there)."""
    import smmf

    results = {}
    for name, options, settings in cases:
        options = dict(options)
        foreign = options.pop("foreign state", False)
        in_backward = options.pop("step in backward", False)
        engine, optimizer = engine_for(options, world, settings)
        if foreign:
            train(engine, range(1), rank, world)
            for held in optimizer.state.values():  # what DeepSpeed's universal checkpoint loader writes there
                held.update(step=3, exp_avg=torch.zeros(1), exp_avg_sq=torch.zeros(1))
        if in_backward:
            try:
                smmf.step_in_backward(optimizer)
            except RuntimeError as err:
                results[name] = {"error": f"step_in_backward: {err}", "same_params": True, "new_state": 0}
                engine.destroy()
                continue
        params, kept = full_params(engine), len(optimizer.state)
        error: Optional[str] = None
        try:
            train(engine, range(1, 2), rank, world)
        except Exception as err:  # noqa: BLE001 - reported to the parent
            error = f"{type(err).__name__}: {err}"
        results[name] = {"error": error, "same_params": all(torch.equal(a, b) for a, b in zip(params, full_params(engine))),
                         "new_state": len(optimizer.state) - kept}
        engine.destroy()
    return results


def option_changes(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case in two param groups, stepped once (and, with ``settings["reload"]``, saved and loaded into fresh
    objects), then group 1's option ``settings["change"]`` (key, value) set and stepped: the error (or None), whether
    every master and SMMF's state stayed as they were and the client's groups whole; then the option set back and
    stepped again: whether every piece's step count is 2."""
    results = {}
    for name, options, settings in cases:
        settings = dict(settings, two_groups=True)
        key, value = settings.pop("change")
        reload = settings.pop("reload", False)
        engine, optimizer = engine_for(options, world, settings)
        train(engine, range(1), rank, world)
        if reload:
            with redirect_stdout(sys.stderr):
                engine.save_checkpoint(str(out / name), tag="step1")
            engine.destroy()
            engine, optimizer = engine_for(options, world, settings)
            with redirect_stdout(sys.stderr):
                engine.load_checkpoint(str(out / name), tag="step1")
        kept = optimizer.param_groups[1][key]
        optimizer.param_groups[1][key] = value
        params, state = masters(engine), _state_tensors(optimizer)
        error: Optional[str] = None
        try:
            train(engine, range(1, 2), rank, world)
        except (ValueError, RuntimeError) as err:
            error = f"{type(err).__name__}: {err}"
        result = {"error": error, "same_masters": all(torch.equal(a, b) for a, b in zip(params, masters(engine))),
                  "same_state": all(torch.equal(a, b) for a, b in zip(state, _state_tensors(optimizer))),
                  "groups": len(optimizer.param_groups)}
        optimizer.param_groups[1][key] = kept
        train(engine, range(1, 2), rank, world)
        result["steps"] = sorted({s["step"] for held in optimizer.state.values() for s in held["pieces"].values()})
        results[name] = result
        engine.destroy()
    return results


def initial_step(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case under DeepSpeed without ZeRO on bf16 or fp16 weights: SMMF's state after ``deepspeed.initialize``
    (whose fp16/bf16 wrapper steps the optimizer once with zero gradients), and the largest difference, over the
    update, between the masters after one step and the same masters stepped by a plain SMMF with the gradients
    DeepSpeed handed it."""
    from smmf import SMMF

    results = {}
    for name, options, settings in cases:
        engine, optimizer = engine_for(options, world, settings)
        made = {id(p): len(s) for p, s in optimizer.state.items()}
        start = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
        handed: list[torch.Tensor] = []
        optimizer.register_step_pre_hook(lambda opt, *_: handed.extend(
            p.grad.clone() for group in opt.param_groups for p in group["params"]))
        train(engine, range(1), rank, world)
        stepped = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
        plain = [torch.nn.Parameter(p.clone()) for p in start]
        for param, grad in zip(plain, handed):
            param.grad = grad
        SMMF(plain, lr=LR, weight_decay=WEIGHT_DECAY, **options).step()
        results[name] = {"state_at_initialize": len(made), "steps": sorted({s["step"] for s in optimizer.state.values()}),
                         "gap": max(((a - b).norm() / (b - s).norm()).item() for a, b, s in zip(stepped, plain, start))}
        engine.destroy()
    return results


def plain_load(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case's client state in a ZeRO checkpoint after a step (the ``SMMF.state_dict()`` DeepSpeed saves per
    rank) loaded into a plain SMMF of the model's params: the error it raised (or None)."""
    from smmf import SMMF

    results = {}
    for name, options, settings in cases:
        engine, optimizer = engine_for(options, world, settings)
        train(engine, range(1), rank, world)
        with redirect_stdout(sys.stderr):
            engine.save_checkpoint(str(out / name), tag="step1")
        saved = torch.load(next((out / name / "step1").glob("*optim_states.pt")), weights_only=False)
        plain = SMMF(make_model().parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **options)
        try:
            zero = saved["optimizer_state_dict"]  # ZeRO-1/2 keep the client's under another key than ZeRO-3
            plain.load_state_dict(zero.get("base_optimizer_state") or zero["optimizer_state_dict"])
            results[name] = None
        except ValueError as err:
            results[name] = str(err)
        engine.destroy()
    return results


# Checkpoints that travel between world sizes: every world size takes the same global batch a step, its ranks
# whole micro-batches of it (1, 2 and 3 ranks), so that runs at different numbers of ranks are one run.
GLOBAL = 6


def global_batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of step ``step``'s global batch at ``world`` ranks."""
    x, y = batch(step, 0, size=GLOBAL)
    share = GLOBAL // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def _travelling_params(model: nn.Module, grouped: bool) -> Any:
    """SMMF's params: the model's; ``grouped``: in two groups, the first layer frozen but given to SMMF."""
    if not grouped:
        return model.parameters()
    model.fc1.requires_grad_(False)
    return _two_groups(model)


def _load_weights(model: nn.Module, weights: Optional[list[torch.Tensor]]) -> None:
    """``weights`` into the model's params (the trainable ones where it holds fewer: the frozen keep their
    initial values, which a run does not change)."""
    if weights is None:
        return
    params = list(model.parameters())
    if len(weights) < len(params):
        params = [p for p in params if p.requires_grad]
    assert len(weights) == len(params)
    with torch.no_grad():
        for param, weight in zip(params, weights):
            param.copy_(weight)


def one_process(options: dict[str, Any], steps: range, weights: Optional[list[torch.Tensor]] = None,
                state: Optional[dict[str, Any]] = None, save: Optional[Path] = None,
                grouped: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``steps`` of the global batches in one process, from ``weights`` and an SMMF ``state`` (a fresh model's
    and none by default): the params after, and before; with ``save``, the weights and the optimizer's state dict
    after are written there (``weights.pt``, ``plain.pt``)."""
    from smmf import SMMF

    model = make_model()
    params = _travelling_params(model, grouped)
    _load_weights(model, weights)
    optimizer = SMMF(params, lr=LR, weight_decay=WEIGHT_DECAY, **options)
    if state is not None:
        optimizer.load_state_dict(state)
    start = [p.detach().clone() for p in model.parameters()]
    for step in steps:
        optimizer.zero_grad()
        loss_fn(model, *global_batch(step)).backward()
        optimizer.step()
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        torch.save([p.detach().clone() for p in model.parameters()], save / "weights.pt")
        torch.save(optimizer.state_dict(), save / "plain.pt")
    return [p.detach().clone() for p in model.parameters()], start


def _travelling_engine(options: dict[str, Any], world: int, stage: int, weights: Optional[list[torch.Tensor]] = None,
                       grouped: bool = False):
    import deepspeed

    from smmf import SMMF

    model = make_model()
    params = _travelling_params(model, grouped)
    _load_weights(model, weights)
    settings = config(stage, world)
    settings.update(train_micro_batch_size_per_gpu=GLOBAL // world, train_batch_size=GLOBAL)
    optimizer = SMMF(params, lr=LR, weight_decay=WEIGHT_DECAY, **options)
    with redirect_stdout(sys.stderr):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=settings)
    return engine


def _travel(engine, steps: range, rank: int, world: int) -> None:
    for step in steps:
        x, y = global_batch(step, rank, world)
        engine.backward(loss_fn(engine, x, y))
        engine.step()


def travel_save(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case trained 3 steps and saved by ``engine.save_checkpoint`` into ``out/<name>`` (tag ``step3``), with
    its full params beside (``weights.pt``)."""
    for name, options, settings in cases:
        engine = _travelling_engine(options, world, settings["stage"], grouped=settings.get("grouped", False))
        _travel(engine, range(3), rank, world)
        with redirect_stdout(sys.stderr):
            engine.save_checkpoint(str(out / name), tag="step3")
        weights = full_params(engine)
        if rank == 0:
            torch.save(weights, out / name / "weights.pt")
        engine.destroy()
    return {}


def travel_resume(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case's saved weights and tensor-wise state (``out/<name>/plain.pt``, or ``settings["folder"]``'s) loaded
    under ZeRO at this number of ranks (``smmf.zero.load_state``) and trained 3 steps on: the full params."""
    import smmf.zero

    results = {}
    for name, options, settings in cases:
        folder = out / settings.get("folder", name)
        engine = _travelling_engine(options, world, settings["stage"], torch.load(folder / "weights.pt"),
                                    settings.get("grouped", False))
        smmf.zero.load_state(engine, torch.load(folder / "plain.pt", weights_only=False))
        _travel(engine, range(3, 6), rank, world)
        results[name] = full_params(engine)
        engine.destroy()
    return results


def travel_refusals(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case (the paper's code) trained a step under ZeRO, then offered by ``smmf.zero.load_state`` tensor-wise
    states that do not fit: the recommended code's (``settings["other_code"]``' folder), its own with a tensor of
    another shape (another model's), and torch's Adam's. For each: the error, and whether SMMF's state and
    DeepSpeed's fp32 masters stayed as they were."""
    import torch.distributed as dist

    import smmf.zero

    results: dict[str, Any] = {}
    for name, options, settings in cases:
        engine = _travelling_engine(options, world, settings["stage"])
        _travel(engine, range(1), rank, world)
        client = engine.optimizer.optimizer
        state, kept = _state_tensors(client), masters(engine)
        own = torch.load(out / settings["own"] / "plain.pt", weights_only=False)
        other_model = {**own, "state": {**own["state"], 0: {**own["state"][0], "row_v": torch.ones(5)}}}
        model = make_model()
        adam = torch.optim.Adam(model.parameters())
        loss_fn(model, *global_batch(0)).backward()
        adam.step()
        offers = {"other code": torch.load(out / settings["other_code"] / "plain.pt", weights_only=False),
                  "other model": other_model, "Adam": adam.state_dict()}
        results[name] = {}
        for label, offered in offers.items():
            try:
                smmf.zero.load_state(engine, offered)
                error = None
            except ValueError as err:
                error = str(err)
            same = len(state) == len(_state_tensors(client)) and all(
                torch.equal(a, b) for a, b in zip(state, _state_tensors(client)))
            verdicts: list[Any] = [None] * world  # every rank's: each must refuse, and change nothing
            dist.all_gather_object(verdicts, (error, same))
            results[name][label] = {
                "error": error, "same_masters": all(torch.equal(a, b) for a, b in zip(kept, masters(engine))),
                "same_state": same, "ranks": verdicts}
        engine.destroy()
    return results


def _fsdp2_model(world: int, weights: Optional[list[torch.Tensor]] = None) -> nn.Module:
    """The MLP from ``weights`` (a fresh one's by default), each layer and the whole sharded by FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    if weights is not None:
        with torch.no_grad():
            for param, weight in zip(model.parameters(), weights):
                param.copy_(weight)
    mesh = init_device_mesh("cpu", (world,))
    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp2_train(model: nn.Module, optimizer, steps: range, rank: int, world: int) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_fn(model, *global_batch(step, rank, world)).backward()  # FSDP2 averages the ranks' gradients
        optimizer.step()


def travel_fsdp2_save(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case trained 3 steps under FSDP2, its full weights and its full optimizer state dict
    (``get_optimizer_state_dict(full_state_dict=True)``: keyed by the params' names, the bits by rows of the
    param) saved into ``out/<name>``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from smmf import SMMF

    for name, options, _ in cases:
        model = _fsdp2_model(world)
        optimizer = SMMF(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **options)
        _fsdp2_train(model, optimizer, range(3), rank, world)
        full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        weights = [p.full_tensor().detach().clone() for p in model.parameters()]
        if rank == 0:
            (out / name).mkdir(parents=True, exist_ok=True)
            torch.save(full, out / name / "plain.pt")
            torch.save(weights, out / name / "weights.pt")
    return {}


def travel_fsdp2(rank: int, world: int, out: Path, cases: list[Case]) -> dict[str, Any]:
    """Each case's saved weights and tensor-wise state (``out/<name>/plain.pt``) loaded by an SMMF of FSDP2's
    shards (``load_state_dict``: each rank takes its rows) and trained 3 steps on: the full params."""
    from smmf import SMMF

    results = {}
    for name, options, _ in cases:
        model = _fsdp2_model(world, torch.load(out / name / "weights.pt"))
        optimizer = SMMF(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **options)
        optimizer.load_state_dict(torch.load(out / name / "plain.pt", weights_only=False))
        _fsdp2_train(model, optimizer, range(3, 6), rank, world)
        results[name] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return results


JOBS: dict[str, Callable[[int, int, Path, list[Case]], dict[str, Any]]] = {
    "equality": equality, "bf16_by_hand": bf16_by_hand, "checkpoints": checkpoints, "reloads": reloads,
    "refusals": refusals, "option_changes": option_changes, "initial_step": initial_step, "plain_load": plain_load,
    "travel_save": travel_save, "travel_resume": travel_resume, "travel_fsdp2_save": travel_fsdp2_save,
    "travel_fsdp2": travel_fsdp2, "travel_refusals": travel_refusals}


def battery(rank: int, world: int, port: int, out: str, jobs: list[tuple[str, list[Case]]]) -> None:
    """Every job on every rank, one after another in one process group; rank 0 writes ``{job: results}`` to
    ``out/battery-<world>.pt``."""
    init(rank, world, port)
    import torch.distributed as dist

    results = {job: JOBS[job](rank, world, Path(out), cases) for job, cases in jobs}
    if rank == 0:
        torch.save(results, Path(out) / f"battery-{world}.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's teardown can abort at exit (tests/dist_workers.finish)
