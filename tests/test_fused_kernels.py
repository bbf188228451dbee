"""Every fused path equals the torch path (fp32/bf16) over 20 steps; state bytes unchanged."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from helpers import (FUSED_BACKENDS, ZOO_SHAPES, copied_state, copy_state_, device_of, reconstruct_state,
                     run_script, state_tensors_bytes, updates_close)
from smmf import RECOMMENDED, SMMF
from smmf.dispatch import step_kernel
from smmf.kernels import available_backends, check_backend
from smmf.functional import torch_step_
from smmf.options import step_config
from smmf.state import MomentumCode, momentum_code

pytestmark = pytest.mark.skipif(not FUSED_BACKENDS, reason="no fused backend available")

CONFIGS = {
    "defaults": dict(),
    "adamw": dict(weight_decay=0.1),
    "adam-l2": dict(weight_decay=0.01, weight_decay_mode="adam"),
    "no-first-moment": dict(beta=None, growth_rate=None),
    "maximize": dict(maximize=True, decay_rate=-0.8),
    # Beyond the paper: M in the natural shape (129 rows of 600 against V's 300×258, whose rows end
    # mid-byte; blocks of V rows end mid-row of M); Triton sums |M| in M's view in a kernel of its own.
    "natural-shape": dict(momentum_shape="natural", weight_decay=0.1),
    # The magnitude flag (two passes in the numba kernel; Triton encodes against new factors from a first kernel).
    "natural-shape-and-flag": dict(momentum_shape="natural", magnitude_bits=1, weight_decay=0.1),
    "flag-adam-l2": dict(magnitude_bits=1, weight_decay=0.01, weight_decay_mode="adam", maximize=True),
    # The levels code: M by rows of the param in blocks of 128 (600 columns: a short last block; 33: odd).
    "levels": dict(magnitude_bits=3, weight_decay=0.1),
    "levels-adam-l2": dict(magnitude_bits=3, weight_decay=0.01, weight_decay_mode="adam", maximize=True),
    "levels-stochastic": dict(magnitude_bits=3, momentum_rounding="stochastic", weight_decay=0.1),
}
SHAPES = [*ZOO_SHAPES, (768,), (64, 3, 7, 7), (257, 33), (129, 600), (96, 40)]
FROZEN_AFTER = 10  # the last shape gets no gradient from this step on (a frozen param mid-run)
# Dtypes each kernel covers (fp16 on CPU takes the torch path under "auto" and is not a kernel case).
DTYPES = {"numba": [torch.float32, torch.bfloat16], "triton": [torch.float32, torch.bfloat16, torch.float16]}
BACKEND_DTYPES = [(b, d) for b in FUSED_BACKENDS for d in DTYPES[b]]


def _pair(backend: str, dtype: torch.dtype, config: dict) -> tuple[list, list, SMMF, SMMF]:
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    device = device_of(backend)
    ps = [torch.nn.Parameter(b.to(device, dtype).clone()) for b in base]
    qs = [torch.nn.Parameter(b.to(device, dtype).clone()) for b in base]
    return ps, qs, SMMF(ps, lr=1e-2, backend="torch", **config), SMMF(qs, lr=1e-2, backend=backend, **config)


def _scale(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES, ids=[f"{b}-{str(d)[6:]}" for b, d in BACKEND_DTYPES])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fused_matches_torch_path(backend: str, dtype: torch.dtype, config: dict) -> None:
    """Twenty steps, each from the same weights and state on both paths. Carried over, a sign that a
    rounding decides (an element of M at zero) can split the paths once, and the sign codes then spread
    the split through the factors over the next steps: on one thread, whose blocks sum in another order,
    one such sign flipped at step 10 of the natural shape with the flag, and 83 weights were apart at step 19."""
    ps, qs, ref, fused = _pair(backend, dtype, config)
    gen = torch.Generator().manual_seed(1)
    levels = config.get("magnitude_bits") == 3
    apart = [0, 0]  # the levels code: weights and elements of M̂ apart, over the steps
    for step in range(20):
        for i, (p, q) in enumerate(zip(ps, qs)):
            if i == len(ps) - 1 and step >= FROZEN_AFTER:
                p.grad = q.grad = None
                continue
            non_contiguous = i % 2 == 0 and p.dim() == 2  # a transposed view, as some backward passes give
            g = torch.randn(p.shape[::-1] if non_contiguous else p.shape, generator=gen).to(p.device, dtype)
            g = g.t() if non_contiguous else g
            p.grad, q.grad = g, g.clone()
        before = [p.detach().clone() for p in ps]
        ref.step()
        fused.step()
        for k, n in enumerate(_paths_apart(ps, qs, before, ref, fused, dtype, levels)):
            apart[k] += n
        _copy_weights_and_state(ps, qs, ref, fused)
    if levels:  # each split counts once (the next step starts level again), against the elements of one step
        elements = sum(p.numel() for p in ps)
        assert apart[0] <= 1e-3 * elements and apart[1] <= 1e-3 * elements, apart
    assert state_tensors_bytes(fused) == state_tensors_bytes(ref)


def _paths_apart(ps: list, qs: list, before: list, ref: SMMF, fused: SMMF, dtype: torch.dtype,
                 levels: bool) -> tuple[int, int]:
    """Assert that the fused step (from weights ``before``) matches the torch path's, weights and state. fp32:
    each update to 1e-4 of itself (:func:`updates_close`). The levels code: M a rounding apart (the
    paths fuse multiply-adds differently) puts an element in the next level now and then, and its weight and
    M then differ; these are counted: (weights, M̂)."""
    apart = [0, 0]
    for p, q, w in zip(ps, qs, before):
        if dtype == torch.float32:
            close = updates_close(q, p, w)
        else:  # both round the same fp32 value to bf16/fp16; a rare 1-ulp split is allowed
            close = torch.isclose(q, p, rtol=8e-3, atol=1e-5)
            if not levels and p.numel():
                assert (q != p).float().mean().item() <= 0.01
        if levels:
            apart[0] += int((~close).sum())
        else:
            assert bool(close.all()), f"{int((~close).sum())} of {p.numel()} weights apart, greatest {(q - p).abs().max()}"
        m_ref, v_ref = reconstruct_state(ref, p)
        m_fused, v_fused = reconstruct_state(fused, q)
        # Sums run in another order on each path: compare at 1e-5 of each matrix's scale.
        torch.testing.assert_close(v_fused, v_ref, rtol=1e-5, atol=1e-5 * _scale(v_ref))
        if m_ref is not None and levels:
            apart[1] += int((~torch.isclose(m_fused, m_ref, rtol=1e-5, atol=1e-5 * _scale(m_ref))).sum())
        elif m_ref is not None:
            torch.testing.assert_close(m_fused.abs(), m_ref.abs(), rtol=1e-5, atol=1e-5 * _scale(m_ref))
            clear = m_ref.abs() > 1e-6 * (m_ref.abs().max() if m_ref.numel() else 0)
            assert torch.equal(m_fused[clear] >= 0, m_ref[clear] >= 0)
    return apart[0], apart[1]


def _copy_weights_and_state(ps: list, qs: list, ref: SMMF, fused: SMMF) -> None:
    """The torch path's weights and state into the fused optimizer's own tensors, in place."""
    with torch.no_grad():
        for p, q in zip(ps, qs):
            q.copy_(p)
            copy_state_(fused.state[q], ref.state[p])


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_fused_is_chosen_by_default_and_covers_bf16(backend: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(torch.randn(4, 4, dtype=dtype, device=device_of(backend)))
        assert step_kernel("auto", p, MomentumCode.SIGN).name == backend
        assert step_kernel(backend, p, MomentumCode.SIGN).name == backend


def test_fp16_falls_back_to_torch_under_auto() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float16))
    assert step_kernel("auto", p, MomentumCode.SIGN).name == "torch"


def test_unavailable_backend_is_a_clear_error() -> None:
    if "triton" not in available_backends():
        with pytest.raises(RuntimeError, match="backend 'triton' is not available here"):
            SMMF([torch.nn.Parameter(torch.randn(2))], backend="triton")
    with pytest.raises(ValueError, match="Unknown backend"):
        check_backend("cuda")


def _step_with(params, optimizers, step_grads) -> None:
    """Give ``params`` these gradients, then step every optimizer once."""
    for p, g in zip(params, step_grads):
        p.grad = g.clone()
    for opt in optimizers:
        opt.step()


def _assert_stepped_alike(opt, p, single, q) -> None:
    """``p`` (of ``opt``) equals ``q`` (of ``single``), state and all."""
    assert torch.equal(p, q)
    for key, value in opt.state[p].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(single.state[q][key])), key


def _assert_as_alone_and_near_own(opt, together, singles, alone, own) -> None:
    """Each param of ``opt`` equals, state and all, the same param stepped by an optimizer of its own
    (``singles``), and is within float noise of ``own`` (stepped by its per-tensor kernel)."""
    for p, q, r, single in zip(together, alone, own, singles):
        _assert_stepped_alike(opt, p, single, q)
        torch.testing.assert_close(r, p, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
def test_small_cpu_tensors_share_one_launch_and_match_their_own_launches_bit_for_bit(monkeypatch) -> None:
    """Small fp32 tensors go through one launch per step (their step is mostly launch overhead);
    each is updated exactly as a launch of its own (the shared kernel with that tensor alone: what the
    step inside backward runs) would update it, and within float noise of the per-tensor kernel."""
    from smmf.kernels.numba_cpu import host

    launches = []
    many = host.many_kernel
    monkeypatch.setattr(host, "many_kernel", lambda *args: launches.append(args[0].shape[0]) or many(*args))
    shapes = [(64, 64), (7,), (33, 5), (100, 200), (3, 3, 3, 3), (2, 2)]
    for config in (dict(weight_decay=0.1), dict(beta=None, growth_rate=None)):
        gen = torch.Generator().manual_seed(2)
        base = [torch.randn(s, generator=gen) for s in shapes]
        together = [torch.nn.Parameter(b.clone()) for b in base]
        alone = [torch.nn.Parameter(b.clone()) for b in base]
        own = [torch.nn.Parameter(b.clone()) for b in base]
        opt = SMMF(together, backend="numba", **config)
        singles = [SMMF([p], backend="numba", **config) for p in alone]
        owns = [SMMF([p], backend="numba", **config) for p in own]
        grads = [[torch.randn(p.shape, generator=gen) for p in together] for _ in range(3)]
        launches.clear()
        for step_grads in grads:
            _step_with(together, [opt], step_grads)
            _step_with(alone, singles, step_grads)
        assert launches == ([len(shapes)] + [1] * len(shapes)) * 3  # one launch per step, alone or shared
        monkeypatch.setattr(host, "takes_many", lambda *args: False)  # the per-tensor kernel
        for step_grads in grads:
            _step_with(own, owns, step_grads)
        monkeypatch.undo()
        monkeypatch.setattr(host, "many_kernel", lambda *args: launches.append(args[0].shape[0]) or many(*args))
        _assert_as_alone_and_near_own(opt, together, singles, alone, own)


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("config, launch", [
    (dict(RECOMMENDED, weight_decay=0.1), "levels"),
    (dict(magnitude_bits=3, weight_decay=0.01, weight_decay_mode="adam", maximize=True), "levels"),
    (dict(magnitude_bits=1, weight_decay=0.1), "flag"),
    (dict(magnitude_bits=1, weight_decay=0.01, weight_decay_mode="adam", momentum_shape="natural"), "flag")],
    ids=["recommended", "levels-nearest-l2", "flag", "flag-l2-natural"])
def test_small_levels_and_flag_tensors_share_one_launch_and_match_their_own_launches(monkeypatch, config,
                                                                                     launch) -> None:
    """Small fp32 tensors of the levels code, and of the magnitude flag, go through one launch per step (their
    own launches cost the host more than their steps); each is updated within float noise of its own serial
    launch (the same kernel per tensor, whose copy linked into the shared launch may round a sum differently)
    and, where no dither tells params apart by their place, exactly as that launch with it alone (the step
    inside backward); a NaN gradient element is zeroed."""
    from smmf.kernels.numba_cpu import host

    launches = []
    many = getattr(host, f"many_{launch}_kernel")
    monkeypatch.setattr(host, f"many_{launch}_kernel",
                        lambda *args: launches.append(args[0].shape[0]) or many(*args))
    shapes = [(64, 64), (7,), (33, 5), (100, 200), (3, 3, 3, 3), (2, 2), (1, 300)]
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(s, generator=gen) for s in shapes]
    together, alone, own = ([torch.nn.Parameter(b.clone()) for b in base] for _ in range(3))

    def group_options(i):  # a second group of another lr and NaN policy: each tensor reads its own row of the tables
        return {} if i < 3 else {"lr": 3e-3, "nonfinite_grads": "propagate"}

    def two_groups(params):
        return [{"params": params[:3]}, {"params": params[3:], **group_options(3)}]

    opt = SMMF(two_groups(together), backend="numba", **config)
    own_opt = SMMF(two_groups(own), backend="numba", **config)
    singles = [SMMF([p], backend="numba", **config, **group_options(i)) for i, p in enumerate(alone)]
    grads = [[torch.randn(p.shape, generator=gen) for p in together] for _ in range(3)]
    grads[1][0][5, 7] = float("nan")
    for step_grads in grads:
        _step_with(together, [opt], step_grads)
        _step_with(alone, singles, step_grads)
    assert launches == ([len(shapes)] + [1] * len(shapes)) * 3  # one launch per step, alone or shared
    monkeypatch.setattr(host, f"takes_many_{launch}", lambda *args: False)  # each tensor's own launch
    for step_grads in grads:
        _step_with(own, [own_opt], step_grads)
    assert len(launches) == 3 * (len(shapes) + 1)
    dithered = config.get("momentum_rounding") == "stochastic"  # a param's dither depends on its place
    for p, q, r, single in zip(together, alone, own, singles):
        torch.testing.assert_close(r, p, rtol=1e-6, atol=1e-6)
        for key in ("row_v", "col_v"):
            torch.testing.assert_close(own_opt.state[r][key], opt.state[p][key], rtol=1e-6, atol=0)
        if not dithered:
            _assert_stepped_alike(opt, p, single, q)
    assert torch.isfinite(together[0]).all()


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("config", [dict(weight_decay=0.1), dict(weight_decay=0.1, weight_decay_mode="adam"),
                                    dict(beta=None, growth_rate=None), dict(momentum_shape="natural")],
                         ids=["adamw", "l2", "no-momentum", "natural"])
def test_large_cpu_tensors_share_one_launch_and_match_their_own_launches(monkeypatch, config) -> None:
    """The mid-sized fp32 tensors (64Ki to 1Mi elements) take one launch over all their blocks of rows (a
    launch per tensor cost ~15 µs each of fork and join); each is updated exactly as that launch with it alone (what the step
    inside backward runs) updates it, at any thread count, within float noise of its own parallel launch
    (the same bits where both come from numba's cache: benchmarks/bit_identity.py), and NaN gradient
    elements are counted for the tensors that zero them only."""

    from smmf.kernels.numba_cpu import host

    launches = []
    blocks = host.many_blocks_kernel
    monkeypatch.setattr(host, "many_blocks_kernel", lambda *args: launches.append(args[0].shape[0]) or blocks(*args))
    shapes = [(512, 256), (300, 300), (64, 3, 19, 19), (70001,), (4096, 17), (9, 9), (1024, 1025)]
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(s, generator=gen) for s in shapes]
    together, alone, own = ([torch.nn.Parameter(b.clone()) for b in base] for _ in range(3))
    opt = SMMF(together, backend="numba", **config)
    singles = [SMMF([p], backend="numba", **config) for p in alone]
    owns = [SMMF([p], backend="numba", **config) for p in own]
    grads = [[torch.randn(p.shape, generator=gen) for p in together] for _ in range(3)]
    for step_grads in grads:
        _step_with(together, [opt], step_grads)
        _step_with(alone, singles, step_grads)
    # the 9×9 takes the small tensors' launch, the 1024×1025 one of its own
    assert launches == ([len(shapes) - 2] + [1] * (len(shapes) - 2)) * 3
    threads = torch.get_num_threads()
    try:  # the blocks and the threads' parts follow the thread count of each step (torch's, which numba's follows)
        torch.set_num_threads(1)
        step_grads = [torch.randn(p.shape, generator=gen) for p in together]
        grads.append(step_grads)
        _step_with(together, [opt], step_grads)
        _step_with(alone, singles, step_grads)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(host, "takes_blocks", lambda *args: False)  # each in a parallel launch of its own
    for number, step_grads in enumerate(grads):
        if number == 3:
            torch.set_num_threads(1)
        _step_with(own, owns, step_grads)
    torch.set_num_threads(threads)
    _assert_as_alone_and_near_own(opt, together, singles, alone, own)
    monkeypatch.undo()
    items = []
    for count, p in enumerate(together[:3]):
        grad = torch.randn(p.shape, generator=gen)
        grad.view(-1)[:count + 1] = float("nan")  # 1, 2, 3 NaN elements; the third tensor lets them through
        state = opt.state[p]
        state["step"] += 1
        items.append((p, grad, state, replace(step_config(opt.param_groups[0], state["step"], momentum_code(
            p, opt.param_groups[0])), zero_nonfinite=count < 2)))
    assert host.steps_(items) == 3
    assert [bool(torch.isfinite(p).all()) for p in together[:3]] == [True, True, False]


@pytest.mark.skipif("numba" not in FUSED_BACKENDS or (os.cpu_count() or 1) < 2, reason="needs numba and 2 cores")
@pytest.mark.parametrize("how", ["OMP_NUM_THREADS", "torch.set_num_threads"])
def test_the_numba_step_keeps_and_follows_torchs_thread_count(how: str) -> None:
    """Starting numba's OpenMP pool set torch's thread count to the core count, whatever the user had set (a
    torchrun rank's OMP_NUM_THREADS=1 too); the numba kernel now runs on torch's count, read at every step."""
    env = {"NUMBA_NUM_THREADS": str(os.cpu_count()), "OMP_NUM_THREADS": "1" if how == "OMP_NUM_THREADS" else ""}
    out = run_script("""
        import numba, torch, smmf
        if not torch.get_num_threads() == 1:
            torch.set_num_threads(1)
        model = torch.nn.Linear(512, 256)
        opt = smmf.SMMF(model.parameters(), backend="numba")
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        print(torch.get_num_threads(), numba.get_num_threads())
        torch.set_num_threads(2)
        opt.step()
        print(torch.get_num_threads(), numba.get_num_threads())
    """, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "2", "2"]


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
def test_param_groups_with_their_own_options_share_the_launches() -> None:
    """Groups of other options (lr, no first moment, NaN gradients zeroed or let through, M's natural view)
    share the small and the mid-sized tensors' launches, each tensor's row carrying its own group's numbers:
    every tensor ends, state and all, as its group stepped by an optimizer of its own, and NaN elements are
    counted for the groups that zero them only."""
    from smmf.kernels.numba_cpu import host

    options = [dict(lr=1e-2), dict(lr=3e-3, beta=None, growth_rate=None), dict(lr=1e-3, nonfinite_grads="propagate"),
               dict(lr=2e-3, momentum_shape="natural", weight_decay=0.1)]
    shapes = [(33, 5), (300, 300), (7,), (512, 256)]  # a small and a mid-sized tensor in each group
    gen = torch.Generator().manual_seed(4)
    base = [[torch.randn(s, generator=gen) for s in shapes] for _ in options]
    together = [[torch.nn.Parameter(b.clone()) for b in group] for group in base]
    alone = [[torch.nn.Parameter(b.clone()) for b in group] for group in base]
    opt = SMMF([dict(params=ps, **o) for ps, o in zip(together, options)], backend="numba")
    singles = [SMMF(ps, backend="numba", **o) for ps, o in zip(alone, options)]
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for _ in options for s in shapes]
        _step_with([p for ps in together for p in ps], [opt], grads)
        _step_with([p for ps in alone for p in ps], singles, grads)
    for ps, qs, single in zip(together, alone, singles):
        for p, q in zip(ps, qs):
            _assert_stepped_alike(opt, p, single, q)
    items = []
    for group, ps in zip(opt.param_groups, together):
        for p in ps:
            grad = torch.randn(p.shape, generator=gen)
            grad.view(-1)[:2] = float("nan")
            state = opt.state[p]
            state["step"] += 1
            items.append((p, grad, state, step_config(group, state["step"], momentum_code(p, group))))
    assert host.steps_(items) == 2 * len(shapes) * (len(options) - 1)  # the third group lets its NaNs through
    assert [bool(torch.isfinite(p).all()) for ps in together for p in ps] == [
        number != 2 for number in range(len(options)) for _ in shapes]


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("beta", [0.9, None], ids=["momentum", "no-momentum"])
def test_rows_wider_than_a_column_tile_match_the_torch_path(dtype: torch.dtype, beta) -> None:
    """1025×1025: every row is one full 1024-column tile and a 1-column one (bf16 rows go through a
    buffer of the tile's size, which must not leak past a short tile)."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1025, 1025, generator=gen)
    p, q = torch.nn.Parameter(base.to(dtype)), torch.nn.Parameter(base.to(dtype))
    ref = SMMF([p], lr=1e-2, beta=beta, backend="torch")
    fused = SMMF([q], lr=1e-2, beta=beta, backend="numba")
    for _ in range(3):
        g = torch.randn(base.shape, generator=gen).to(dtype)
        p.grad, q.grad = g, g.clone()
        ref.step()
        fused.step()
    if dtype == torch.float32:
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(q, p, rtol=8e-3, atol=1e-5)
        assert (q != p).float().mean().item() <= 0.01


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
def test_two_rows_in_one_loop_match_the_torch_path() -> None:
    """The numba pass steps two rows' segments in one loop where M is in V's view: rows wider than a column
    tile (1033×1031: paired in both tiles), pairs refused where the two segments share a byte of sign bits
    (1025×1025) or a shard's end cuts the second, whole rows whose bits share bytes (101×99), odd row counts.
    fp64 against the torch path at 1e-12 over 3 steps, whole and in shard pieces, with NaN gradient
    elements counted once each."""
    from helpers import piece_cuts, step_in_pieces
    from smmf.functional import StepConfig
    from smmf.kernels.numba_cpu import numba_shard_step_, numba_step_
    from smmf.matrix import unpack_signs
    from smmf.state import init_state, matrix_shape

    gen = torch.Generator().manual_seed(12)
    for shape in [(1033, 1031), (1025, 1025), (101, 99)]:
        assert matrix_shape(torch.empty(shape)) == shape
        p = torch.randn(shape, generator=gen, dtype=torch.float64)
        state = init_state(p, {"beta": 0.9, "vector_reshape": True})
        for step in range(1, 4):
            cfg = StepConfig(lr=1e-2, beta1=0.9 * 0.999 ** (step - 1), beta2=1 - step ** -0.5, eps=1e-8,
                             weight_decay=0.1, decoupled_weight_decay=step != 2, maximize=step == 3,
                             stochastic_rounding=False, code=MomentumCode.SIGN)
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            g.view(-1)[step * 7919 :: 104729] = float("nan")
            nans = int(g.isnan().sum())
            whole, whole_state = p.clone(), copied_state(state)
            torch_step_(whole, g, whole_state, cfg)
            fused, fused_state = p.clone(), copied_state(state)
            assert numba_step_(fused, g, fused_state, cfg) == nans
            torch.testing.assert_close(fused, whole, rtol=0, atol=1e-12)
            flat = step_in_pieces(numba_shard_step_, p, g, state, cfg, piece_cuts(p.numel(), shape[1]))
            torch.testing.assert_close(flat, whole.reshape(-1), rtol=0, atol=1e-12)
            for got in (fused_state, state):
                for key in ("row_v", "col_v", "row_m", "col_m"):
                    torch.testing.assert_close(got[key], whole_state[key], rtol=1e-12, atol=1e-12)
                assert torch.equal(unpack_signs(got["sign_m"], p.numel()), unpack_signs(whole_state["sign_m"], p.numel()))
            p, state = whole, whole_state  # go on from identical inputs


_CACHE_PROBE = """
import hashlib, json, torch, smmf
from smmf.kernels.numba_cpu import launches, sign
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(100, 100, dtype=torch.float64))  # a launch of its own, the serial kernel
p.grad = torch.randn_like(p)
smmf.SMMF([p], backend="numba").step()
serial = sign.kernel_serial.stats
hits, misses = [sum(serial.cache_hits.values())], [sum(serial.cache_misses.values())]
# Small fp32 tensors (the quick-start CNN's biases) and larger ones: the two shared launches.
params = [torch.nn.Parameter(torch.randn(s)) for s in [(30, 20), (20,), (7, 3, 3), (300, 300)]]
opt = smmf.SMMF(params, backend="numba")
for _ in range(2):
    for q in params:
        q.grad = torch.randn_like(q)
    opt.step()
lone = torch.nn.Parameter(torch.randn(40, 10))
lone.grad = torch.randn_like(lone)
smmf.SMMF([lone], backend="numba").step()
shared = [launches.many_kernel.stats, launches.many_blocks_kernel.stats]
print(json.dumps({"hits": hits + [sum(k.cache_hits.values()) for k in shared],
                  "misses": misses + [sum(k.cache_misses.values()) for k in shared],
                  "result": hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in [p, *params, lone])).hexdigest()}))
"""


# A kernel of a few instructions, cached as the fused kernels are: what a process does with a broken cache
# entry of it takes a fraction of a second to compile, where the fused kernels' compile takes many.
_TINY_KERNEL = """
from smmf.kernels.numba_cpu.cache import KERNEL_OPTIONS, cached_njit


@cached_njit(**KERNEL_OPTIONS)
def twice(x):
    return 2.0 * x
"""


_TINY_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tiny_kernel import twice
result = twice(21.25)
print(json.dumps({"hits": sum(twice.stats.cache_hits.values()), "misses": sum(twice.stats.cache_misses.values()),
                  "result": result}))
"""


def _probe(source: str, cache_dir, *args: str, **env: str) -> tuple[dict, str]:
    """Run a cache probe in a fresh process with ``cache_dir`` as numba's cache (``None``: numba's default
    place, the suite's own cache): its JSON line, its stderr."""
    import json

    out = run_script(source, *args, env={**({} if cache_dir is None else {"NUMBA_CACHE_DIR": str(cache_dir)}), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("cache", ["shared", pytest.param("fresh", marks=pytest.mark.slow)])
def test_the_kernels_compile_once_and_fresh_processes_load_them_from_the_cache(cache: str, tmp_path) -> None:
    """The first fused step of every process used to compile the kernels (seconds, and ~100 MiB
    of RSS); now the first process on a machine compiles and caches them, the next ones load them.
    So are the shared launches: a model of small fp32 tensors took a 4 s compile of theirs in every
    process. "shared": numba's cache of this run, where other tests may have compiled them already
    (the compiling process's reload is checked on a tiny kernel below); "fresh": an empty cache,
    whose compiles (~45 s of CPU) repeat the suite's own."""
    runs = [_probe(_CACHE_PROBE, tmp_path if cache == "fresh" else None)[0] for _ in range(3)]
    if cache == "fresh":
        # The first compiles each kernel, saves it and then runs it as loaded (a hit too), as the others do.
        assert [(r["hits"], r["misses"]) for r in runs] == [([1, 1, 1], [1, 1, 1])] + [([1, 1, 1], [0, 0, 0])] * 2
        assert any(tmp_path.rglob("*.nbc"))
    else:
        assert runs[0]["hits"] == [1, 1, 1] and [(r["hits"], r["misses"]) for r in runs[1:]] == [([1, 1, 1], [0, 0, 0])] * 2
    assert runs[0]["result"] == runs[1]["result"] == runs[2]["result"]


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
def test_a_kernels_cache_entry_is_keyed_on_every_source_it_compiles_from(tmp_path) -> None:
    """numba keys an entry on the cached function's own file: an edit of elements.py (inlined into sign.py's
    kernels), as a fix of the element math or an upgrade brings, kept loading the old code."""
    from pathlib import Path

    from smmf.kernels.numba_cpu import cache, launches, levels

    here = Path(cache.__file__).parent
    assert {here / "elements.py", here / "access.py", here.parents[1] / "levels.py"} <= set(cache._SOURCES)
    for kernel in (launches.many_kernel, levels._levels_kernel_serial):
        assert kernel._cache._cache_file._source_stamp[1] == cache.sources_digest()
    copies = tuple(tmp_path / str(i) for i in range(len(cache._SOURCES)))
    for path, copy in zip(cache._SOURCES, copies):
        copy.write_bytes(path.read_bytes())
    assert cache.digest_of(copies) == cache.sources_digest()
    edited = copies[[p.name for p in cache._SOURCES].index("elements.py")]
    edited.write_text(edited.read_text() + "\n# an edit\n")
    assert cache.digest_of(copies) != cache.sources_digest()


def test_a_broken_cache_file_is_compiled_again_with_one_warning(tmp_path) -> None:
    """A truncated or overwritten ``.nbi``/``.nbc`` used to make every later process fail at its
    first step until the files were deleted by hand; now the process warns once, compiles, writes a
    good entry, and the next process loads it silently. On a kernel made as the fused ones are
    (:func:`test_every_fused_kernel_survives_a_broken_cache` checks that they are). Subprocesses: a
    failure here can be a crash."""
    import os

    pytest.importorskip("numba")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tiny_kernel.py").write_text(_TINY_KERNEL)

    def run() -> tuple[dict, str]:
        return _probe(_TINY_PROBE, tmp_path / "cache", str(tmp_path / "src"), PYTHONWARNINGS="always")

    def cache_file(suffix: str):
        return next((tmp_path / "cache").rglob(f"*twice*.{suffix}"))

    first, _ = run()
    assert (first["hits"], first["misses"]) == (1, 1) and first["result"] == 42.5  # compiled, then loaded
    for suffix, damage in [("nbi", lambda b: b[:10]), ("nbc", lambda b: "not a cache entry é".encode("latin-1")),
                           ("nbi", lambda b: os.urandom(len(b)))]:
        target = cache_file(suffix)
        target.write_bytes(damage(target.read_bytes()))
        repaired, warned = run()
        assert "could not be read" in warned and warned.count("smmf: numba's cache") == 1, warned[-2000:]
        assert (repaired["hits"], repaired["misses"], repaired["result"]) == (1, 1, 42.5)
    loaded, silent = run()
    assert "smmf: numba's cache" not in silent
    assert (loaded["hits"], loaded["misses"], loaded["result"]) == (1, 0, 42.5)


# The tiny kernel with a compile that waits: while it is typed, a process run with HOLD_COMPILE=path
# makes path.compiling and waits (at most a minute) for path.go.
_HELD_KERNEL = """
import os, time
from numba.extending import intrinsic
from smmf.kernels.numba_cpu.cache import KERNEL_OPTIONS, cached_njit


@intrinsic
def held(typingctx, x):
    hold = os.environ.get("HOLD_COMPILE")
    if hold:
        open(hold + ".compiling", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(hold + ".go") and time.monotonic() < deadline:
            time.sleep(0.02)
    return x(x), lambda context, builder, signature, args: args[0]


@cached_njit(**KERNEL_OPTIONS)
def twice(x):
    return 2.0 * held(x)
"""


def test_processes_that_need_one_uncached_signature_compile_it_once(tmp_path) -> None:
    """The ranks of a first distributed run on a machine (or two test workers) used to compile every kernel
    signature that none had cached yet, each of them: about 30 s of CPU apiece for the largest kernels.
    Now the first process compiles it and the others wait, then load what it saved. Here the first one's
    compile is held until the second has reached its own."""
    import json
    import subprocess
    import sys
    import textwrap
    import time

    pytest.importorskip("numba")
    pytest.importorskip("fcntl")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tiny_kernel.py").write_text(_HELD_KERNEL)
    hold, ready = tmp_path / "hold", tmp_path / "second.ready"
    probe = textwrap.dedent(_TINY_PROBE).replace("result = twice", "import os; open(os.environ['READY'], 'w').close()\n"
                                                                   "result = twice")

    def start(**env: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", probe, str(tmp_path / "src")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), **env})

    def wait_for(path, process: subprocess.Popen) -> None:
        deadline = time.monotonic() + 120
        while not path.exists():
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no {path.name}"
            time.sleep(0.02)

    first = start(HOLD_COMPILE=str(hold), READY=str(tmp_path / "first.ready"))
    wait_for(tmp_path / "hold.compiling", first)
    second = start(READY=str(ready))
    wait_for(ready, second)
    time.sleep(1.0)  # the second process asks for the signature meanwhile
    (tmp_path / "hold.go").touch()
    found = []
    for process in (first, second):
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        found.append(json.loads(out.strip().splitlines()[-1]))
    assert [(r["hits"], r["misses"], r["result"]) for r in found] == [(1, 1, 42.5), (1, 0, 42.5)]


def _save_two_signatures_at_once(tmp_path, monkeypatch, locked: bool) -> dict:
    """numba saves a cache entry in three steps: read the index, write it naming the entry's data file
    (the first number the index it read does not use), write the data file. Two threads stand for two
    processes (``flock`` locks of two ``open`` calls exclude each other) and save the int64 and the
    float64 code of a tiny kernel; hooks hold each at the one order of steps that breaks the entry:
    both read the empty index, A writes its index, B writes its index and its data, A writes its data.
    A hold ends early once B asks for the lock, so with the lock the saves take turns at once. Returns
    what a load then brings for each signature: its code's signature, or None."""
    import importlib.util
    import threading
    import time
    import types

    fcntl = pytest.importorskip("fcntl")
    pytest.importorskip("numba")
    from smmf.kernels.numba_cpu import cache as cache_module

    b_asks_for_lock = threading.Event()

    def flock(fd, operation):
        if threading.current_thread().name == "B":
            b_asks_for_lock.set()
        return fcntl.flock(fd, operation)

    lock = types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_SH=fcntl.LOCK_SH, LOCK_NB=fcntl.LOCK_NB)
    monkeypatch.setattr(cache_module, "fcntl", lock if locked else None)
    monkeypatch.setattr(cache_module, "_cache_warned", set())
    # The saves below write the compiled code again: keep it (code loaded from the cache cannot be saved).
    monkeypatch.setattr(cache_module, "_run_the_saved_entry", lambda dispatcher, args, sig, entry: entry)
    (tmp_path / "racing_kernel.py").write_text(_TINY_KERNEL)
    spec = importlib.util.spec_from_file_location("racing_kernel", tmp_path / "racing_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # cached_njit wraps the cache now, with the lock or without
    twice = module.twice
    assert (twice(2), twice(2.5)) == (4, 5.0)
    (int_sig, float_sig), cache = list(twice.overloads), twice._cache
    for path in (tmp_path / "__pycache__").glob("*.nb[ic]"):  # the saves below write these entries again
        path.unlink()

    files = cache._cache_file
    a_has_read, b_has_read, a_wrote_index, b_is_done = (threading.Event() for _ in range(4))
    read_index, write_index, write_data = files._load_index, files._save_index, files._save_data

    def hold_until(event: threading.Event) -> None:
        deadline = time.monotonic() + 10
        while not (event.is_set() or b_asks_for_lock.is_set()) and time.monotonic() < deadline:
            time.sleep(0.001)

    def is_a() -> bool:
        return threading.current_thread().name == "A"

    def hooked_read_index():
        overloads = read_index()
        (a_has_read if is_a() else b_has_read).set()
        return overloads

    def hooked_write_index(overloads):
        hold_until(b_has_read if is_a() else a_wrote_index)
        write_index(overloads)
        if is_a():
            a_wrote_index.set()

    def hooked_write_data(name, data):
        if is_a():
            hold_until(b_is_done)
        write_data(name, data)

    def save(sig) -> None:
        cache.save_overload(sig, twice.overloads[sig])
        if not is_a():
            b_is_done.set()

    files._load_index, files._save_index, files._save_data = hooked_read_index, hooked_write_index, hooked_write_data
    a, b = (threading.Thread(target=save, args=(sig,), name=name) for sig, name in [(int_sig, "A"), (float_sig, "B")])
    try:
        a.start()
        a_has_read.wait(10)
        b.start()
        a.join()
        b.join()
    finally:
        del files._load_index, files._save_index, files._save_data
    loaded = {sig: cache.load_overload(sig, twice.targetctx) for sig in (int_sig, float_sig)}
    return {sig: entry and tuple(entry.signature.args) for sig, entry in loaded.items()}


def test_processes_that_cache_two_signatures_at_once_keep_each_its_own_code(tmp_path, monkeypatch) -> None:
    """Unlocked, both saves took number 1 and the index named the int64 code for float64: a fresh
    process then ran ``twice(2.5)`` with the int64 code and got 4. The saves now take turns."""
    found = _save_two_signatures_at_once(tmp_path, monkeypatch, locked=True)
    assert found == {sig: sig for sig in found}


def test_an_entry_holding_another_signatures_code_is_compiled_again(tmp_path, monkeypatch) -> None:
    """Where saves cannot lock (no ``fcntl``, a filesystem without locks) or an older version broke
    the entry, a load checks that the code is the signature's own; the wrong code is a broken entry."""
    with pytest.warns(RuntimeWarning, match="holds the code of"):
        found = _save_two_signatures_at_once(tmp_path, monkeypatch, locked=False)
    assert found == {sig: None for sig in found}  # one entry lost to the race, one dropped as wrong


def test_a_forked_child_does_not_keep_the_cache_lock(tmp_path) -> None:
    """A child forked while the lock is held shares the lock file, and with it the lock: it used to keep
    every other process's saves waiting until it exited."""
    import signal
    import time

    fcntl = pytest.importorskip("fcntl")
    pytest.importorskip("numba")
    from smmf.kernels.numba_cpu import cache

    started, tell_started = os.pipe()
    with cache._cache_lock(str(tmp_path), exclusive=True):
        child = os.fork()
        if child == 0:  # fork's hooks have run when fork returns here
            os.write(tell_started, b"!")
            time.sleep(30)
            os._exit(0)
    assert os.read(started, 1) == b"!"
    fd = os.open(tmp_path / cache._LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while the child holds it
    finally:
        os.close(fd)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(started)
        os.close(tell_started)


def test_every_fused_kernel_survives_a_broken_cache() -> None:
    """Each numba kernel of the library that is cached (those called from Python: the functions they
    inline are compiled into them) is made by ``cached_njit``, whose cache reads and writes fall back
    to a compile and take turns with other processes, and whose compiles happen once across processes:
    one made by a bare ``numba.njit(cache=True)`` would fail at every first step after its cache entry
    broke."""
    pytest.importorskip("numba")
    import importlib
    import importlib.util
    import pkgutil

    import numba.core.caching
    import numba.core.registry

    import smmf.kernels.numba_cpu as package

    cached = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        for name, value in vars(importlib.import_module(info.name)).items():
            if (isinstance(value, numba.core.registry.CPUDispatcher) and value.__module__ == info.name
                    and not isinstance(value._cache, numba.core.caching.NullCache)):
                cached[f"{info.name}.{name}"] = value
    assert {"kernel_serial", "many_kernel", "many_blocks_kernel"} <= {name.rsplit(".", 1)[1] for name in cached}
    def wrappers(method) -> set[str]:
        """The functions that ``method`` calls through its closure, down to numba's own method."""
        names = set()
        while getattr(method, "__closure__", None):
            names.add(method.__qualname__.split(".")[0])
            method = next(cell.cell_contents for cell in method.__closure__ if callable(cell.cell_contents))
        return names

    locks = importlib.util.find_spec("fcntl") is not None
    expected = {"_tolerate_broken_cache"} | ({"_take_turns"} if locks else set())
    for name, kernel in cached.items():
        cache = kernel._cache
        assert "_tolerate_broken_cache" in wrappers(cache.load_overload), f"{name} fails on a broken cache entry"
        assert wrappers(cache.load_overload) == wrappers(cache.save_overload) == expected, name
        assert wrappers(kernel.compile) == ({"_compile_once"} if locks else set()), f"{name} compiles in every process"


def test_a_kernel_that_numba_cannot_cache_is_compiled_instead() -> None:
    pytest.importorskip("numba")
    from smmf.kernels.numba_cpu.cache import cached_njit

    namespace: dict = {}
    exec("def plus_one(x):\n    return x + 1", namespace)  # no source file: numba has nowhere to cache it
    assert cached_njit()(namespace["plus_one"])(1) == 2


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("momentum_shape", ["square", "natural"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_numba_shard_passes_add_up_to_the_whole_step(dtype: torch.dtype, momentum_shape: str) -> None:
    """The FSDP2 shard pass on pieces of a matrix (partial rows, mid-byte starts, an empty piece),
    sums added up across pieces, equals the step of the whole matrix."""
    from helpers import pieces_match_whole
    from smmf.kernels.numba_cpu import numba_shard_step_

    pieces_match_whole(numba_shard_step_, "cpu", dtype, 1e-12 if dtype == torch.float64 else 1e-5, momentum_shape)


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("dither", [False, True], ids=["nearest", "stochastic"])
def test_numba_levels_shard_passes_add_up_to_the_whole_step(dither: bool) -> None:
    """The levels code's FSDP2 shard pass on pieces of whole rows of a param (V's view cut mid-row, an
    empty piece, rows whose blocks of 128 end short), V's sums added up across pieces, equals the torch
    path's step of the whole param: fp64 at 1e-12 over 3 steps, each piece's codes and scales those of its
    rows. Dithered, a piece's elements draw by their index in the whole param."""
    from helpers import levels_step_in_pieces
    from smmf.functional import StepConfig
    from smmf.kernels.numba_cpu import numba_shard_step_
    from smmf.state import init_state

    gen = torch.Generator().manual_seed(11)
    for shape in [(48, 64), (31, 9), (257, 33), (40, 600), (12, 5, 7)]:
        p = torch.randn(shape, generator=gen, dtype=torch.float64)
        state = init_state(p, {"beta": 0.9, "vector_reshape": True, "magnitude_bits": 3})
        rows = shape[0]
        cuts = [0, rows // 3, rows // 3, rows // 2 + 1, rows]  # rows of the param; an empty piece
        for step in range(1, 4):
            cfg = StepConfig(lr=1e-2, beta1=0.9 * 0.999 ** (step - 1), beta2=0.9, eps=1e-8, weight_decay=0.1,
                             decoupled_weight_decay=step != 2, maximize=step == 3, stochastic_rounding=False,
                             code=MomentumCode.LEVELS, levels_salt=1000 * step + 7 if dither else None)
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            whole, whole_state = p.clone(), copied_state(state)
            torch_step_(whole, g, whole_state, cfg)
            flat = levels_step_in_pieces(numba_shard_step_, p, g, state, cfg, cuts)
            torch.testing.assert_close(flat, whole.reshape(-1), rtol=0, atol=1e-12)
            for key in ("row_v", "col_v"):
                torch.testing.assert_close(state[key], whole_state[key], rtol=1e-12, atol=1e-12)
            for key in ("codes_m", "scales_m"):
                assert torch.equal(state[key], whole_state[key]), key
            p, state = whole, whole_state  # go on from identical inputs


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("code", [MomentumCode.SIGN, MomentumCode.LEVELS], ids=["paper", "levels"])
def test_numba_bf16_rounding_noise_follows_the_element_not_the_shard(code: MomentumCode) -> None:
    """bf16 stochastic rounding draws each element's noise by its index in the whole param: shards stepped
    with the param's key round every weight as the whole tensor's step does, bit for bit (a shard that hashed
    its own local indices would repeat the first shard's noise)."""
    from helpers import levels_step_in_pieces, piece_cuts, step_in_pieces
    from smmf.functional import StepConfig
    from smmf.kernels.numba_cpu import numba_shard_step_, numba_step_
    from smmf.state import init_state, matrix_shape

    gen = torch.Generator().manual_seed(4)
    p = torch.randn(40, 600, generator=gen).bfloat16()
    g = torch.randn(40, 600, generator=gen).bfloat16()
    bits = 3 if code is MomentumCode.LEVELS else 0
    state = init_state(p, {"beta": 0.9, "vector_reshape": True, "magnitude_bits": bits})
    cfg = StepConfig(lr=1e-2, beta1=0.9, beta2=0.0, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                     maximize=False, stochastic_rounding=True, code=code, rounding_key=2**32 - 5)

    whole, whole_state, nearest, nearest_state = p.clone(), copied_state(state), p.clone(), copied_state(state)
    numba_step_(whole, g, whole_state, cfg)
    numba_step_(nearest, g, nearest_state, replace(cfg, stochastic_rounding=False))
    assert not torch.equal(nearest, whole)  # the noise was drawn
    if code is MomentumCode.LEVELS:
        flat = levels_step_in_pieces(numba_shard_step_, p, g, state, cfg, [0, 13, 27, 40])
    else:
        flat = step_in_pieces(numba_shard_step_, p, g, state, cfg, piece_cuts(p.numel(), matrix_shape(p)[1]))
    assert torch.equal(flat.view(torch.int16), whole.reshape(-1).view(torch.int16))


def _threads_as_ranks(pieces: int):
    """An all-reduce among ``pieces`` threads, each standing in for a rank: ``reduce_for(i)`` is
    piece i's :data:`smmf.distributed.Reducer`."""
    import threading

    barrier = threading.Barrier(pieces, timeout=120)
    slots: list = [None] * pieces

    def reduce_for(i: int):
        def reduce(sums: list[torch.Tensor]) -> list[torch.Tensor]:
            slots[i] = torch.cat(sums)
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())
            barrier.wait()  # every piece has read every slot before the next reduce overwrites one
            return list(total.split([s.numel() for s in sums]))

        return reduce

    return reduce_for


@pytest.mark.skipif("numba" not in FUSED_BACKENDS, reason="needs numba")
@pytest.mark.parametrize("l2", [False, True], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("momentum_shape", ["square", "natural"])
def test_numba_flag_shard_passes_add_up_to_the_whole_step(l2: bool, momentum_shape: str) -> None:
    """The magnitude flag's two shard passes on pieces of a matrix (partial rows, mid-byte starts, an
    empty piece), one thread per piece standing in for a rank and the sums all-reduced after each
    pass, equal the torch path's step of the whole matrix: fp64 at 1e-12 over 3 steps. With L2 decay
    the second pass steps the weights (M needs them before the step)."""
    import threading

    from helpers import piece_cuts, piece_state
    from smmf.distributed import _fused_flag_shard_step_
    from smmf.functional import StepConfig
    from smmf.kernels.numba_cpu import BACKEND as NUMBA
    from smmf.matrix import unpack_signs
    from smmf.state import init_state, matrix_shape

    gen = torch.Generator().manual_seed(5)
    for shape in [(48, 64), (31, 9), (257, 33), (129, 600)]:
        p = torch.randn(shape, generator=gen, dtype=torch.float64)
        state = init_state(p, {"beta": 0.9, "vector_reshape": True, "magnitude_bits": 1, "momentum_shape": momentum_shape})
        numel, cols = p.numel(), matrix_shape(p)[1]
        cuts = piece_cuts(numel, cols)
        for step in range(1, 4):
            cfg = StepConfig(lr=1e-2, beta1=0.9 * 0.999 ** (step - 1), beta2=0.9, eps=1e-8, weight_decay=0.01,
                             decoupled_weight_decay=not l2, maximize=step == 3, stochastic_rounding=False,
                             code=MomentumCode.FLAG)
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            whole, whole_state = p.clone(), copied_state(state)
            torch_step_(whole, g, whole_state, cfg)
            reduce_for = _threads_as_ranks(len(cuts) - 1)
            ranks, errors = [], []
            for i, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
                local = piece_state(state, lo, hi)
                piece = p.reshape(-1)[lo:hi].clone()
                ranks.append((piece, local, lo, hi))

                def run(piece=piece, local=local, lo=lo, hi=hi, i=i) -> None:
                    try:
                        _fused_flag_shard_step_(NUMBA, piece, g.reshape(-1)[lo:hi].clone(), local, cfg, lo,
                                                reduce_for(i))
                    except BaseException as error:  # noqa: BLE001 - re-raised below
                        errors.append(error)

                ranks[-1] += (threading.Thread(target=run),)
            for *_, thread in ranks:
                thread.start()
            for *_, thread in ranks:
                thread.join()
            assert not errors, errors
            torch.testing.assert_close(torch.cat([r[0] for r in ranks]), whole.reshape(-1), rtol=0, atol=1e-12)
            for _, local, _, _, _ in ranks:
                for key in ("row_v", "col_v", "row_m", "col_m", "levels_m"):
                    torch.testing.assert_close(local[key], whole_state[key], rtol=1e-12, atol=1e-12)
            for key in ("sign_m", "flag_m"):
                got = torch.cat([unpack_signs(local[key], hi - lo) for _, local, lo, hi, _ in ranks])
                assert torch.equal(got, unpack_signs(whole_state[key], numel)), key
            p, state = whole, whole_state  # go on from identical inputs
