"""Triton kernel == torch path over 20 steps. Run directly: on CUDA when present, else on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported)."""

from __future__ import annotations

import sys

import torch

from smmf.functional import StepConfig, torch_step_
from smmf.kernels.triton_gpu import triton_step_
from smmf.matrix import unpack_signs
from smmf.schedules import beta1_at, beta2_at
from smmf.state import init_state

# Aligned widths (64×48, 32×24, 256×128: several tiles) and widths that are not a multiple of 8
# (36×30 conv, a prime, 31×9), which write their sign bits through the int32 scratch.
SHAPES = [(64, 48), (768,), (40, 3, 3, 3), (13,), (31, 9), (256, 128), (1000, 3)]


def _first_moment(prev: dict, w: torch.Tensor, g: torch.Tensor, cfg: StepConfig) -> torch.Tensor:
    """This step's uncompressed M, from the state before the step (to tell noise-level |M|)."""
    numel = w.numel()
    sign = unpack_signs(prev["sign_m"], numel).float() * 2 - 1
    m_hat = sign * torch.outer(prev["row_m"], prev["col_m"]).reshape(-1)
    grad = (-g if cfg.maximize else g).float().reshape(-1)
    if not cfg.decoupled_weight_decay:
        grad = grad + cfg.weight_decay * w.float().reshape(-1)
    return cfg.beta1 * m_hat + (1 - cfg.beta1) * grad


def _signs_agree_where_clear(m: torch.Tensor, ref: dict, out: dict) -> None:
    """Sign bits equal wherever |M| is not within float noise of zero."""
    clear = m.abs() > 1e-5 * m.abs().max()
    numel = m.numel()
    assert torch.equal(unpack_signs(ref["sign_m"], numel)[clear], unpack_signs(out["sign_m"], numel)[clear])


def run(device: str, dtype: torch.dtype, beta, maximize: bool, weight_decay: float, decoupled: bool,
        momentum_shape: str = "square") -> float:
    """20 steps; before each, the kernel gets the torch path's params and state, so every step is
    checked from identical inputs (a sign of an |M| at float-noise level may flip, and would then
    make the two trajectories drift apart for reasons that are not the kernel's)."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for shape in SHAPES:
        p = torch.randn(shape, generator=gen).to(device, dtype)
        sp = init_state(p, {"beta": beta, "vector_reshape": True, "momentum_shape": momentum_shape})
        for step in range(1, 21):
            q = p.clone()
            sq = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sp.items()}
            g = torch.randn(shape, generator=gen).to(device, dtype)
            cfg = StepConfig(lr=1e-2, beta1=None if beta is None else beta1_at(beta, 0.999, step),
                             beta2=beta2_at(-0.8, step), eps=1e-8, weight_decay=weight_decay,
                             decoupled_weight_decay=decoupled, maximize=maximize, stochastic_rounding=False)
            m = _first_moment(sq, q, g, cfg) if beta is not None else None
            torch_step_(p, g, sp, cfg)
            triton_step_(q, g, sq, cfg)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(q.float(), p.float(), rtol=tol, atol=tol)
            for key in ("row_m", "col_m", "row_v", "col_v"):
                if key in sp:
                    scale = sp[key].abs().max().item() if sp[key].numel() else 0.0
                    torch.testing.assert_close(sq[key], sp[key], rtol=1e-5, atol=1e-5 * scale)
            if m is not None:
                _signs_agree_where_clear(m, sp, sq)
            worst = max(worst, (q.float() - p.float()).abs().max().item() if p.numel() else 0.0)
    return worst


def run_batched(device: str) -> None:
    """All shapes (and two large ones: several bands and tiles, aligned and not) in one call, mixed
    dtypes, a param one step behind, and every third one's M in its natural shape: each equals its
    own torch-path step."""
    from smmf.kernels.triton_gpu import triton_steps_

    gen = torch.Generator().manual_seed(1)
    shapes = SHAPES + [(875, 800), (1001, 999)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    params = [torch.randn(s, generator=gen).to(device, dtypes[i % 3]) for i, s in enumerate(shapes)]
    states = [init_state(p, {"beta": 0.9, "vector_reshape": True, "momentum_shape": "natural" if i % 3 == 2 else "square"})
              for i, p in enumerate(params)]
    for step in range(1, 4):
        items, expected = [], []
        for i, (p, st) in enumerate(zip(params, states)):
            own_step = max(1, step - (i % 2))  # half the params lag a step: two configs per launch
            cfg = StepConfig(lr=1e-2, beta1=beta1_at(0.9, 0.999, own_step), beta2=beta2_at(-0.8, own_step), eps=1e-8,
                             weight_decay=0.01, decoupled_weight_decay=True, maximize=False, stochastic_rounding=False)
            g = torch.randn(p.shape, generator=gen).to(device, p.dtype)
            ref_p, ref_st = p.clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            torch_step_(ref_p, g, ref_st, cfg)
            expected.append((ref_p, ref_st))
            items.append((p, g, st, cfg))
        triton_steps_(items)
        for (p, _, st, _), (ref_p, ref_st) in zip(items, expected):
            tol = 1e-5 if p.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(p.float(), ref_p.float(), rtol=tol, atol=tol)
            for key in ("row_m", "col_m", "row_v", "col_v"):
                scale = ref_st[key].abs().max().item()
                torch.testing.assert_close(st[key], ref_st[key], rtol=1e-5, atol=1e-5 * scale)
            flips = (st["sign_m"] != ref_st["sign_m"]).sum().item()
            assert flips <= max(1, 1e-3 * st["sign_m"].numel()), flips
            st.update({k: v for k, v in ref_st.items()})  # continue from identical inputs
            p.copy_(ref_p)
    print(f"{device} batched launch of {len(shapes)} tensors: OK")


def run_shards(device: str) -> None:
    """FSDP2 shards on the Triton kernel: pieces of a matrix (partial rows, starts on and off a sign
    byte, an empty piece), their raw sums added up, equal the step of the whole matrix."""
    from helpers import pieces_match_whole
    from smmf.kernels.triton_gpu import triton_shard_step_

    dtypes = [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]
    for dtype in dtypes:
        pieces_match_whole(triton_shard_step_, device, dtype, 1e-5 if dtype == torch.float32 else 1e-2)
        print(f"{device} {dtype} shard passes: OK")


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    run_shards(device)
    run_batched(device)
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32]
    for dtype in dtypes:
        for beta, maximize, wd, decoupled, shape in [
            (0.9, False, 0.0, True, "square"), (0.9, True, 0.1, True, "square"), (None, False, 0.01, False, "square"),
            (0.9, False, 0.01, False, "square"), (0.9, True, 0.1, True, "natural"), (0.9, False, 0.01, False, "natural"),
        ]:
            worst = run(device, dtype, beta, maximize, wd, decoupled, shape)
            print(f"{device} {dtype} beta={beta} maximize={maximize} wd={wd} decoupled={decoupled} M {shape}: "
                  f"max |Δw| {worst:.3g}")
    print("TRITON PARITY OK")
    sys.exit(0)
