"""SMMF under DeepSpeed ZeRO: build it with the model's parameters, hand it to ``deepspeed.initialize``, train.

    deepspeed --num_gpus 2 examples/deepspeed_zero.py [--stage 3] [--out DIR] [--params PATH]
    torchrun --nproc-per-node 2 examples/deepspeed_zero.py          # the same, CPU or GPU

ZeRO hands its client optimizer flat partitions of the model's parameters; SMMF maps each one back to the pieces of
the tensors it holds and steps each tensor with its own factorization, as on one device, the factor sums of a tensor
cut between ranks added up across them (docs/distributed.md). Nothing more is written for it: the same lines run
under the Hugging Face Trainer and Accelerate (examples/hf_trainer_deepspeed.py, examples/accelerate_deepspeed.py).
Without a GPU DeepSpeed runs on the CPU (``DS_ACCELERATOR=cpu``, set here when CUDA is missing) over gloo.
``--params PATH``: rank 0 writes the full parameters of a straight run and of one resumed from step 3.
"""

import argparse
import os
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

import smmf

STEPS, SAVE_AT, MICRO = 6, 3, 4


def engine_for(stage: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    optimizer = smmf.SMMF(model.parameters(), **smmf.RECOMMENDED)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": torch.cuda.is_available()}}  # DeepSpeed's fp32 masters under bf16 weights
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, optimizer


def train(engine, steps: range) -> None:
    rank = dist.get_rank()
    dtype = next(engine.module.parameters()).dtype
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(MICRO, 64, generator=gen), torch.randint(0, 10, (MICRO,), generator=gen)
        loss = torch.nn.functional.cross_entropy(engine(x.to(engine.device, dtype)).float(), y.to(engine.device))
        engine.backward(loss)
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "smmf-deepspeed-example"))
    parser.add_argument("--params")
    parser.add_argument("--local_rank", type=int)  # what the deepspeed launcher passes
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")

    engine, optimizer = engine_for(args.stage)
    train(engine, range(STEPS))
    straight = [safe_get_full_fp32_param(p).detach().cpu().clone() for p in engine.module.parameters()]
    # Each of this rank's pieces of the model's tensors keeps the factors of its whole tensor.
    factors = {ordinal: (tuple(state["row_v"].shape), tuple(state["col_v"].shape))
               for held in optimizer.state.values() for ordinal, state in held["pieces"].items()}

    engine, _ = engine_for(args.stage)
    train(engine, range(SAVE_AT))
    engine.save_checkpoint(args.out, tag="step3")
    engine, _ = engine_for(args.stage)
    engine.load_checkpoint(args.out, tag="step3")
    train(engine, range(SAVE_AT, STEPS))
    resumed = [safe_get_full_fp32_param(p).detach().cpu().clone() for p in engine.module.parameters()]
    if dist.get_rank() == 0:
        same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
        print(f"ZeRO-{args.stage}: rank 0's pieces and their tensors' factors {factors}; resumed from step "
              f"{SAVE_AT} equals the uninterrupted run bit for bit: {same}")
        if args.params:
            torch.save({"straight": straight, "resumed": resumed, "factors": factors,
                        "resumed_steps": STEPS - SAVE_AT}, args.params)
    # Leave together, then skip the interpreter's teardown: objects still holding gloo work can abort
    # the process at exit (pytorch/pytorch#179291).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
