"""Hugging Face ``Trainer``: train with SMMF through ``optimizer_cls_and_kwargs``.

    from transformers import Trainer, TrainingArguments
    from smmf.integrations.hf import smmf_optimizer_cls_and_kwargs

    args = TrainingArguments(output_dir="out", learning_rate=1e-3, weight_decay=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=smmf_optimizer_cls_and_kwargs(args, decay_rate=-0.8))
    trainer.train()                                  # checkpoints hold SMMF's state
    trainer.train(resume_from_checkpoint=True)       # and resume exactly

The Trainer builds its own parameter groups (its ``weight_decay`` on weights, none on biases and
norms), so ``learning_rate`` and ``weight_decay`` come from the ``TrainingArguments``; every other
SMMF option goes in ``overrides``.
"""

from __future__ import annotations

from typing import Any

from ..optimizer import SMMF


def smmf_optimizer_cls_and_kwargs(args: Any, **overrides: Any) -> tuple[type[SMMF], dict[str, Any]]:
    """``(SMMF, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``, lr and decay from ``args``."""
    kwargs: dict[str, Any] = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
    kwargs.update(overrides)
    return SMMF, kwargs
