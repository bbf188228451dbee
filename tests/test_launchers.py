"""The launchers users train with, run for real through their examples: the Hugging Face Trainer (torchrun),
Accelerate (``accelerate launch``) and Lightning (torchrun), each in 2 processes on CPU over gloo, with FSDP2 and with
DeepSpeed ZeRO. Each trains, saves at step 3, resumes into fresh objects and must equal its uninterrupted run bit for
bit (fp32, same ranks, same order of operations); Lightning's FSDP1 strategy must be refused by SMMF."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import deepspeed_shm_removed, free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")



def _launch(out: Path, launcher: str, script: str, *flags: str) -> dict:
    """Run ``examples/<script>`` in 2 processes; what its rank 0 wrote with ``--params``."""
    port = str(free_port())
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", port]
    else:  # accelerate launch; --multi_gpu (or --use_deepspeed) picks its torchrun launcher, the script asks for the CPU
        mode = "--use_deepspeed" if launcher == "accelerate-deepspeed" else "--multi_gpu"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", mode, "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", port]
    cmd += [str(ROOT / "examples" / script), "--out", str(out / "out"), "--params", str(out / "params.pt"), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    with deepspeed_shm_removed(port):
        try:
            output, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers
            output, _ = proc.communicate()
            pytest.fail(f"{script} {flags} did not finish in 300 s:\n{output[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}"
    return torch.load(out / "params.pt") | {"out": out / "out"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(launcher, script, *flags)``: each launch once per module (two tests share some)."""
    results: dict[tuple[str, ...], dict] = {}

    def launched(launcher: str, script: str, *flags: str) -> dict:
        key = (launcher, script, *flags)
        if key not in results:
            results[key] = _launch(tmp_path_factory.mktemp("launch"), *key)
        return results[key]

    return launched


def _assert_resumes_exactly(result: dict) -> None:
    assert result["resumed_steps"] == 3  # the resumed run did steps 4 to 6 only
    assert len(result["straight"]) == len(result["resumed"]) > 0
    for straight, resumed in zip(result["straight"], result["resumed"]):
        assert torch.equal(straight, resumed)


# ---- Hugging Face Trainer (FSDP2 through fsdp_config, SMMF through optimizer_cls_and_kwargs) ----

def test_hf_trainer_fsdp2_resumes_exactly(run) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    # On CPU Accelerate does not select FSDP: --fsdp-on-cpu sets its state to FSDP after the Trainer made it.
    result = run("torchrun", "hf_trainer_fsdp2.py", "--fsdp-on-cpu")
    assert result["distributed_type"] == "DistributedType.FSDP"
    assert result["model"].startswith("FSDP") and result["params"] == ["DTensor"]  # sharded by fully_shard
    assert (result["wrapper"], result["optimizer"]) == ("AcceleratedOptimizer", "SMMF")
    assert result["scheduler"] == "LambdaLR"  # the Trainer's own (linear decay)
    assert "optimizer.bin" in result["checkpoint"]  # FSDP2's full optimizer state dict (the Trainer's default)
    assert result["losses"][-1] < result["losses"][0]
    _assert_resumes_exactly(result)


def test_hf_trainer_fsdp_config_on_cpu_trains_with_ddp(run) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    result = run("torchrun", "hf_trainer_fsdp2.py")
    assert result["distributed_type"] == "DistributedType.MULTI_CPU"  # the FSDP plugin left unused
    assert result["model"] == "DistributedDataParallel" and result["params"] == ["Parameter"]
    assert (result["wrapper"], result["optimizer"]) == ("AcceleratedOptimizer", "SMMF")
    _assert_resumes_exactly(result)
    sharded = run("torchrun", "hf_trainer_fsdp2.py", "--fsdp-on-cpu")
    for p, q in zip(result["straight"], sharded["straight"]):  # the same training, summed in another order
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


# ---- Accelerate (FullyShardedDataParallelPlugin(fsdp_version=2), save_state / load_state) ----

def test_accelerate_fsdp2_plugin_save_load_state_resumes_exactly(run) -> None:
    pytest.importorskip("accelerate")
    result = run("accelerate", "accelerate_fsdp2.py", "--fsdp-on-cpu")
    assert result["distributed_type"] == "DistributedType.FSDP"
    assert result["model"] == "FSDPNet" and result["params"] == ["DTensor"]
    assert (result["wrapper"], result["optimizer"]) == ("AcceleratedOptimizer", "SMMF")
    assert {"optimizer_0", "pytorch_model_fsdp_0", "scheduler.bin"} <= set(result["checkpoint"])  # DCP folders
    # The wrapped scheduler steps once per process for each step (Accelerate's default): 12 steps after 6.
    assert result["lr"] == pytest.approx(1e-2 / (1 + 0.1 * 2 * 6))
    _assert_resumes_exactly(result)


def test_accelerate_fsdp2_plugin_on_cpu_trains_with_ddp(run) -> None:
    pytest.importorskip("accelerate")
    result = run("accelerate", "accelerate_fsdp2.py")
    assert result["distributed_type"] == "DistributedType.MULTI_CPU"  # the plugin left unused
    assert result["model"] == "DistributedDataParallel" and result["params"] == ["Parameter"]
    assert (result["wrapper"], result["optimizer"]) == ("AcceleratedOptimizer", "SMMF")
    assert "optimizer.bin" in result["checkpoint"]
    _assert_resumes_exactly(result)
    sharded = run("accelerate", "accelerate_fsdp2.py", "--fsdp-on-cpu")
    for p, q in zip(result["straight"], sharded["straight"]):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


# ---- Lightning (ModelParallelStrategy with fully_shard in configure_model; FSDPStrategy refused) ----

def test_lightning_model_parallel_fsdp2_resumes_exactly(run) -> None:
    pytest.importorskip("lightning")
    import torch.distributed.checkpoint as dcp

    result = run("torchrun", "lightning_fsdp2.py")
    assert result["optimizer"] == "SMMF" and result["params"] == ["DTensor"]
    _assert_resumes_exactly(result)
    # The checkpoint is a DCP folder holding SMMF's state (its sign bits among it).
    keys = dcp.FileSystemReader(str(result["out"] / "step3.ckpt")).read_metadata().state_dict_metadata
    assert any(key.startswith("optimizer_0.state.") and key.endswith(".sign_m") for key in keys)


def test_lightning_fsdp1_strategy_is_refused(run) -> None:
    pytest.importorskip("lightning")
    result = run("torchrun", "lightning_fsdp2.py")  # the same launch: the example tries FSDPStrategy last
    assert result["fsdp1_error"] is not None
    assert "flattened by FSDP1" in result["fsdp1_error"] and "fully_shard" in result["fsdp1_error"]


# ---- DeepSpeed ZeRO (SMMF maps ZeRO's flat partitions back to the model's tensors) ----

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


@needs_deepspeed
@pytest.mark.parametrize("stage", ["2", "3"])
def test_hf_trainer_deepspeed_resumes_exactly(run, stage: str) -> None:
    pytest.importorskip("transformers")
    result = run("torchrun", "hf_trainer_deepspeed.py", "--stage", stage)
    assert result["distributed_type"] == "DistributedType.DEEPSPEED" and result["model"] == "DeepSpeedEngine"
    assert (result["wrapper"], result["optimizer"]) == ("DeepSpeedOptimizerWrapper", "SMMF")
    assert len(result["pieces"]) > 1  # rank 0's pieces of the model's tensors, each with its own factors
    assert f"global_step{3}" in result["checkpoint"] and result["losses"][-1] < result["losses"][0]
    _assert_resumes_exactly(result)


@needs_deepspeed
def test_accelerate_deepspeed_plugin_save_load_state_resumes_exactly(run) -> None:
    pytest.importorskip("accelerate")
    result = run("accelerate-deepspeed", "accelerate_deepspeed.py", "--stage", "1")
    assert result["distributed_type"] == "DistributedType.DEEPSPEED" and result["model"] == "DeepSpeedEngine"
    assert (result["wrapper"], result["optimizer"]) == ("DeepSpeedOptimizerWrapper", "SMMF")
    assert result["pieces"] == {0: (12,)}  # fc1.weight (10 × 12: V 12 × 10); ZeRO put the rest on rank 1
    assert "pytorch_model" in result["checkpoint"]
    _assert_resumes_exactly(result)


@needs_deepspeed
def test_the_deepspeed_example_resumes_exactly(run) -> None:
    """examples/deepspeed_zero.py, as docs/distributed.md shows it: ZeRO-3, each piece with its whole tensor's
    factors."""
    result = run("torchrun", "deepspeed_zero.py", "--stage", "3")
    assert result["factors"] == {0: ((128,), (64,)), 1: ((16,), (8,)), 2: ((40,), (32,)), 3: ((5,), (2,))}
    _assert_resumes_exactly(result)


@needs_deepspeed
def test_the_zero_checkpoint_of_the_deepspeed_example_continues_in_one_process_and_at_three_ranks(run, tmp_path) -> None:
    """examples/zero_to_anywhere.py, as docs/distributed.md shows it: the ZeRO-3 checkpoint examples/deepspeed_zero.py
    saved at 2 ranks, continued in one process and under ZeRO-2 at 3 ranks, each equal to the 2-rank run's own
    continuation up to the order of its sums."""
    saved = run("torchrun", "deepspeed_zero.py", "--stage", "3")
    script = str(ROOT / "examples" / "zero_to_anywhere.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
                "--master-port", port]
    for name, cmd in (("one", [sys.executable, script]), ("zero", [*torchrun, script, "--zero", "2"])):
        with deepspeed_shm_removed(port):
            done = subprocess.run([*cmd, str(saved["out"]), "--params", str(tmp_path / f"{name}.pt")], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        continued = torch.load(tmp_path / f"{name}.pt")
        assert len(continued) == len(saved["straight"]) == 4
        for got, straight in zip(continued, saved["straight"]):
            assert (got - straight).abs().max() <= 1e-6 * straight.abs().max(), name
