"""Hugging Face ``Trainer`` with FSDP2 and SMMF (through ``optimizer_cls_and_kwargs``): a checkpoint at step 3 and a
resume that equals the uninterrupted run.

    torchrun --nproc-per-node 2 examples/hf_trainer_fsdp2.py [--out DIR] [--params PATH] [--fsdp-on-cpu]

(``accelerate launch --multi_gpu --num_processes 2`` works the same.) On GPUs the Trainer shards the model with FSDP2.
On CPU (``use_cpu=True``, gloo) Accelerate does not select FSDP (it keeps ``MULTI_CPU``, the plugin unused) and the
Trainer trains with DDP instead; ``--fsdp-on-cpu`` sets Accelerate's state to FSDP after the Trainer made its
Accelerator, so that the Trainer's and Accelerate's FSDP2 code (sharding, the swap of the optimizer's parameters,
FSDP checkpoints) runs on CPU: a test device, not a supported configuration. ``--params PATH``: rank 0 writes the
full parameters of both runs there.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from smmf.integrations.hf import smmf_optimizer_cls_and_kwargs

STEPS, SAVE_AT = 6, 3


class FSDPOnCPUTrainer(Trainer):
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True


class CountSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.steps += 1


def dataset() -> list[dict[str, torch.Tensor]]:
    starts = torch.randint(0, 64, (32, 1), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in (starts + torch.arange(16)) % 64]  # counting sequences


def run(out: str, fsdp_on_cpu: bool, resume: str | None = None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, save_strategy="steps", save_steps=SAVE_AT, per_device_train_batch_size=4,
        learning_rate=1e-2, weight_decay=0.01, report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
        disable_tqdm=True, dataloader_num_workers=0, logging_steps=1,
        # FSDP2, full shard (the same as the older spelling fsdp="full_shard"), one unit per GPT-2 block
        fsdp=True, fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                "transformer_layer_cls_to_wrap": ["GPT2Block"]},
    )
    trainer_cls = FSDPOnCPUTrainer if fsdp_on_cpu else Trainer
    # The Trainer builds SMMF itself (its parameter groups: weight decay on weights only), then Accelerate wraps it.
    count = CountSteps()
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(), callbacks=[count],
                          optimizer_cls_and_kwargs=smmf_optimizer_cls_and_kwargs(args, decay_rate=-0.8))
    trainer.train(resume_from_checkpoint=resume)
    params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in trainer.model.parameters()]
    optimizer = trainer.optimizer
    info = {"distributed_type": str(trainer.accelerator.distributed_type), "wrapper": type(optimizer).__name__,
            "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            "scheduler": type(trainer.lr_scheduler).__name__, "model": type(trainer.model_wrapped).__name__,
            "params": sorted({type(p).__name__ for p in trainer.model.parameters()}),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "steps_run": count.steps}
    return params, info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "smmf-hf-trainer-fsdp2-example"))
    parser.add_argument("--params")
    parser.add_argument("--fsdp-on-cpu", action="store_true")
    args = parser.parse_args()

    straight, info = run(os.path.join(args.out, "straight"), args.fsdp_on_cpu)
    checkpoint = os.path.join(args.out, "straight", f"checkpoint-{SAVE_AT}")
    resumed, resumed_info = run(os.path.join(args.out, "resumed"), args.fsdp_on_cpu, resume=checkpoint)
    if dist.get_rank() == 0:
        same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
        print(f"{info}; resumed from step {SAVE_AT} equals the uninterrupted run bit for bit: {same}")
        if args.params:
            torch.save({"straight": straight, "resumed": resumed, "checkpoint": sorted(os.listdir(checkpoint)),
                        "resumed_steps": resumed_info["steps_run"], **info}, args.params)
    # Leave together, then skip the interpreter's teardown: objects still holding gloo work can abort
    # the process at exit (pytorch/pytorch#179291).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
