"""SMMF under DeepSpeed ZeRO, stages 1, 2 and 3, on CPU over gloo (``DS_ACCELERATOR=cpu``) at 1, 2 and 3 ranks: each
tensor stepped with its own factorization, equal to the same training in one process; bf16 mixed precision equal to
the same steps by hand; checkpoints that resume exactly; what is not supported refused before anything changes.
Skipped where deepspeed is not installed (``pip install deepspeed``; CI installs it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deepspeed_workers as workers
from helpers import deepspeed_shm_removed, free_port
import smmf
import smmf.zero
from smmf.matrix import square_matricize_shape

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]
ROOT = Path(__file__).resolve().parent.parent
RECOMMENDED = dict(smmf.RECOMMENDED)
# The update of a whole run over STEPS steps, by tensor: DeepSpeed's params may differ from one process's by this
# much of it (the order of the factor sums; with torch's Adam as the client this harness agrees to 7.5e-7).
UPDATE_TOLERANCE = 1e-5
# The same, for the codes of M that make a discrete choice per element (the magnitude flag's bit, the levels code's
# level): float noise of that size can flip a choice, and a flipped flag moves its tensor's two levels. On an Intel
# Xeon, 2 of 38,700 level codes flipped in 5 steps at 2 ranks (4.7e-4), and the flag's bits at 3 ranks (2.5e-3); an
# error in the pieces' mapping gives O(1).
DISCRETE_TOLERANCE = 5e-3


def _tolerance(options: dict) -> float:
    return DISCRETE_TOLERANCE if options.get("magnitude_bits", 0) else UPDATE_TOLERANCE


def _battery(tmp_path: Path, world: int, jobs: list) -> dict:
    port = free_port()
    with deepspeed_shm_removed(port):
        mp.start_processes(workers.battery, args=(world, port, str(tmp_path), jobs), nprocs=world, join=True,
                           start_method="spawn")
    return torch.load(tmp_path / f"battery-{world}.pt")


def _gap(got: list[torch.Tensor], expected: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """The largest difference by tensor, over the tensor's update in the run."""
    return max(((g - e).norm() / (e - s).norm()).item() for g, e, s in zip(got, expected, start))


@pytest.fixture
def one_thread():
    """The reference on one thread, as the ranks run: the fused kernels' sums follow the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_reproducer_factorizes_each_tensor_not_the_flat_buffer(tmp_path) -> None:
    """The reproducer of the bug: ZeRO-2 handed SMMF one flat buffer of all 9610 params, which it factorized as a
    155×62 matrix. Each param's state now has its own factors, laid out as on one device."""
    port = free_port()
    script = textwrap.dedent(f"""
        import os, sys, torch
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0", DS_ACCELERATOR="cpu")
        import deepspeed
        from smmf import SMMF
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
        opt = SMMF(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={{"train_batch_size": 8,
            "zero_optimization": {{"stage": 2}}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}})
        loss = engine(torch.randn(8, 64)).pow(2).mean(); engine.backward(loss); engine.step()
        states = next(iter(opt.state.values()))["pieces"]
        torch.save({{o: {{k: tuple(v.shape) for k, v in s.items() if torch.is_tensor(v)}} for o, s in states.items()}},
                   sys.argv[1])
    """)
    out = tmp_path / "shapes.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with deepspeed_shm_removed(port):
        proc = subprocess.run([sys.executable, "-c", script, str(out)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shapes = torch.load(out)
    assert sorted(shapes) == [0, 1, 2, 3]
    for ordinal, numel in enumerate((64 * 128, 128, 128 * 10, 10)):
        rows, cols = square_matricize_shape(numel)
        assert shapes[ordinal] == {"row_m": (rows,), "col_m": (cols,), "sign_m": (-(-numel // 8),),
                                   "row_v": (rows,), "col_v": (cols,)}


def _equality_cases(world: int) -> list:
    """Stages 1, 2, 3 with the paper's code and smmf.RECOMMENDED; with more than one rank also gradient
    accumulation with DeepSpeed's clipping on, the magnitude flag, M's natural shape, no first moment and the dense
    state of vectors, ZeRO's options that move the buffers (round-robin order, stage 3's sub-groups, the optimizer
    offloaded to the CPU), and SMMF built by DeepSpeed from a client callable."""
    cases = [(f"stage{stage}-{name}", options, dict(stage=stage))
             for stage in (1, 2, 3) for name, options in (("paper", {}), ("recommended", RECOMMENDED))]
    if world > 1:
        cases += [
            ("stage2-paper-accumulation-clipping", {}, dict(stage=2, accumulation=2, clip=0.05)),
            ("stage3-recommended-accumulation-clipping", RECOMMENDED, dict(stage=3, accumulation=2, clip=0.05)),
            ("stage1-flag", dict(magnitude_bits=1), dict(stage=1)),
            ("stage3-flag", dict(magnitude_bits=1), dict(stage=3)),
            ("stage2-natural", dict(momentum_shape="natural"), dict(stage=2)),
            ("stage3-no-first-moment", dict(beta=None), dict(stage=3)),
            ("stage2-dense-vectors", dict(vector_reshape=False), dict(stage=2)),
            ("stage2-round-robin", {}, dict(stage=2, round_robin_gradients=True)),
            ("stage3-sub-groups", RECOMMENDED, dict(stage=3, sub_group_size=5000)),
            ("stage2-offload", RECOMMENDED, dict(stage=2, offload_optimizer={"device": "cpu"})),
            ("stage3-built-by-deepspeed", RECOMMENDED, dict(stage=3, callable=True)),
        ]
    return cases


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zero_equals_one_process(tmp_path, one_thread, world: int) -> None:
    """fp32: DeepSpeed's params after STEPS steps are the one-process run's to 1e-5 of their update (5e-3 under the
    codes that choose per element: DISCRETE_TOLERANCE), whatever the stage, the code of M and the ranks; each rank's pieces keep the factors of their whole tensor. bf16 mixed
    precision: DeepSpeed's fp32 masters step as the same masters stepped by hand in one process with the gradient
    DeepSpeed reduced, and the model's bf16 weights are those masters rounded to nearest."""
    cases = _equality_cases(world)
    bf16 = [(f"stage{stage}-{name}", options, dict(stage=stage))
            for stage in (1, 2, 3) for name, options in (("paper", {}), ("recommended", RECOMMENDED))]
    results = _battery(tmp_path, world, [("equality", cases), ("bf16_by_hand", bf16)])
    gaps = {}
    for name, options, settings in cases:
        expected, start = workers.single_process(options, world, settings.get("accumulation", 1),
                                                 settings.get("clip", 0.0))
        gaps[name] = _gap(results["equality"][name]["params"], expected, start)
        pieces = results["equality"][name]["pieces"]
        assert pieces, name
        for ordinal, shapes in pieces.items():
            if "row_v" in shapes:  # the factors of the whole tensor, wherever ZeRO cut it
                numel = [p.numel() for p in workers.make_model().parameters()][ordinal]
                assert (shapes["row_v"][0], shapes["col_v"][0]) == square_matricize_shape(numel), (name, ordinal)
    print(f"\nfp32, {world} rank(s), difference over the update: {gaps}")
    assert all(gaps[name] < _tolerance(options) for name, options, _ in cases), gaps
    by_hand = results["bf16_by_hand"]
    print(f"bf16, {world} rank(s), per step: {by_hand}")
    for name, result in by_hand.items():
        assert result["rounded"], name
        assert max(result["gaps"]) < UPDATE_TOLERANCE, (name, result["gaps"])


def test_checkpoints_resume_exactly_and_another_number_of_ranks_is_refused(tmp_path) -> None:
    """``engine.save_checkpoint`` at step 3 and ``load_checkpoint`` into fresh objects continue the run bit for bit at
    the same number of ranks, every stage and code; at another number DeepSpeed refuses the load (its own
    ZeRORuntimeException, for every optimizer) with SMMF's state and its fp32 masters as they were. (It has loaded
    the module's weights by then.)"""
    cases = [(f"stage{stage}-{name}", options, dict(stage=stage))
             for stage in (1, 2, 3) for name, options in (("paper", {}), ("recommended", RECOMMENDED),
                                                            ("flag", dict(magnitude_bits=1)))]
    saved = _battery(tmp_path, 2, [("checkpoints", cases)])["checkpoints"]
    for name, result in saved.items():
        assert all(torch.equal(a, b) for a, b in zip(result["straight"], result["resumed"])), name
    for world in (1, 3):
        for name, result in _battery(tmp_path, world, [("reloads", cases)])["reloads"].items():
            assert result["error"] is not None and "world size of 2" in result["error"], (name, result)
            assert result["same_state"] and result["same_masters"], (name, result)


def test_a_checkpoint_of_another_world_size_is_refused_before_deepspeed_changes_weights(tmp_path) -> None:
    """ZeRO-3 with a frozen layer, saved at 2 ranks, loaded at 1 or 3: DeepSpeed's own load fails inside its module
    load with a size mismatch (not its refusal of another world size); ``smmf.zero.load_checkpoint`` refuses it
    first, naming both world sizes, with the weights, the masters and SMMF's state as they were. At 2 ranks it
    loads."""
    cases = [("stage3-frozen", {}, dict(stage=3, frozen=True, checked=True))]
    saved = _battery(tmp_path, 2, [("checkpoints", cases)])["checkpoints"]
    assert all(torch.equal(a, b) for a, b in zip(saved["stage3-frozen"]["straight"], saved["stage3-frozen"]["resumed"]))
    for world in (1, 2, 3):
        result = _battery(tmp_path, world, [("reloads", cases)])["reloads"]["stage3-frozen"]
        if world == 2:
            assert result["error"] is None, result
            continue
        assert result["error"] is not None and f"saved at 2 data-parallel ranks and this engine runs {world}" in \
            result["error"], result
        assert result["same_state"] and result["same_masters"] and result["same_weights"], result


def test_an_option_refused_in_one_group_leaves_every_group_unstepped(tmp_path) -> None:
    """ZeRO steps its client once per group (stage 3: per sub-group), and ZeRO-1/2 cut ``param_groups`` to that
    group meanwhile: an option of group 1 refused (a NaN lr) or a layout option changed there (also after a resume
    from a checkpoint) was refused only after group 0 had stepped, and ZeRO-1/2 left the groups cut. Now every
    group's options and layouts are checked before any steps: nothing changes, the groups stay whole, and the step
    after the option is set back steps every piece once."""
    changes = [("lr", float("nan")), ("magnitude_bits", 3), ("beta", None), ("vector_reshape", False)]
    cases = [(f"stage{stage}-{key}", {}, dict(stage=stage, change=(key, value)))
             for stage in (1, 2, 3) for key, value in changes]
    cases += [(f"stage{stage}-reloaded-magnitude_bits", {}, dict(stage=stage, change=("magnitude_bits", 3), reload=True))
              for stage in (1, 3)]
    for name, result in _battery(tmp_path, 1, [("option_changes", cases)])["option_changes"].items():
        assert result["error"] is not None, (name, result)
        assert ("learning rate" in result["error"]) == name.endswith("lr"), (name, result)
        assert result["same_masters"] and result["same_state"] and result["groups"] == 2, (name, result)
        assert result["steps"] == [2], (name, result)


def test_deepspeeds_step_at_initialize_does_not_count_and_zero_state_is_refused_by_a_plain_smmf(tmp_path) -> None:
    """DeepSpeed without ZeRO on bf16 or fp16 weights steps its client once at ``initialize`` with zero gradients:
    SMMF counted it as step 1 (the weights decayed before training, β2's schedule shifted: the first update 1.2-1.33×
    the plain loop's). It makes no state now, and the first step equals a plain SMMF's on the same masters and
    gradients. And a ZeRO client state loaded into a plain SMMF is refused as what it is."""
    cases = [(f"stage0-{dtype}-{name}", options, dict(stage=0, **{dtype: True}))
             for dtype in ("bf16",) for name, options in (("paper", {}), ("recommended", RECOMMENDED))]
    fp16 = [("stage0-fp16-paper", {}, dict(stage=0, fp16=True))]
    zero = [("stage2", {}, dict(stage=2)), ("stage3", {}, dict(stage=3))]
    results = _battery(tmp_path, 1, [("initial_step", cases + fp16), ("plain_load", zero)])
    print(f"\nthe first step against a plain SMMF's, over the update: {results['initial_step']}")
    for name, result in results["initial_step"].items():
        assert result["state_at_initialize"] == 0 and result["steps"] == [1], (name, result)
        assert result["gap"] < UPDATE_TOLERANCE, (name, result)
    for name, error in results["plain_load"].items():
        assert error is not None and "DeepSpeed ZeRO partition" in error and "engine.load_checkpoint" in error, name


def test_what_is_not_supported_is_refused_before_anything_changes(tmp_path) -> None:
    """ZeRO-1/2's elastic checkpoints (which merge and re-cut the state as flat tensors) are refused at the first
    step; so is a buffer whose state another optimizer's keys were loaded into (what DeepSpeed's universal checkpoint
    loads), at the step after; and the step inside backward on the engine's SMMF. Nothing changes."""
    cases = [("stage2-elastic", {}, dict(stage=2, elastic_checkpoint=True)),
             ("stage1-elastic-offload", {}, dict(stage=1, elastic_checkpoint=True, offload_optimizer={"device": "cpu"})),
             ("stage2-universal", {"foreign state": True}, dict(stage=2)),
             ("stage3-universal", {"foreign state": True}, dict(stage=3)),
             ("stage2-step-in-backward", {"step in backward": True}, dict(stage=2))]
    results = _battery(tmp_path, 2, [("refusals", cases)])["refusals"]
    for name, result in results.items():
        assert result["error"] is not None and result["same_params"] and result["new_state"] == 0, (name, result)
        assert ("elastic_checkpoint" in result["error"]) == ("elastic" in name), (name, result)
        assert ("universal checkpoint" in result["error"]) == ("universal" in name), (name, result)
        assert ("inside backward" in result["error"]) == ("backward" in name), (name, result)


def test_nvme_offload_and_partial_data_parallel_groups_are_refused(monkeypatch) -> None:
    """What cannot run on this machine's DeepSpeed (NVMe needs its async I/O op) or without a model-parallel
    launcher: the refusals themselves, on stand-ins for DeepSpeed's objects."""
    from types import SimpleNamespace

    from smmf.zero import refuse_unsupported

    with pytest.raises(RuntimeError, match="NVMe"):
        refuse_unsupported(SimpleNamespace(swap_optimizer=True), None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group is not None else 4)
    with pytest.raises(RuntimeError, match="2 of 4 ranks"):
        refuse_unsupported(None, "a data-parallel group of 2")


TRAVEL_CODES = (("paper", {}), ("recommended", RECOMMENDED), ("flag", dict(magnitude_bits=1)))


def test_checkpoints_travel_between_zero_stages_world_sizes_one_process_and_fsdp2(tmp_path, one_thread) -> None:
    """Saved at 2 ranks under ZeRO-1, 2 and 3 after 3 steps, each code: ``smmf.zero.tensorwise_state`` joins the
    ranks' pieces offline into a plain SMMF state dict, which continues the run for 3 more steps in one process
    (``SMMF.load_state_dict``), under ZeRO at 1, 2 and 3 ranks (``smmf.zero.load_state``, each rank cutting its
    pieces) and under FSDP2 at 3 ranks (``load_state_dict``, each rank taking its rows); and an FSDP2 run saved at 2
    ranks (its full optimizer state dict) and a run of 3 steps in one process continue under ZeRO-1, 2 and 3 at 3
    ranks. Every run takes the same
    global batches: each ends within float noise of the uninterrupted run in one process (over the tensor's update
    in the 6 steps); so do runs whose SMMF holds two groups and a frozen layer (ZeRO-2 and 3). A tensor-wise state
    of another code of M, of another model or of another optimizer is refused under ZeRO by every rank (at 1 and 2
    ranks), with SMMF's state and the masters as they were."""
    cases = [(f"stage{stage}-{name}", options, dict(stage=stage)) for stage in (1, 2, 3) for name, options in TRAVEL_CODES]
    grouped = [(f"stage{stage}-paper-grouped", {}, dict(stage=stage, grouped=True)) for stage in (2, 3)]
    fsdp2 = [(f"fsdp2-{name}", options, {}) for name, options in TRAVEL_CODES]
    from_fsdp2 = [(f"fsdp2-{name}-to-stage{stage}", options, dict(stage=stage, folder=f"fsdp2-{name}"))
                  for stage in (1, 2, 3) for name, options in TRAVEL_CODES]
    from_one = [(f"one-{name}-to-stage{stage}", options, dict(stage=stage, folder=f"one-{name}"))
                for stage in (1, 2, 3) for name, options in TRAVEL_CODES]
    _battery(tmp_path, 2, [("travel_save", cases + grouped), ("travel_fsdp2_save", fsdp2)])
    gaps: dict[str, dict[str, float]] = {}
    references = {name: workers.one_process(options, range(6)) for name, options in TRAVEL_CODES}
    for name, options in TRAVEL_CODES:  # a run of 3 steps in one process, to continue under ZeRO
        workers.one_process(options, range(3), save=tmp_path / f"one-{name}")
    # Two groups, the first layer frozen but given to SMMF: the groups' counts (frozen params too) travel.
    references["paper-grouped"] = workers.one_process({}, range(6), grouped=True)
    for name, options, settings in cases + grouped:
        plain = smmf.zero.tensorwise_state(tmp_path / name)  # the tag from 'latest'
        torch.save(plain, tmp_path / name / "plain.pt")
        continued, _ = workers.one_process(options, range(3, 6), torch.load(tmp_path / name / "weights.pt"), plain,
                                           grouped=settings.get("grouped", False))
        expected, start = references[name.split("-", 1)[1]]
        if settings.get("grouped"):  # the frozen layer as it was, the rest within noise
            assert all(torch.equal(a, b) for a, b in zip(continued[:2], start[:2])), name
            continued, expected, start = continued[2:], expected[2:], start[2:]
        gaps[name] = {"1 process": _gap(continued, expected, start)}
    for world in (1, 2, 3):
        jobs = [("travel_resume", cases + grouped + (from_fsdp2 + from_one if world == 3 else []))] + \
            ([("travel_fsdp2", cases)] if world == 3 else [])
        refusals = [(f"stage{stage}-paper", {}, dict(stage=stage, own=f"stage{stage}-paper",
                                                    other_code=f"stage{stage}-recommended")) for stage in (1, 3)]
        # At 2 ranks the other model's odd tensor (the first) lies in rank 0's pieces alone: rank 1 refuses too.
        results = _battery(tmp_path, world, jobs + ([("travel_refusals", refusals)] if world < 3 else []))
        assert len(results.get("travel_refusals", {})) == (2 if world < 3 else 0)
        for name, offers in results.get("travel_refusals", {}).items():
            print(name, {label: result["error"][:150] for label, result in offers.items()})
            for label, result in offers.items():
                assert result["error"] is not None and result["same_state"] and result["same_masters"], (name, label, result)
                assert len(result["ranks"]) == world and all(error and same for error, same in result["ranks"]), result
            assert "magnitude_bits" in offers["other code"]["error"], offers
            assert "has shape (5,)" in offers["other model"]["error"], offers
            assert "another optimizer's state dict" in offers["Adam"]["error"], offers
        for job, label in (("travel_resume", f"ZeRO at {world}"), ("travel_fsdp2", f"FSDP2 at {world}")):
            for name, params in results.get(job, {}).items():
                code = name.split("-", 1)[1] if name.endswith("grouped") else name.split("-")[1]
                expected, start = references[code]
                if name.endswith("grouped"):  # DeepSpeed's full params are the trainable ones: not fc1's two
                    expected, start = expected[2:], start[2:]
                assert len(params) == len(expected), name
                gaps.setdefault(name, {})[label] = _gap(params, expected, start)
    print("\nsaved at 2 ranks, continued elsewhere: largest difference from one uninterrupted process, over the update")
    for name, row in gaps.items():
        print(f"{name}: " + ", ".join(f"{where} {gap:.1e}" for where, gap in row.items()))
    zero = ["1 process", "ZeRO at 1", "ZeRO at 2", "ZeRO at 3"]
    assert all(list(gaps[name]) == zero + ["FSDP2 at 3"] for name, *_ in cases), gaps
    assert all(list(gaps[name]) == zero for name, *_ in grouped), gaps
    assert all(list(gaps[name]) == ["ZeRO at 3"] for name, *_ in from_fsdp2 + from_one), gaps
    for name, row in gaps.items():
        assert max(row.values()) < UPDATE_TOLERANCE, (name, row)

