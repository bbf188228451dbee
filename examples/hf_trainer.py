"""Hugging Face Trainer with SMMF, a checkpoint and an exact resume: python examples/hf_trainer.py"""

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from smmf.integrations.hf import smmf_optimizer_cls_and_kwargs

starts = torch.randint(0, 64, (64, 1), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in (starts + torch.arange(32)) % 64]
out = tempfile.mkdtemp()


def run(resume=None) -> float:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=out, max_steps=20, save_steps=10, per_device_train_batch_size=8,
                             learning_rate=1e-3, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=smmf_optimizer_cls_and_kwargs(args, decay_rate=-0.8))
    trainer.train(resume_from_checkpoint=resume)
    return sum(p.double().sum().item() for p in model.parameters())


straight = run()
resumed = run(resume=f"{out}/checkpoint-10")
print(f"parameter checksum: uninterrupted {straight:.10f}, resumed {resumed:.10f}")
