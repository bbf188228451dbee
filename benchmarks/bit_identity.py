"""A fingerprint of what the CPU step computes, to show that a restructuring changes no bit.

Runs a zoo of configurations for a few steps each — dtypes × shapes × codes of M × decay modes ×
maximize × backends (torch path, numba), the shared small-tensor launch, the FSDP2 shard passes
(numba, the paper's code and the magnitude flag's two passes) — and hashes the params and the state
after every step. Prints one hash per configuration group and one over all; ``--save`` writes them
to a JSON file, ``--compare`` reports the groups whose hash differs from such a file.

    python benchmarks/bit_identity.py --save before.json     # on the commit before a change
    python benchmarks/bit_identity.py --compare before.json  # after it: "identical" or the groups that differ

The numba kernels' cache must be warm in both runs (run each once before): the process that compiles
them may differ from processes that load them in the last bit (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from smmf import SMMF  # noqa: E402
from smmf.functional import StepConfig  # noqa: E402
from smmf.kernels import available_backends  # noqa: E402
from smmf.schedules import beta1_at, beta2_at  # noqa: E402
from smmf.state import MomentumCode, init_state  # noqa: E402

SHAPES = [(), (7,), (5, 6), (4, 3, 3, 3), (31, 9), (3, 5, 7), (256, 128), (300, 300), (2, 0, 3)]
CODES = {"paper": {}, "natural": {"momentum_shape": "natural"}, "flag": {"magnitude_bits": 1},
         "natural+flag": {"momentum_shape": "natural", "magnitude_bits": 1}, "no-m": {"beta": None},
         "levels": {"magnitude_bits": 3}, "levels-dithered": {"magnitude_bits": 3, "momentum_rounding": "stochastic"}}
OPTIONS = {"plain": {}, "adamw": {"weight_decay": 0.05}, "l2": {"weight_decay": 1e-3, "weight_decay_mode": "adam"},
           "maximize": {"maximize": True}, "dense-1d": {"vector_reshape": False}}
STEPS = 3


def _digest(hasher: Any, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t = t.detach().contiguous()
        hasher.update(str((tuple(t.shape), t.dtype)).encode())
        hasher.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())


def _state_tensors(opt: SMMF, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v if isinstance(v, torch.Tensor) else torch.tensor(v) for p in params
            for _, v in sorted(opt.state.get(p, {}).items())]


def _optimizer_runs(backends: list[str]) -> Iterator[tuple[str, Callable[[Any], None]]]:
    dtypes = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
    for backend in backends:
        for dtype_name, dtype in dtypes.items():
            if backend == "numba" and dtype == torch.float16:
                continue  # the numba kernel does not take fp16
            for code, code_options in CODES.items():
                for option, extra in OPTIONS.items():
                    name = f"{backend}/{dtype_name}/{code}/{option}"

                    def run(hasher: Any, dtype=dtype, options={**code_options, **extra}, backend=backend) -> None:
                        gen = torch.Generator().manual_seed(0)
                        # one optimizer per param: each its own launch (the shared one has its group below)
                        for shape in SHAPES:
                            p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
                            opt = SMMF([p], lr=1e-2, backend=backend if backend == "torch" else "auto", **options)
                            for _ in range(STEPS):
                                p.grad = torch.randn(shape, generator=gen).to(dtype)
                                opt.step()
                                _digest(hasher, [p, *_state_tensors(opt, [p])])

                    yield name, run


def _shared_launch(hasher: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    for config in ({}, {"beta": None}, {"momentum_shape": "natural", "weight_decay": 0.01}):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(64, 64), (7,), (33, 5), (3, 3, 3, 3)]]
        opt = SMMF(params, lr=1e-2, backend="numba", **config)
        for _ in range(STEPS):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            _digest(hasher, [*params, *_state_tensors(opt, params)])


def _shard_passes(hasher: Any) -> None:
    from helpers import piece_cuts, step_in_pieces
    from smmf.kernels.numba_cpu import numba_shard_step_

    gen = torch.Generator().manual_seed(2)
    for shape in [(48, 64), (31, 9), (257, 33)]:
        for momentum_shape in ("square", "natural"):
            p = torch.randn(shape, generator=gen)
            state = init_state(p, {"beta": 0.9, "vector_reshape": True, "momentum_shape": momentum_shape,
                                   "magnitude_bits": 0})
            cuts = piece_cuts(p.numel(), state["col_v"].numel())
            for step in range(1, STEPS + 1):
                cfg = StepConfig(lr=1e-2, beta1=beta1_at(0.9, 0.999, step), beta2=beta2_at(-0.8, step), eps=1e-8,
                                 weight_decay=0.01, decoupled_weight_decay=step != 2, maximize=step == 3,
                                 stochastic_rounding=False, code=MomentumCode.SIGN)
                p = step_in_pieces(numba_shard_step_, p, torch.randn(shape, generator=gen), state, cfg, cuts).view(shape)
                _digest(hasher, [p, *(v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor))])


def fingerprints() -> dict[str, str]:
    backends = ["torch", *(["numba"] if "numba" in available_backends() else [])]
    groups: list[tuple[str, Callable[[Any], None]]] = list(_optimizer_runs(backends))
    if "numba" in backends:
        groups += [("numba/shared-launch", _shared_launch), ("numba/shard-passes", _shard_passes)]
    result = {}
    for name, run in groups:
        hasher = hashlib.sha256()
        run(hasher)
        result[name] = hasher.hexdigest()
    overall = hashlib.sha256("".join(f"{k}={v}\n" for k, v in result.items()).encode()).hexdigest()
    return {"all": overall, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, help="write the fingerprints to this JSON file")
    parser.add_argument("--compare", type=Path, help="compare with fingerprints saved earlier")
    args = parser.parse_args()
    torch.set_num_threads(2)
    prints = fingerprints()
    print(f"{len(prints) - 1} configuration groups; all: {prints['all']}")
    if args.save:
        args.save.write_text(json.dumps(prints, indent=1))
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = sorted(k for k in before.keys() | prints.keys() if before.get(k) != prints.get(k))
        print("identical" if not differ else "differ: " + ", ".join(differ))
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
