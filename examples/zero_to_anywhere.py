"""Continue an SMMF run saved under DeepSpeed ZeRO somewhere else: in one process, or under ZeRO at another number of
ranks or another stage.

    torchrun --nproc-per-node 2 examples/deepspeed_zero.py --out /tmp/zero-ckpt      # ZeRO-2, saved at step 3
    python examples/zero_to_anywhere.py /tmp/zero-ckpt                               # continued in one process
    torchrun --nproc-per-node 3 examples/zero_to_anywhere.py /tmp/zero-ckpt --zero 3  # or under ZeRO-3 at 3 ranks

The optimizer's state: ``smmf.zero.tensorwise_state`` joins the pieces the ranks saved into a plain
``SMMF.state_dict()`` (``smmf zero-to-plain DIR OUT.pt`` writes it from the command line), which a plain SMMF loads
with ``load_state_dict`` and an SMMF under ZeRO with ``smmf.zero.load_state``. The weights: DeepSpeed's
``zero_to_fp32``. Each step takes the batch the saving run's 2 ranks took together, so the continuation is that
run's (docs/distributed.md). ``--params PATH``: the full parameters after the last step (rank 0).
"""

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import smmf
import smmf.zero

STEPS, SAVE_AT, MICRO, SAVED_RANKS = 6, 3, 4, 2  # as examples/deepspeed_zero.py saved it


def model_from(checkpoint: str) -> torch.nn.Module:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag="step3"))
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The saving run's batch at ``step``: its ranks' micro-batches together."""
    parts = []
    for rank in range(SAVED_RANKS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        parts.append((torch.randn(MICRO, 64, generator=gen), torch.randint(0, 10, (MICRO,), generator=gen)))
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def in_one_process(checkpoint: str) -> list[torch.Tensor]:
    model = model_from(checkpoint)
    optimizer = smmf.SMMF(model.parameters(), **smmf.RECOMMENDED)
    optimizer.load_state_dict(smmf.zero.tensorwise_state(checkpoint, tag="step3"))
    for step in range(SAVE_AT, STEPS):
        optimizer.zero_grad()
        x, y = batch(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the saving run's gradient_clipping
        optimizer.step()
        print(f"step {step + 1}: loss {torch.nn.functional.cross_entropy(model(x), y).item():.4f}")
    return [p.detach().clone() for p in model.parameters()]


def under_zero(checkpoint: str, stage: int) -> list[torch.Tensor]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = torch.distributed.get_world_size()
    model = model_from(checkpoint)  # ZeRO's fp32 masters are made from the model's weights
    optimizer = smmf.SMMF(model.parameters(), **smmf.RECOMMENDED)
    config = {"train_micro_batch_size_per_gpu": MICRO * SAVED_RANKS, "gradient_clipping": 1.0,
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    smmf.zero.load_state(engine, smmf.zero.tensorwise_state(checkpoint, tag="step3"))  # each rank cuts its pieces
    for step in range(SAVE_AT, STEPS):
        x, y = batch(step)  # the whole batch on every rank: the ranks' mean is its gradient
        engine.backward(torch.nn.functional.cross_entropy(engine(x.to(engine.device)), y.to(engine.device)))
        engine.step()
    print(f"rank {torch.distributed.get_rank()} of {world}: continued under ZeRO-{stage}")
    return [safe_get_full_fp32_param(p).detach().cpu().clone() for p in engine.module.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", help="the folder examples/deepspeed_zero.py saved (--out)")
    parser.add_argument("--zero", type=int, choices=[1, 2, 3], help="continue under this ZeRO stage (under torchrun)")
    parser.add_argument("--params")
    parser.add_argument("--local_rank", type=int)  # what the deepspeed launcher passes
    args = parser.parse_args()
    params = under_zero(args.checkpoint, args.zero) if args.zero else in_one_process(args.checkpoint)
    distributed = torch.distributed.is_initialized()
    if args.params and (not distributed or torch.distributed.get_rank() == 0):
        torch.save(params, args.params)
    if distributed:  # leave together, then skip the teardown (examples/deepspeed_zero.py says why)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
