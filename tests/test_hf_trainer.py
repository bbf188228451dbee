"""Hugging Face Trainer: SMMF trains, checkpoints and resumes exactly (tiny GPT-2 from a config)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from smmf import SMMF  # noqa: E402
from smmf.integrations.hf import smmf_optimizer_cls_and_kwargs  # noqa: E402


def _dataset() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 64, (32, 1), generator=gen)
    ids = (starts + torch.arange(16)) % 64  # counting sequences: learnable in a few steps
    return [{"input_ids": row, "labels": row} for row in ids]


def _train(out: str, resume: str | None = None) -> tuple[list[torch.Tensor], transformers.Trainer]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(
        output_dir=out, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, weight_decay=0.01,
        save_strategy="steps", save_steps=3, report_to=[], use_cpu=True, seed=0, logging_steps=1,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(),
                      optimizer_cls_and_kwargs=smmf_optimizer_cls_and_kwargs(args, decay_rate=-0.8))
    trainer.train(resume_from_checkpoint=resume)
    return [p.detach().clone() for p in model.parameters()], trainer


def test_trainer_trains_with_smmf_and_resumes_exactly(tmp_path) -> None:
    straight, trainer = _train(str(tmp_path / "a"))
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    assert isinstance(optimizer, SMMF)
    assert optimizer.param_groups[0]["decay_rate"] == -0.8
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    resumed, _ = _train(str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-3"))
    for p, q in zip(straight, resumed):
        assert torch.equal(p, q)
