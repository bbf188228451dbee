"""DDP, FSDP2 (with torch.distributed.checkpoint) and FSDP1 flat params: 2 processes, gloo, CPU."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dist_workers
from helpers import free_port
from smmf.kernels import available_backends

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
WORLD = 2


# On Linux, ranks fork from a server process that has imported torch and smmf once (multiprocessing's
# forkserver) instead of each starting an interpreter and importing them (spawn). The server does not see the
# tests' sys.path before Python 3.12.x (cpython gh-117378), so the workers' own module is not preloaded. A
# server's children have the environment it started with: a test that sets what its ranks read at start
# spawns them.
_START = "forkserver" if sys.platform.startswith("linux") else "spawn"
if _START == "forkserver":
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint",
                                            "torch.nn.parallel", "smmf"])


def _ranks(worker, world: int, *args, start_method: str = _START) -> None:
    """``worker(rank, world, port, *args)`` on ``world`` ranks, until every one has returned."""
    mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, join=True, start_method=start_method)


def _spawn(worker, tmp_path, *extra, start_method: str = _START) -> None:
    _ranks(worker, WORLD, str(tmp_path), *extra, start_method=start_method)


def test_ddp_matches_single_process(tmp_path) -> None:
    _spawn(dist_workers.ddp_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"ddp{r}.pt") for r in range(WORLD)]
    single = dist_workers.single_process_params()
    for p0, p1, ps in zip(*ranks, single):
        assert torch.equal(p0, p1)  # identical on both ranks
        torch.testing.assert_close(p0, ps, rtol=0, atol=1e-12)


@pytest.mark.parametrize("in_backward,backend", [(False, "torch"), (False, "auto"), (True, "auto")],
                         ids=["loop-torch", "loop-auto", "in-backward-auto"])
def test_ddp_replicas_round_bf16_alike_whatever_each_ranks_seed(tmp_path, in_backward: bool, backend: str) -> None:
    """The rounding noise is a hash of the step, the param's place and the element's index, not a draw from
    each rank's generator: replicas seeded apart stay equal bit for bit (they drifted apart, 2e-3 in 3 steps)."""
    _spawn(dist_workers.ddp_bf16_rounding_worker, tmp_path, in_backward, backend)
    ranks = [torch.load(tmp_path / f"bf16-{r}.pt") for r in range(WORLD)]
    start = dist_workers.make_net().bfloat16()
    for p0, p1, p_start in zip(*ranks, start.parameters()):
        assert torch.equal(p0, p1)
        assert not torch.equal(p0, p_start.detach())  # it trained


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_fsdp2_shards_round_bf16_as_the_whole_param(tmp_path, backend: str) -> None:
    """An FSDP2 shard draws each element's rounding noise by its index in the whole param: the elementwise
    (1-D) params' shards, the second rank's from element 3 or 4, round bit for bit as the unsharded step."""
    _spawn(dist_workers.fsdp2_bf16_rounding_worker, tmp_path, backend)
    result = torch.load(tmp_path / "fsdp2-bf16.pt")
    start = dist_workers.make_net().bfloat16()
    vectors = 0
    for sharded, whole, p_start in zip(result[True], result[False], start.parameters()):
        if sharded.dim() == 1:
            assert torch.equal(sharded, whole)
            assert not torch.equal(sharded, p_start.detach())  # it stepped
            vectors += 1
    assert vectors == 5


# Beyond the paper: M in its natural shape (whole rows of a Shard(0) shard) with the magnitude flag,
# and the flag on the square view (partial rows).
FSDP2_OPTIONS = {"paper": {}, "natural+flag": dict(momentum_shape="natural", magnitude_bits=1),
                 "flag": dict(magnitude_bits=1)}


@pytest.mark.parametrize("options", FSDP2_OPTIONS.values(), ids=FSDP2_OPTIONS.keys())
def test_fsdp2_matches_single_process_and_resumes_through_dcp(tmp_path, options: dict) -> None:
    _spawn(dist_workers.fsdp2_worker, tmp_path, options)
    result = torch.load(tmp_path / "fsdp2.pt")
    single = dist_workers.single_process_params(**options)
    moved = 0
    for straight, resumed, full, ps in zip(result["straight"], result["resumed"], result["resumed_full"], single):
        # Factors are summed across ranks: the same math as one device, up to summation order.
        torch.testing.assert_close(straight, ps, rtol=0, atol=1e-12)
        assert torch.equal(straight, resumed)  # DCP round trip continues exactly
        assert torch.equal(straight, full)  # and so does a full state dict, each rank taking its rows
    for straight, unsharded in zip(result["straight"], result["resumed_unsharded"]):
        torch.testing.assert_close(unsharded, straight, rtol=0, atol=1e-12)  # an unsharded run's, too
        moved += 1
    assert moved == len(single) > 0
    bit_arrays = 2 if options.get("magnitude_bits") else 1  # sign bits, and the flag's
    assert len(result["bit_bytes"]) > 0 and len(result["bit_bytes"]) % bit_arrays == 0
    assert all(b > 0 for b in result["bit_bytes"])
    # Shards take the fused kernel where numba is installed (a single fused pass; the flag's two).
    fused = "numba" in available_backends()
    assert result["paths"] == (["sharded numba"] if fused else ["sharded torch"])
    if fused:  # one all-reduce for every parameter of the step (two under the flag), not one per parameter
        assert result["collectives"] == {"all_reduce": 2 if options.get("magnitude_bits") else 1, "all_gather": 0,
                                         "all_gather_into_tensor": 0}


@pytest.mark.parametrize("options", [dict(magnitude_bits=3), dict(magnitude_bits=3, momentum_rounding="stochastic")],
                         ids=["nearest", "stochastic"])
def test_fsdp2_levels_code_matches_single_process_and_resumes_through_dcp(tmp_path, options: dict) -> None:
    """The levels code (``magnitude_bits=3``) was refused for DTensor params. A param of 2 or more dims is
    coded by its rows, so a Shard(0) shard codes its own rows; a vector is one row that FSDP2 cuts anywhere,
    stepped whole from the gathered gradient. Either way: one device's result. Rounded stochastically, a
    shard's elements draw by their index in the whole param, as on one device. With numba the rows' shards
    take its fused pass, their V sums in one all-reduce for the step (it was one per param), and the
    vectors are stepped whole by it from one all-gather for all of them (it was one each, on the torch
    path)."""
    _spawn(dist_workers.fsdp2_worker, tmp_path, options)
    result = torch.load(tmp_path / "fsdp2.pt")
    single = dist_workers.single_process_params(**options)
    start = dist_workers.make_net()
    assert len(result["straight"]) == len(single) > 0
    for straight, resumed, full, ps, p0 in zip(result["straight"], result["resumed"], result["resumed_full"], single,
                                               start.parameters()):
        assert not torch.equal(ps, p0.detach())  # it trained
        torch.testing.assert_close(straight, ps, rtol=0, atol=1e-12)
        assert torch.equal(straight, resumed)  # DCP round trip continues exactly
        assert torch.equal(straight, full)  # a full state dict: its codes and scales were kept whole on every rank
    for straight, unsharded in zip(result["straight"], result["resumed_unsharded"]):
        torch.testing.assert_close(unsharded, straight, rtol=0, atol=1e-12)  # an unsharded run's, too
    if "numba" in available_backends():
        assert result["paths"] == ["sharded numba"]
        assert result["collectives"] == {"all_reduce": 1, "all_gather": 1, "all_gather_into_tensor": 0}


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_vectors_gathered_in_one_all_gather_come_back_whole(monkeypatch, world: int) -> None:
    """The levels code's sharded vectors share one all-gather of raw bytes: each comes back whole and in its
    own dtype, on every rank, whatever FSDP2's chunks (``ceil(n / world)`` a rank; later ranks short or empty)."""
    from smmf import distributed

    gen = torch.Generator().manual_seed(world)
    vectors = [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for n, dtype in
               [(1, torch.bfloat16), (13, torch.float16), (5, torch.float32), (7, torch.float64), (3, torch.bfloat16)]]

    def parts(rank: int) -> list[tuple[torch.Tensor, int]]:
        chunks = [v.chunk(world) for v in vectors]  # FSDP2's dim-0 split
        return [(c[rank] if rank < len(c) else v[:0], v.numel()) for c, v in zip(chunks, vectors)]

    sent: dict[int, torch.Tensor] = {}
    for rank in range(world):  # what each rank contributes
        monkeypatch.setattr(dist, "all_gather", lambda pieces, mine, group=None, rank=rank: sent.setdefault(rank, mine))
        distributed._gather_vectors(parts(rank), world, None)
    monkeypatch.setattr(dist, "all_gather", lambda pieces, mine, group=None: [p.copy_(sent[r]) for r, p in enumerate(pieces)])
    for rank in range(world):
        got = distributed._gather_vectors(parts(rank), world, None)
        assert [g.dtype for g in got] == [v.dtype for v in vectors]
        assert all(torch.equal(g, v) for g, v in zip(got, vectors))


@pytest.mark.skipif("numba" not in available_backends() or not os.path.exists("/proc/self/clear_refs"),
                    reason="needs numba and Linux /proc")
@pytest.mark.parametrize("options", [{}, FSDP2_OPTIONS["natural+flag"]], ids=["paper", "natural+flag"])
def test_fsdp2_shards_take_the_fused_pass_without_temporaries(tmp_path, monkeypatch, options: dict) -> None:
    """A shard's step used to go through the torch path (~4× the shard in temporaries), the magnitude
    flag's too."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # large temporaries visible to RSS
    _spawn(dist_workers.fsdp2_peak_worker, tmp_path, options, start_method="spawn")
    extra = torch.load(tmp_path / "fsdp2_peak.pt")
    assert extra["auto"] < 0.05
    assert extra["torch"] > 1.0  # the measurement does see shard-sized temporaries


def test_fsdp1_flat_parameters_are_rejected(tmp_path) -> None:
    pytest.importorskip("torch.distributed.fsdp")  # the only reason to skip: no FSDP1 in this build
    _spawn(dist_workers.fsdp1_flat_worker, tmp_path)  # a worker's error fails the test
    messages = torch.load(tmp_path / "fsdp1.pt")["messages"]
    assert len(messages) == 2  # use_orig_params False and True: both flatten
    assert all(m is not None and "flattened by FSDP1" in m and "fully_shard" in m for m in messages)


def test_complex_dtensor_params_are_rejected() -> None:
    """A shard's step counts real elements where FSDP2 counts complex ones: refused up front, not a crash
    mid-step after the weights were shrunk by decoupled decay."""
    from smmf import SMMF

    class DTensor(torch.Tensor):  # what smmf.sharding.is_dtensor recognises
        def to_local(self) -> torch.Tensor:
            return self

    fake = torch.zeros(4, 4, dtype=torch.complex64).as_subclass(DTensor).requires_grad_()
    with pytest.raises(RuntimeError, match="complex DTensor"):
        SMMF([fake])
    SMMF([torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))])  # unsharded complex: taken


# (kind, ranks, accumulation_steps, SMMF options): both wrappers at 2 and 3 ranks, k = 1 and 2, the
# flag and the natural shape among them.
IN_BACKWARD = [
    ("fsdp2", 2, 1, {}),
    ("fsdp2", 2, 2, FSDP2_OPTIONS["natural+flag"]),
    ("fsdp2", 3, 2, {}),
    ("fsdp2", 3, 1, dict(momentum_shape="natural")),
    ("fsdp2", 3, 2, dict(magnitude_bits=3)),  # the levels code: a shard's own rows; vectors gathered
    ("fsdp2 alone", 2, 2, {}),
    ("fsdp2", 3, 2, dict(clip=0.01)),  # per-tensor clipping: the whole tensor's norm, from its shards
    ("ddp", 2, 2, FSDP2_OPTIONS["flag"]),
    ("ddp", 3, 1, {}),
    ("ddp", 3, 2, dict(momentum_shape="natural")),
    ("ddp", 2, 2, dict(clip=0.01)),
    ("ddp shared", 2, 2, {}),  # another optimizer (SGD) holds the last layer: it keeps DDP's averaged gradients
    ("ddp added", 2, 1, {}),  # the last layer added with add_param_group after the hooks were installed
    ("ddp ignored", 2, 2, {}),  # a param in DDP's parameters_to_ignore: stepped by its own hook
]


@pytest.mark.parametrize("kind,world,k,options", IN_BACKWARD,
                         ids=[f"{kind.replace(' ', '-')}-{world}ranks-k{k}-{'+'.join(options) or 'paper'}"
                              for kind, world, k, options in IN_BACKWARD])
def test_step_in_backward_matches_the_ordinary_loop(tmp_path, kind: str, world: int, k: int, options: dict) -> None:
    """Was refused under any process group of more than one rank."""
    _ranks(dist_workers.step_in_backward_worker, world, str(tmp_path), kind, options, k)
    result = torch.load(tmp_path / "in_backward.pt")
    ordinary, inside = result[False], result[True]
    assert ordinary["clipped"] > 0 if "clip" in options else ordinary["clipped"] == 0
    start = dist_workers.make_net()
    for p_ordinary, p_inside, p0 in zip(ordinary["params"], inside["params"], start.parameters()):
        assert not torch.equal(p_ordinary, p0.detach())  # it trained
        torch.testing.assert_close(p_inside, p_ordinary, rtol=0, atol=1e-12)
    for s_ordinary, s_inside in zip(ordinary["state"], inside["state"]):
        assert s_ordinary.keys() == s_inside.keys()
        for key, value in s_ordinary.items():
            if value.is_floating_point():
                torch.testing.assert_close(s_inside[key], value, rtol=0, atol=1e-12)
            else:  # step counts and bits (the flag's only at 2 ranks here: at 3 the per-parameter all-reduces
                # of the step inside backward sum in another order than the step's one, and a flag can flip at a tie)
                assert torch.equal(s_inside[key], value), key
    # FSDP2's gradients are freed as they are used; DDP keeps its buckets, handed zeros.
    if kind.startswith("fsdp2"):
        assert all(g is None for g in inside["grads"])
    else:  # ("ddp shared": the other optimizer's zero_grad set its params' to None)
        assert all(g is None or not g.any() for g in inside["grads"])
        assert kind != "ddp" or all(g is not None for g in inside["grads"])
    if kind == "ddp ignored":
        return  # each rank's copy of the param DDP ignores differs; DCP keeps one of them
    # Checkpoints are interchangeable: each continued from the other's equals its own continuation.
    straight, crossed, straight_inside, crossed_inside = result["continued"]
    for continued in (crossed, straight_inside, crossed_inside):
        for a, b in zip(continued, straight):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_ddp_refusals_leave_the_optimizer_as_it_was(tmp_path) -> None:
    """DDP with find_unused_parameters=True (a param one rank leaves unused would be stepped on the other
    ranks only), and a param outside the module added after the hooks were installed."""
    _spawn(dist_workers.ddp_refusals_worker, tmp_path)
    assert all((tmp_path / f"refused{rank}").exists() for rank in range(WORLD))


def _element_levels(state: dict, param: torch.Tensor) -> torch.Tensor:
    """Each element's magnitude level under the flag, from the bits by rows of the parameter."""
    rows = param.shape[0]
    bits = (state["flag_m"].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    flags = bits.flatten(1)[:, : param.numel() // rows].bool()
    return torch.where(flags, state["levels_m"][0], state["levels_m"][1])


@pytest.mark.parametrize("options", [FSDP2_OPTIONS["flag"], dict(magnitude_bits=3)], ids=["flag", "levels"])
def test_fsdp2_checkpoint_loads_on_other_numbers_of_ranks(tmp_path, options: dict) -> None:
    """A checkpoint resumed only on the number of ranks that saved it (the bits were laid out per rank).
    The flag: sign and flag bits, partial rows of the square view; the levels code: codes and scales by rows
    of the param (Shard(0) DTensors that DCP reshards), a vector's replicated."""
    for saved_on, loaded_on in ((2, (1, 3, 4)), (3, (1, 2))):
        _ranks(dist_workers.reshard_save_worker, saved_on, str(tmp_path), options)
        for world in loaded_on:
            _ranks(dist_workers.reshard_load_worker, world, str(tmp_path), options, saved_on)
        one = torch.load(tmp_path / f"loaded-{saved_on}-on-1.pt")
        start = dist_workers.make_net()
        assert all(not torch.equal(p, p0.detach()) for p, p0 in zip(one["params"], start.parameters()))
        for world in loaded_on[1:]:
            other = torch.load(tmp_path / f"loaded-{saved_on}-on-{world}.pt")
            for p, p1 in zip(other["params"], one["params"]):
                torch.testing.assert_close(p, p1, rtol=0, atol=1e-12)
            for state, state1, p in zip(other["state"], one["state"], one["params"]):
                assert state.keys() == state1.keys()
                for key, value in state.items():
                    if key in ("flag_m", "levels_m"):  # compared decoded, below
                        continue
                    if value.is_floating_point():
                        torch.testing.assert_close(value, state1[key], rtol=0, atol=1e-12)
                    else:  # step, and the sign bits by rows of the parameter
                        assert torch.equal(value, state1[key]), key
                # The flag's level of each element. A tensor whose rank-1 fit is exact (a vector on its n×1
                # view) has |M| = r cᵀ everywhere: its flags are ties, set either way by the last bit of a
                # sum, and every flagged element gets a level of 1 then, whichever flag it has.
                if "flag_m" in state:
                    torch.testing.assert_close(_element_levels(state, p), _element_levels(state1, p), rtol=0, atol=1e-12)
            if world == 3 and "flag_m" in other["state"][0]:
                assert "laid out per rank" in other["refusal"] and "another number of ranks" in other["refusal"]
            elif world == 3:  # the levels code keeps no sign bits: the offered ones are refused too, unchanged
                assert "sign_m" in other["refusal"]
