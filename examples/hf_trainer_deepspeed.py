"""Hugging Face ``Trainer`` with DeepSpeed ZeRO (``TrainingArguments(deepspeed=...)``) and SMMF (through
``optimizer_cls_and_kwargs``): a checkpoint at step 3 and a resume that equals the uninterrupted run.

    torchrun --nproc-per-node 2 examples/hf_trainer_deepspeed.py [--stage 2] [--out DIR] [--params PATH]

(``deepspeed --num_gpus 2`` and ``accelerate launch`` work the same.) The Trainer builds SMMF with the model's
parameters and its own parameter groups, then DeepSpeed's ZeRO optimizer hands SMMF flat partitions of them, which
SMMF maps back to the model's tensors (docs/distributed.md). Give SMMF this way, as a class: under DeepSpeed the
Trainer drops an optimizer instance given as ``optimizers=(SMMF(...), None)`` and trains with AdamW. Without a GPU DeepSpeed runs on the CPU
(``DS_ACCELERATOR=cpu``, set here when CUDA is missing) over gloo. ``--params PATH``: rank 0 writes the full
parameters of both runs there.
"""

import argparse
import os
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from smmf.integrations.hf import smmf_optimizer_cls_and_kwargs

STEPS, SAVE_AT = 6, 3


class CountSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.steps += 1


def dataset() -> list[dict[str, torch.Tensor]]:
    starts = torch.randint(0, 64, (32, 1), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in (starts + torch.arange(16)) % 64]  # counting sequences


def run(out: str, stage: int, resume: str | None = None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    # "auto" takes the Trainer's values (its max_grad_norm of 1.0 becomes DeepSpeed's gradient_clipping).
    deepspeed = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "zero_allow_untested_optimizer": True}
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, save_strategy="steps", save_steps=SAVE_AT, per_device_train_batch_size=4,
        learning_rate=1e-2, weight_decay=0.01, report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0,
        logging_steps=1, deepspeed=deepspeed,
    )
    count = CountSteps()
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[count],
                      optimizer_cls_and_kwargs=smmf_optimizer_cls_and_kwargs(args, decay_rate=-0.8))
    trainer.train(resume_from_checkpoint=resume)
    from deepspeed.utils import safe_get_full_fp32_param

    engine = trainer.model_wrapped
    params = [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()]
    smmf = engine.optimizer.optimizer  # the engine's ZeRO optimizer's client: SMMF
    pieces = {ordinal: tuple(state["row_v"].shape) for held in smmf.state.values()
              for ordinal, state in held["pieces"].items() if "row_v" in state}
    info = {"distributed_type": str(trainer.accelerator.distributed_type), "wrapper": type(trainer.optimizer).__name__,
            "optimizer": type(smmf).__name__, "model": type(engine).__name__, "stage": stage, "pieces": pieces,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "steps_run": count.steps}
    return params, info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "smmf-hf-trainer-deepspeed-example"))
    parser.add_argument("--params")
    args = parser.parse_args()

    straight, info = run(os.path.join(args.out, "straight"), args.stage)
    checkpoint = os.path.join(args.out, "straight", f"checkpoint-{SAVE_AT}")
    resumed, resumed_info = run(os.path.join(args.out, "resumed"), args.stage, resume=checkpoint)
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
