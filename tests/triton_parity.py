"""Triton kernel == torch path. Run directly: on CUDA when present, else on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1 must be set before triton is imported).

``--quick`` runs every check on less work: fewer steps, and the large tensors of the batched and shard
checks at 35k elements instead of 300k-1M (they exist to span several bands and tiles of the kernels, which
(136, 257), (257, 136) and (263, 131) also do). The interpreter runs a kernel's program in numpy, a tile at
a time, so the whole battery takes over 30 minutes of one CPU core there; the test suite runs it quick (and
whole under ``-m slow``), split into parts with ``--part=i/n`` that run side by side."""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from functools import partial
from typing import Callable

import torch
import triton
import triton.language as tl

from helpers import copied_state, copy_state_, updates_close
from smmf.codes import CODES
from smmf.codes.sign import Sign
from smmf.functional import StepConfig, torch_step_
from smmf.kernels.triton_gpu import triton_step_
from smmf.kernels.triton_gpu.tiles import bf16_rounded
from smmf.noise import mix32, rounding_key, step_salt
from smmf.matrix import unpack_signs
from smmf.schedules import beta1_at, beta2_at
from smmf.state import MomentumCode, init_state, momentum_code, real_view

# Aligned widths (64×48, 32×24, 256×128: several tiles) and widths that are not a multiple of 8
# (36×30 conv, a prime, 31×9), which write their sign bits through the int32 scratch.
SHAPES = [(64, 48), (768,), (40, 3, 3, 3), (13,), (31, 9), (256, 128), (1000, 3), (24, 200), (8, 1000)]
QUICK = "--quick" in sys.argv[1:]
# A large tensor: several bands of 256 rows and tiles of 128 columns; V's view of (300, 1000) is 600 × 500,
# of (136, 257), the quick run's, 257 × 136 (two of each; M's natural view is 136 × 257).
LARGE = ((136, 257),) if QUICK else ((300, 1000),)


def _decoded(state: dict, cfg: StepConfig) -> torch.Tensor:
    """M̂ as the state encodes it, flat."""
    shape = (state["row_m"].numel(), state["col_m"].numel())
    numel = shape[0] * shape[1]
    code = CODES[cfg.code]
    assert isinstance(code, Sign), "the codes of M's factors and signs"
    return code.decode(state, state["row_m"], lambda bits: unpack_signs(bits, numel).view(shape)).reshape(-1)


def _same_code(out: dict, ref: dict, cfg: StepConfig) -> None:
    """The factors of V, and M̂ as decoded (the flag's levels may trade places where |M| = r cᵀ to
    the last bit, e.g. a 1-row matrix: what matters is what they decode to), at 1e-5 of their scale,
    where the flag bits agree."""
    for key in ("row_v", "col_v"):
        scale = ref[key].abs().max().item() if ref[key].numel() else 0.0
        torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-5 * scale)
    if "row_m" in ref and ref["sign_m"].numel():
        expected, got = _decoded(ref, cfg).abs(), _decoded(out, cfg).abs()
        rtol = 1e-5
        if "flag_m" in ref:  # a flag bit of |M| within float noise of r cᵀ may differ (the callers bound how many)
            flags = unpack_signs(ref["flag_m"], got.numel())
            same = unpack_signs(out["flag_m"], got.numel()) == flags
            expected, got = expected[same], got[same]
            # each differing bit moves one element's share between the two levels' least-squares sums
            smaller = min(int(flags.sum()), int(flags.numel() - flags.sum()))  # elements in the smaller level
            rtol += 2 * int((~same).sum()) / max(smaller, 1)
        scale = expected.max().item() if expected.numel() else 0.0
        torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * scale)


def _first_moment(prev: dict, w: torch.Tensor, g: torch.Tensor, cfg: StepConfig) -> torch.Tensor:
    """This step's uncompressed M, from the state before the step (to tell noise-level |M|)."""
    m_hat = _decoded(prev, cfg)
    grad = (-g if cfg.maximize else g).float().reshape(-1)
    if not cfg.decoupled_weight_decay:
        grad = grad + cfg.weight_decay * w.float().reshape(-1)
    return cfg.beta1 * m_hat + (1 - cfg.beta1) * grad


def _signs_agree_where_clear(m: torch.Tensor, ref: dict, out: dict) -> None:
    """Sign bits equal wherever |M| is not within float noise of zero; under the magnitude flag, flag
    bits equal wherever |M| is not within float noise of the new estimate r cᵀ."""
    clear = m.abs() > 1e-5 * m.abs().max()
    numel = m.numel()
    assert torch.equal(unpack_signs(ref["sign_m"], numel)[clear], unpack_signs(out["sign_m"], numel)[clear])
    if "flag_m" in ref:
        estimate = torch.outer(ref["row_m"], ref["col_m"]).reshape(-1)
        clear = (m.abs() - estimate).abs() > 1e-5 * m.abs().max()
        assert torch.equal(unpack_signs(ref["flag_m"], numel)[clear], unpack_signs(out["flag_m"], numel)[clear])


def run(device: str, dtype: torch.dtype, beta, maximize: bool, weight_decay: float, decoupled: bool,
        momentum_shape: str = "square", magnitude_bits: int = 0) -> float:
    """20 steps (steps 1, 2 and 20 when quick: the schedules' first values and a late one); before each,
    the kernel gets the torch path's params and state, so every step is checked from identical inputs (a
    sign of an |M| at float-noise level may flip, and would then make the two trajectories drift apart
    for reasons that are not the kernel's)."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for shape in SHAPES:
        p = torch.randn(shape, generator=gen).to(device, dtype)
        group = {"beta": beta, "vector_reshape": True, "momentum_shape": momentum_shape, "magnitude_bits": magnitude_bits}
        sp = init_state(p, group)
        for step in (1, 2, 20) if QUICK else range(1, 21):
            q = p.clone()
            sq = copied_state(sp)
            g = torch.randn(shape, generator=gen).to(device, dtype)
            cfg = StepConfig(lr=1e-2, beta1=None if beta is None else beta1_at(beta, 0.999, step),
                             beta2=beta2_at(-0.8, step), eps=1e-8, weight_decay=weight_decay,
                             decoupled_weight_decay=decoupled, maximize=maximize, stochastic_rounding=False,
                             code=momentum_code(p, group))
            m = _first_moment(sq, q, g, cfg) if beta is not None else None
            before = p.clone()
            torch_step_(p, g, sp, cfg)
            triton_step_(q, g, sq, cfg)
            if dtype == torch.float32:  # each update to 1e-4 of itself
                apart = ~updates_close(q, p, before)
                assert not bool(apart.any()), f"{shape} step {step}: {int(apart.sum())} weights apart"
            else:  # both round the same fp32 value to bf16/fp16
                torch.testing.assert_close(q.float(), p.float(), rtol=1e-2, atol=1e-2)
            _same_code(sq, sp, cfg)
            if m is not None:
                _signs_agree_where_clear(m, sp, sq)
            worst = max(worst, (q.float() - p.float()).abs().max().item() if p.numel() else 0.0)
    return worst


def run_batched(device: str) -> None:
    """All shapes (and two large ones: several bands and tiles, aligned and not) in one call, mixed
    dtypes, a param one step behind, every third one's M in its natural shape, every fourth with
    the magnitude flag and two under the levels code (their own kernels, the same NaN/inf counter): each
    equals its own torch-path step."""
    gen = torch.Generator().manual_seed(1)
    shapes = SHAPES + ([(257, 136), (263, 131)] if QUICK else [(875, 800), (1001, 999)])
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    params = [torch.randn(s, generator=gen).to(device, dtypes[i % 3]) for i, s in enumerate(shapes)]
    groups = [{"beta": 0.9, "vector_reshape": True, "momentum_shape": "natural" if i % 3 == 2 else "square",
               "magnitude_bits": 3 if i % 5 == 3 else int(i % 4 == 1)} for i in range(len(params))]
    states = [init_state(p, group) for p, group in zip(params, groups)]
    grads = [torch.empty_like(p) for p in params]

    def same(p: torch.Tensor, st: dict, ref_p: torch.Tensor, ref_st: dict, cfg: StepConfig) -> None:
        tol = 1e-5 if p.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(p.float(), ref_p.float(), rtol=tol, atol=tol)
        _same_code(st, ref_st, cfg)
        for key in ("sign_m", "flag_m", "codes_m", "scales_m"):
            if key in ref_st:
                flips = (st[key] != ref_st[key]).sum().item()
                assert flips <= max(1, 1e-3 * st[key].numel()), (key, flips)

    for step in range(1, 4):
        configs = []
        for i, p in enumerate(params):
            own_step = max(1, step - (i % 2))  # half the params lag a step: two configs per launch
            configs.append(StepConfig(lr=1e-2, beta1=beta1_at(0.9, 0.999, own_step), beta2=beta2_at(-0.8, own_step),
                                      eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True, maximize=False,
                                      stochastic_rounding=False, code=momentum_code(p, groups[i])))
        _steps_against_torch(device, params, grads, states, configs, gen, same)  # each goes on from identical inputs
    print(f"{device} batched launch of {len(shapes)} tensors: OK")


def _same_step(p: torch.Tensor, st: dict, ref_p: torch.Tensor, ref_st: dict, cfg: StepConfig) -> None:
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-5)
    _same_code(st, ref_st, cfg)


def _steps_against_torch(device: str, params: list, grads: list, states: list, configs: list,
                         gen: torch.Generator, same: Callable[..., None] = _same_step) -> None:
    """One :func:`triton_steps_` call over these tensors, from fresh gradients in the given buffers, equal to
    each one's torch-path step (``same(param, state, its torch-path param, its state, cfg)``); then each holds
    the torch path's values again, in place (addresses kept)."""
    from smmf.kernels.triton_gpu import triton_steps_

    items, expected = [], []
    for p, g, st, cfg in zip(params, grads, states, configs):
        g.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(device))
        ref_p, ref_st = p.clone(), copied_state(st)
        torch_step_(ref_p, g, ref_st, cfg)
        expected.append((ref_p, ref_st))
        items.append((p, g, st, cfg))
    triton_steps_(items)
    for (p, _, st, cfg), (ref_p, ref_st) in zip(items, expected):
        same(p, st, ref_p, ref_st, cfg)
        p.copy_(ref_p)
        copy_state_(st, ref_st)


def run_plans(device: str) -> None:
    """A step whose params, gradient buffers and state tensors are where the last step's were, with the
    same configs equal, takes the last step's plan (no table built again); a step after a state tensor or
    a gradient buffer moved, or after two configs stopped being equal, is planned anew. Every step equals
    the torch path's."""
    from smmf.kernels.triton_gpu import host

    gen = torch.Generator().manual_seed(2)
    shapes = [(64, 48), (31, 9), (768,)]
    params = [torch.randn(s, generator=gen).to(device) for s in shapes]
    grads = [torch.empty_like(p) for p in params]  # kept from step to step, as zero_grad(set_to_none=False) keeps them
    states = [init_state(p, {"beta": 0.9, "vector_reshape": True}) for p in params]
    prepared = []
    real_prepare = host._prepare
    host._prepare = lambda *args, **kwargs: prepared.append(1) or real_prepare(*args, **kwargs)
    host._PLANS.clear()
    moved = None
    try:
        for step, plans_after in zip(range(1, 6), (1, 1, 2, 3, 4)):
            if step == 4:  # a state tensor moves; the old one stays alive, so a stale plan would write it
                moved = states[0]["row_v"]
                states[0]["row_v"] = moved.clone()
            if step == 5:
                grads[1] = torch.empty_like(params[1])
            # the third param's config differs from step 3 on
            configs = [StepConfig(lr=1e-2 if i < 2 or step < 3 else 3e-2, beta1=beta1_at(0.9, 0.999, step),
                                  beta2=beta2_at(-0.8, step), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                                  maximize=False, stochastic_rounding=False, code=MomentumCode.SIGN)
                       for i in range(len(params))]
            prepared.clear()
            _steps_against_torch(device, params, grads, states, configs, gen)
            assert len(host._PLANS) == plans_after, (step, len(host._PLANS))
            assert (len(prepared) == 0) == (step == 2), (step, len(prepared))  # step 2 takes step 1's plan
    finally:
        host._prepare = real_prepare
        host._PLANS.clear()
    print(f"{device} plans kept and renewed: OK")


def run_plans_follow_configs(device: str) -> None:
    """A kept plan groups by the configs' values as the launches do: a complex param and a real one whose
    equal configs (two objects, as two param groups make) share a launch are planned apart once the
    configs differ; stochastic rounding, which a plan bakes in, is part of the signature."""
    from smmf.kernels.triton_gpu import host

    gen = torch.Generator().manual_seed(3)
    params = [torch.randn((16, 12), generator=gen, dtype=torch.complex64).to(device),
              torch.randn((16, 24), generator=gen).to(device)]
    grads = [torch.empty_like(p) for p in params]
    states = [init_state(p, {"beta": 0.9, "vector_reshape": True}) for p in params]

    def config(lr: float, stochastic: bool = False) -> StepConfig:
        return StepConfig(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                          maximize=False, stochastic_rounding=stochastic, code=MomentumCode.SIGN,
                          rounding_key=1234 if stochastic else None)

    host._PLANS.clear()
    try:
        for step in (1, 2):
            configs = [config(1e-2), config(1e-2 if step == 1 else 5e-2)]
            _steps_against_torch(device, params, grads, states, configs, gen)
            assert len(host._PLANS) == step, (step, len(host._PLANS))
        w = torch.zeros(64, 32, dtype=torch.bfloat16, device=device)
        state = init_state(w, {"beta": 0.9, "vector_reshape": True})
        g = torch.zeros_like(w)
        nearest, stochastic = ([(w, g, state, config(1e-2, sr))] for sr in (False, True))
        assert host._signature(nearest) != host._signature(stochastic)
    finally:
        host._PLANS.clear()
    print(f"{device} plans follow the configs: OK")


def run_shards(device: str) -> None:
    """FSDP2 shards on the Triton kernel: pieces of a matrix (partial rows, starts on and off a sign
    byte, an empty piece), their raw sums added up, equal the step of the whole matrix; M in V's
    square view and in its natural one."""
    from helpers import pieces_match_whole
    from smmf.kernels.triton_gpu import triton_shard_step_

    dtypes = [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]
    for dtype in dtypes:
        for momentum_shape in ("square", "natural"):
            pieces_match_whole(triton_shard_step_, device, dtype, 1e-5 if dtype == torch.float32 else 1e-2,
                               momentum_shape, LARGE)
            print(f"{device} {dtype} M {momentum_shape}: shard passes OK")


def run_flag_shards(device: str) -> None:
    """The magnitude flag's two shard passes on the Triton kernel: pieces of a matrix (partial rows,
    on and off a sign byte, an empty piece), their sums added up after each pass as the all-reduces
    do, equal the torch path's step of the whole matrix; M square and natural, one step with L2."""
    from helpers import piece_cuts, piece_state
    from smmf.codes.flag import flag_gains
    from smmf.matrix import store_factors_
    from smmf.kernels import FlagPass
    from smmf.kernels.triton_gpu import triton_flag_shard_pass_
    from smmf.matrix import pack_signs
    from smmf.state import matrix_shape

    gen = torch.Generator().manual_seed(4)
    for shape in [(48, 64), (31, 9), (257, 33), *LARGE]:
        for momentum_shape in ("square", "natural"):
            p = torch.randn(shape, generator=gen).to(device)
            state = init_state(p, {"beta": 0.9, "vector_reshape": True, "momentum_shape": momentum_shape,
                                   "magnitude_bits": 1})
            numel, cols = p.numel(), matrix_shape(p)[1]
            cuts = piece_cuts(numel, cols)
            for step in range(1, 4):
                cfg = StepConfig(lr=1e-2, beta1=0.9 * 0.999 ** (step - 1), beta2=0.9, eps=1e-8, weight_decay=0.1,
                                 decoupled_weight_decay=step != 2, maximize=step == 3, stochastic_rounding=False,
                                 code=MomentumCode.FLAG)
                g = torch.randn(shape, generator=gen).to(device)
                whole, whole_state = p.clone(), copied_state(state)
                torch_step_(whole, g, whole_state, cfg)
                pieces = []
                for lo, hi in zip(cuts[:-1], cuts[1:]):
                    pieces.append((p.reshape(-1)[lo:hi].clone(), g.reshape(-1)[lo:hi].clone(),
                                   piece_state(state, lo, hi), lo, torch.empty_like(state["row_m"]),
                                   torch.empty_like(state["col_m"]), torch.empty(4, device=device)))
                for flag_pass in (0, 1):
                    for piece, grad, local, lo, new_rows, new_cols, gain_sums in pieces:
                        triton_flag_shard_pass_(piece, grad, local, cfg, lo, FlagPass(flag_pass, new_rows, new_cols, gain_sums))
                    if flag_pass == 0:  # the first all-reduce: the new factors of |M|
                        new = {"r": sum(x[4] for x in pieces), "c": sum(x[5] for x in pieces)}
                        store_factors_(new, "r", "c", new["r"], new["c"])
                        for x in pieces:
                            x[4].copy_(new["r"])
                            x[5].copy_(new["c"])
                merged = dict(state, row_m=new["r"], col_m=new["c"],
                              levels_m=flag_gains(sum(x[6] for x in pieces)),
                              **{key: pack_signs(torch.cat([unpack_signs(x[2][key], x[0].numel()) for x in pieces]))
                                 for key in ("sign_m", "flag_m")})
                store_factors_(merged, "row_v", "col_v", sum(x[2]["row_v"] for x in pieces),
                               sum(x[2]["col_v"] for x in pieces))
                torch.testing.assert_close(torch.cat([x[0] for x in pieces]), whole.reshape(-1), rtol=1e-5, atol=1e-5)
                _same_code(merged, whole_state, cfg)
                for key in ("sign_m", "flag_m"):
                    flips = (unpack_signs(merged[key], numel) != unpack_signs(whole_state[key], numel)).sum().item()
                    assert flips <= max(1, 1e-3 * numel), (key, flips)
                p, state = whole, whole_state  # go on from identical inputs
    print(f"{device} flag shard passes: OK")


# The levels code (magnitude_bits=3): M by rows in blocks of 128. A short last block (600 = 4·128 + 88),
# rows of odd length (33; the conv's 27: a row's last byte holds one code), 1-D vectors (one row), a 4-D
# conv, a complex param (its real view: 33 rows of 10), a prime N (V's view n×1).
LEVELS_SHAPES = [(129, 600), (257, 33), (768,), (13,), (40, 3, 3, 3), (33, 5), (1009,)]


def _same_levels(out: dict, ref: dict, exact: bool) -> None:
    """V's factors at 1e-5 of their scale (NaN where the torch path has NaN), and the levels code as stored:
    with ``exact`` (the interpreter on CPU, which rounds as torch's CPU ops do) codes and scales bit for
    bit; on CUDA torch divides by the scalar 7 through its reciprocal (1 ulp off for j = 3, 6), so a level
    or a scale within float noise of a rounding boundary may differ: at most 1e-3 of them."""
    for key in ("row_v", "col_v"):
        scale = ref[key].nan_to_num(nan=0.0).abs().max().item() if ref[key].numel() else 0.0
        torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-5 * scale, equal_nan=True)
    for key in ("codes_m", "scales_m"):
        assert out[key].shape == ref[key].shape, key
        flips = (out[key] != ref[key]).sum().item()
        assert flips <= (0 if exact else max(1, 1e-3 * ref[key].numel())), (key, flips)


def run_levels(device: str, dtype: torch.dtype) -> None:
    """The levels code on its Triton kernels == the torch path, 5 steps (quick: 3) per shape and config from identical
    inputs: AdamW-style decay, L2 (``weight_decay_mode="adam"``) with maximize, and NaN/inf gradients at
    step 3 (counted, as the torch path counts them; and left to propagate when not zeroed)."""
    gen = torch.Generator().manual_seed(6)
    configs = [dict(weight_decay=0.1, decoupled=True, maximize=False, zero=True),
               dict(weight_decay=0.01, decoupled=False, maximize=True, zero=True),
               dict(weight_decay=0.0, decoupled=True, maximize=False, zero=False),
               dict(weight_decay=0.1, decoupled=True, maximize=False, zero=True, dither=True)]  # stochastic levels
    for shape in LEVELS_SHAPES:
        for config in configs:
            complex_param = shape == (33, 5)
            if complex_param and dtype != torch.float32:
                continue
            p = torch.randn(shape, generator=gen, dtype=torch.complex64 if complex_param else torch.float32)
            p = p.to(device) if complex_param else p.to(device, dtype)
            group = {"beta": 0.9, "vector_reshape": True, "magnitude_bits": 3}
            state = init_state(p, group)
            for step in range(1, 4 if QUICK else 6):
                g = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(device)
                if step == 3:  # NaN and inf gradient elements
                    real_view(g).view(-1)[::11] = float("nan")
                    real_view(g).view(-1)[5::17] = float("inf")
                cfg = StepConfig(lr=1e-2, beta1=beta1_at(0.9, 0.999, step), beta2=beta2_at(-0.8, step), eps=1e-8,
                                 weight_decay=config["weight_decay"], decoupled_weight_decay=config["decoupled"],
                                 maximize=config["maximize"], stochastic_rounding=False,
                                 code=momentum_code(p, group), zero_nonfinite=config["zero"],
                                 levels_salt=step_salt(step) if config.get("dither") else None)
                q, sq = p.clone(), copied_state(state)
                expected_bad = torch_step_(p, g, state, cfg)
                bad = triton_step_(q, g, sq, cfg)
                if config["zero"]:
                    assert int(bad.item()) == expected_bad, (shape, step, int(bad.item()), expected_bad)
                tol = 1e-6 if dtype == torch.float32 or complex_param else 1e-2
                torch.testing.assert_close(real_view(q).float(), real_view(p).float(), rtol=tol, atol=tol,
                                           equal_nan=True)
                _same_levels(sq, state, exact=device == "cpu")
                if not config["zero"] and step >= 3:  # the NaN propagated into the weights: go on from new ones
                    p = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(device)
                    state = init_state(p, group)
                else:
                    p, state = q, sq  # go on from identical inputs (the kernel's)
    print(f"{device} {dtype} levels code: OK")


def run_levels_stochastic(device: str) -> None:
    """bf16 weights under stochastic rounding on the levels kernels, as the torch path rounds them with the
    same key: bit for bit under the interpreter (which computes as torch's CPU ops do). On CUDA the weight
    before rounding may differ by a float32 ulp, which moves the rounded one only where the noise lands
    within that ulp of a bf16 boundary: at most 1e-3 of the elements, each by one bf16 ulp. The noise is
    applied (a quarter or more of the elements round otherwise than to nearest) and the code is the torch
    path's."""
    gen = torch.Generator().manual_seed(7)
    p = torch.randn(129, 600, generator=gen).to(device, torch.bfloat16)
    group = {"beta": 0.9, "vector_reshape": True, "magnitude_bits": 3}
    state = init_state(p, group)
    for step in range(1, 4):
        g = torch.randn(p.shape, generator=gen).to(device, torch.bfloat16)
        cfg = StepConfig(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                         maximize=False, stochastic_rounding=True, code=MomentumCode.LEVELS,
                         rounding_key=rounding_key(step))
        q, sq = p.clone(), copied_state(state)
        nearest = p.clone()
        torch_step_(nearest, g, copied_state(state), dataclasses.replace(cfg, stochastic_rounding=False, rounding_key=None))
        torch_step_(p, g, state, cfg)
        triton_step_(q, g, sq, cfg)
        ulp = (p.float().abs() * 2.0 ** -7).clamp(min=2.0 ** -133)  # a bf16 ulp is at most 2^-7 of |w|
        assert bool(((q.float() - p.float()).abs() <= ulp).all())
        flips = (q != p).sum().item()
        assert flips <= (0 if device == "cpu" else 1e-3 * p.numel()), (step, flips)
        assert 0.2 < (q != nearest).float().mean().item() < 0.8
        _same_levels(sq, state, exact=device == "cpu")
        p, state = q, sq
    print(f"{device} levels code, bf16 stochastic rounding as the torch path's: OK")


@triton.jit
def _round_all(x_ptr, out_ptr, seed, base, n, BLOCK: tl.constexpr):
    """``bf16_rounded`` (stochastic) of every element, its index counted from ``base``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, bf16_rounded(x, seed, i.to(tl.int64) + base, True), mask=i < n)


def run_bf16_rounding(device: str) -> None:
    """bf16 stochastic rounding in the Triton kernels adds, below the bits bf16 keeps, the top 16 bits of
    :func:`smmf.noise.mix32` of the seed + the element's index (mod 2³²), as the numba kernel does; NaN
    stays NaN. Then on the step kernel: updates of 1/78 of an ulp for 50 steps move the bf16 weights' mean
    onto the fp32 run's (unbiased), where nearest rounding would keep them at 1 (quick: 5 steps at lr 4e-3,
    each update still under half the bf16 spacing below 1)."""
    values = torch.cat([torch.randn(3000) * 10, torch.tensor([float("nan"), 0.0, -0.0])]).to(device)
    seed, base = 987654321, 2**32 - 1000  # the index wraps past 2³² within the tensor
    out = torch.empty_like(values)
    _round_all[(triton.cdiv(values.numel(), 1024),)](values, out, seed, base, values.numel(), BLOCK=1024)
    index = (torch.arange(values.numel(), dtype=torch.int64, device=device) + base + seed) & 0xFFFFFFFF
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    expected = ((bits + (mix32(index) >> 16)) & 0xFFFF0000).to(torch.int32).view(torch.float32)
    finite = ~values.isnan()
    assert torch.equal(out[finite], expected[finite]) and bool(out[~finite].isnan().all())

    means = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        p = torch.ones(256, 256, dtype=dtype, device=device)
        state = init_state(p, {"beta": 0.9, "vector_reshape": True})
        for step in range(1, 6 if QUICK else 51):
            cfg = StepConfig(lr=4e-3 if QUICK else 1e-4, beta1=beta1_at(0.9, 0.999, step),
                             beta2=beta2_at(-0.5, step), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                             maximize=False, stochastic_rounding=dtype == torch.bfloat16, code=MomentumCode.SIGN,
                             rounding_key=rounding_key(step))
            triton_step_(p, torch.ones_like(p), state, cfg)
        means[dtype] = p.double().mean().item()
    assert means[torch.float32] < 0.999
    # many standard deviations of the mean's rounding noise; nearest rounding would stay at 1, over 1e-3 from
    # the fp32 run (asserted above)
    assert abs(means[torch.bfloat16] - means[torch.float32]) < 2e-4

    # Two equal tensors in one launch, each rounded by its own key (keys[t]), bit for bit as the torch path
    # rounds it with that key.
    from smmf.kernels.triton_gpu import triton_steps_

    pair = [torch.ones(64, 64, dtype=torch.bfloat16, device=device) for _ in range(2)]
    cfg = StepConfig(lr=2.0**-9, beta1=None, beta2=0.0, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                     maximize=False, stochastic_rounding=True, code=MomentumCode.NO_M)  # half an ulp below 1
    configs = [cfg.for_param(None, key) for key in (12345, 2**32 - 7)]
    triton_steps_([(q, torch.ones_like(q), init_state(q, {"beta": None, "vector_reshape": True}), c)
                   for q, c in zip(pair, configs)])
    for q, c in zip(pair, configs):
        expected = torch.ones_like(q)
        torch_step_(expected, torch.ones_like(q), init_state(q, {"beta": None, "vector_reshape": True}), c)
        assert torch.equal(q, expected)
    first, second = (q.reshape(-1) for q in pair)
    assert 0.2 < (first != 1).float().mean().item() < 0.8
    assert not torch.equal(second, first)
    print(f"{device} bf16 stochastic rounding: the hash of the index, unbiased, tensors apart: OK")


def run_levels_batched(device: str) -> None:
    """Many tensors under the levels code in one call: every shape of :data:`LEVELS_SHAPES` (a complex one among
    them) in fp32 and bf16, dithered, each param with its own salt at each step, as the optimizer salts them.
    Each dtype is one launch set (three launches) whatever the number of tensors; from step 2 on the kept plan
    runs, reading each step's salts; every tensor equals its own torch-path step, codes and scales bit for bit
    under the interpreter."""
    from smmf.kernels.triton_gpu import host

    gen = torch.Generator().manual_seed(9)
    params = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in LEVELS_SHAPES:
            if shape == (33, 5):
                params.append(torch.randn(shape, generator=gen, dtype=torch.complex64).to(device))
            else:
                params.append(torch.randn(shape, generator=gen).to(device, dtype))
    group = {"beta": 0.9, "vector_reshape": True, "magnitude_bits": 3}
    states = [init_state(p, group) for p in params]
    grads = [torch.empty_like(p) for p in params]
    launches = []
    real_run_levels = host._run_levels
    host._run_levels = lambda *args, **kwargs: launches.append(1) or real_run_levels(*args, **kwargs)
    host._PLANS.clear()
    def same(p: torch.Tensor, st: dict, ref_p: torch.Tensor, ref_st: dict, cfg: StepConfig) -> None:
        tol = 1e-6 if real_view(p).dtype == torch.float32 else 1e-2
        torch.testing.assert_close(real_view(p).float(), real_view(ref_p).float(), rtol=tol, atol=tol)
        _same_levels(st, ref_st, exact=device == "cpu")

    try:
        for step in range(1, 4):
            base = StepConfig(lr=1e-2, beta1=beta1_at(0.9, 0.999, step), beta2=beta2_at(-0.8, step), eps=1e-8,
                              weight_decay=0.1, decoupled_weight_decay=True, maximize=False, stochastic_rounding=False,
                              code=MomentumCode.LEVELS)
            launches.clear()
            _steps_against_torch(device, params, grads, states,
                                 [base.for_param(step_salt(step, i), 0) for i in range(len(params))], gen, same)
            assert len(launches) == 2, (step, len(launches))  # fp32 (the complex param's real view too), bf16
            assert len(host._PLANS) == 1, (step, len(host._PLANS))
    finally:
        host._run_levels = real_run_levels
        host._PLANS.clear()
    print(f"{device} levels code, {len(params)} tensors in one call: OK")


def run_huge_flag(device: str) -> None:
    """Finite gradients near the fp32 maximum keep the magnitude flag's levels, and the weights, finite
    (two elements of 3e38; a whole gradient scaled by 1e20), with the torch path's levels."""
    gen = torch.Generator().manual_seed(5)
    for momentum_shape in ("square", "natural"):
        for scale in ("two", "all"):
            p = torch.randn(64, 48, generator=gen).to(device)
            state = init_state(p, {"beta": 0.9, "vector_reshape": True, "momentum_shape": momentum_shape,
                                   "magnitude_bits": 1})
            for step in range(1, 4):
                g = torch.randn(64, 48, generator=gen)
                if step == 1 and scale == "two":
                    g[0, 0] = g[5, 7] = 3e38
                elif step == 1:
                    g = g * 1e20
                g = g.to(device)
                cfg = StepConfig(lr=1e-2, beta1=beta1_at(0.9, 0.999, step), beta2=beta2_at(-0.8, step), eps=1e-8,
                                 weight_decay=0.0, decoupled_weight_decay=True, maximize=False, stochastic_rounding=False,
                                 code=MomentumCode.FLAG)
                q, sq = p.clone(), copied_state(state)
                torch_step_(p, g, state, cfg)
                triton_step_(q, g, sq, cfg)
                assert bool(q.isfinite().all()) and bool(sq["levels_m"].isfinite().all()), (momentum_shape, scale, step)
                torch.testing.assert_close(sq["levels_m"], state["levels_m"], rtol=1e-4, atol=0)
                p.copy_(q)
                state.update(sq)
    print(f"{device} flag with huge gradients: finite, OK")


def run_levels_shards(device: str) -> None:
    """FSDP2 shards under the levels code on the Triton kernels: pieces of whole rows of a param (V's view
    cut mid-row, an empty piece), their raw V sums added up, equal the kernels' step of the whole param:
    weights, codes and scales bit for bit (both read the old factors), V's factors up to summation order;
    dithered, a piece draws by its elements' index in the whole param; so do bf16 weights rounded
    stochastically."""
    from helpers import levels_step_in_pieces
    from smmf.kernels.triton_gpu import triton_shard_step_

    gen = torch.Generator().manual_seed(8)
    for shape in [(48, 64), (31, 9), (257, 33), (40, 600)]:
        for dither, rounded in ((False, False), (True, False), (True, True)):
            p = torch.randn(shape, generator=gen).to(device, torch.bfloat16 if rounded else torch.float32)
            state = init_state(p, {"beta": 0.9, "vector_reshape": True, "magnitude_bits": 3})
            rows = shape[0]
            cuts = [0, rows // 3, rows // 3, rows // 2 + 1, rows]
            for step in range(1, 3):
                cfg = StepConfig(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                                 decoupled_weight_decay=step == 1, maximize=False, stochastic_rounding=rounded,
                                 code=MomentumCode.LEVELS, levels_salt=step_salt(step) if dither else None,
                                 rounding_key=rounding_key(step, 3) if rounded else None)
                g = torch.randn(shape, generator=gen).to(device, p.dtype)
                whole, whole_state = p.clone(), copied_state(state)
                triton_step_(whole, g, whole_state, cfg)
                flat = levels_step_in_pieces(triton_shard_step_, p, g, state, cfg, cuts)
                assert torch.equal(flat, whole.reshape(-1)), (shape, dither, step)
                for key in ("codes_m", "scales_m"):
                    assert torch.equal(state[key], whole_state[key]), (shape, key)
                for key in ("row_v", "col_v"):
                    torch.testing.assert_close(state[key], whole_state[key], rtol=1e-6, atol=1e-6)
                p, state = whole, whole_state  # go on from identical inputs
    print(f"{device} levels code, shard passes: OK")


def run_nonfinite(device: str) -> None:
    """The contract for non-finite values on the Triton kernels, as on the torch path, 3 steps of every code of M
    (the paper's, natural, flag, levels, no first moment), fp32: a NaN or infinite weight stays so and leaves the
    state finite (decoupled decay: the weight never enters the gradient), under both ``zero_nonfinite`` settings;
    an infinite gradient element left to propagate makes only its own weight NaN."""
    gen = torch.Generator().manual_seed(8)
    codes = [dict(beta=0.9), dict(beta=0.9, momentum_shape="natural"), dict(beta=0.9, magnitude_bits=1),
             dict(beta=0.9, magnitude_bits=3), dict(beta=None)]
    cases = [(float("nan"), None, True), (float("nan"), None, False), (float("inf"), None, True),
             (float("inf"), None, False), (None, float("inf"), False)]
    for options in codes:
        for weight, grad, zero in cases:
            for shape in [(64, 48), (13,)]:
                p = torch.randn(shape, generator=gen).to(device)
                if weight is not None:
                    p.view(-1)[5] = weight
                group = {"vector_reshape": True, **options}
                state = init_state(p, group)
                for step in range(1, 4):
                    g = torch.randn(shape, generator=gen).to(device)
                    if grad is not None and step == 2:
                        g.view(-1)[5] = grad
                    cfg = StepConfig(lr=1e-2, beta1=None if options["beta"] is None else 0.9,
                                     beta2=beta2_at(-0.8, step), eps=1e-8, weight_decay=0.1,
                                     decoupled_weight_decay=True, maximize=False, stochastic_rounding=False,
                                     code=momentum_code(p, group), zero_nonfinite=zero)
                    q, sq = p.clone(), copied_state(state)
                    torch_step_(p, g, state, cfg)
                    triton_step_(q, g, sq, cfg)
                    where = (options, weight, grad, shape, step)
                    assert torch.equal(q.isnan(), p.isnan()) and torch.equal(q.isinf(), p.isinf()), where
                    assert int((~q.isfinite()).sum()) == (0 if weight is None and step == 1 else 1), where
                    torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, equal_nan=True)
                    for key, value in sq.items():
                        if isinstance(value, torch.Tensor) and value.is_floating_point():
                            assert bool(value.isfinite().all()), (where, key)
                    p, state = q, sq  # go on from identical inputs (the kernel's)
    print(f"{device} non-finite weights and gradients: OK")


def _name(check) -> str:
    if isinstance(check, partial):
        return f"{check.func.__name__}{check.args}"
    return "run" + str(tuple(check.__defaults__ or ()))


def _selected(checks: list, args: list[str]) -> list:
    """The checks ``args`` ask for: names (or parts of names), all when none; ``--part=i/n``: of those, every
    n-th from the i-th."""
    unknown = [a for a in args if a.startswith("--") and a != "--quick" and not a.startswith("--part=")]
    if unknown:
        raise SystemExit(f"unknown options {unknown}: --quick, --part=i/n")
    part = [a.split("=", 1)[1] for a in args if a.startswith("--part=")]
    wanted = [a for a in args if not a.startswith("--")]
    checks = [c for c in checks if not wanted or any(w in _name(c) for w in wanted)]
    if part:
        i, n = map(int, part[0].split("/"))
        if not 0 <= i < n:
            raise SystemExit(f"--part={part[0]}: i must be in 0 .. n-1")
        checks = checks[i::n]
    if not checks:
        raise SystemExit(f"no check matches {args}")
    return checks


def main() -> int:
    """Every check, each on its own: a failure is printed with its traceback and the others still run
    (one GPU run then reports every path that fails)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checks = [partial(run_levels, device, dtype)
              for dtype in [torch.float32, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])]
    checks += [partial(run_levels_stochastic, device), partial(run_bf16_rounding, device),
               partial(run_levels_shards, device),
               partial(run_levels_batched, device),
               partial(run_huge_flag, device), partial(run_flag_shards, device),
               partial(run_shards, device), partial(run_batched, device), partial(run_plans, device),
               partial(run_plans_follow_configs, device), partial(run_nonfinite, device)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32]
    for dtype in dtypes:
        for beta, maximize, wd, decoupled, shape, bits in [
            (0.9, False, 0.0, True, "square", 0), (0.9, True, 0.1, True, "square", 0),
            (None, False, 0.01, False, "square", 0), (0.9, False, 0.01, False, "square", 0),
            (0.9, True, 0.1, True, "natural", 0), (0.9, False, 0.01, False, "natural", 0),
            (0.9, True, 0.1, True, "square", 1), (0.9, False, 0.01, False, "natural", 1),
            (0.9, False, 0.0, True, "natural", 1),
        ]:
            def check(dtype=dtype, beta=beta, maximize=maximize, wd=wd, decoupled=decoupled, shape=shape, bits=bits):
                worst = run(device, dtype, beta, maximize, wd, decoupled, shape, bits)
                print(f"{device} {dtype} beta={beta} maximize={maximize} wd={wd} decoupled={decoupled} M {shape} "
                      f"flag bits {bits}: max |Δw| {worst:.3g}")
            checks.append(check)
    checks = _selected(checks, sys.argv[1:])
    failed = 0
    for check in checks:
        start = time.perf_counter()
        try:
            check()
            print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001 (reported, and the run fails at the end)
            failed += 1
            print(f"FAILED {_name(check)}:\n{traceback.format_exc()}", flush=True)
    if failed:
        print(f"TRITON PARITY FAILED: {failed} of {len(checks)} checks")
        return 1
    print("TRITON PARITY OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
