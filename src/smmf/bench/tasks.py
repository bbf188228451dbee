"""Built-in comparison tasks on real data that ships with the dependencies (no downloads).

- ``digits-cnn``: a small CNN (4-D conv weights, BatchNorm, linear head) on scikit-learn's
  ``load_digits`` 8×8 images; metric: test accuracy (%).
- ``pydoc-lm``: a byte-level causal Transformer (GPT-2 architecture from a config) on CPython's
  ``pydoc_data.topics`` text; metric: held-out loss (and perplexity).

Splits are fixed (independent of the seed); the seed sets the initialization and batch order,
which are the same for every optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "cnn" or "transformer": which of the paper's configuration tables applies
    metric: str
    higher_is_better: bool
    default_steps: int
    build_model: Callable[[int], nn.Module]
    batches: Callable[[int, torch.device], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch], Tensor]
    evaluate: Callable[[nn.Module, torch.device], dict[str, float]]


# --------------------------------------------------------------------------- digits-cnn

_DIGITS_TEST_FRACTION = 0.2


def digits_split() -> tuple[Batch, Batch]:
    """(train, test) of ``load_digits`` as (N, 1, 8, 8) float images in [0, 1] and labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(20250101))
    n_test = int(len(labels) * _DIGITS_TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return (images[train], labels[train]), (images[test], labels[test])


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.features = nn.Sequential(
            *block(1, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 128), nn.MaxPool2d(2), *block(128, 256),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(256, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def _digits_batches(seed: int, device: torch.device, batch_size: int = 64) -> Iterator[Batch]:
    (x, y), _ = digits_split()
    gen = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            if len(idx) == batch_size:
                yield x[idx].to(device), y[idx].to(device)


def _classification_loss(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


@torch.no_grad()
def _digits_evaluate(model: nn.Module, device: torch.device) -> dict[str, float]:
    _, (x, y) = digits_split()
    was_training = model.training
    model.eval()
    accuracy = (model(x.to(device)).argmax(dim=1).cpu() == y).float().mean().item() * 100.0
    model.train(was_training)
    return {"test_accuracy": accuracy}


def _digits_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return DigitsCNN()


# --------------------------------------------------------------------------- pydoc-lm

_LM_CONTEXT = 128
_LM_HELD_OUT_FRACTION = 0.1
_LM_EVAL_WINDOWS = 96


def pydoc_bytes() -> tuple[Tensor, Tensor]:
    """(train, held-out) byte streams of CPython's pydoc topics, topics in sorted order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * (1 - _LM_HELD_OUT_FRACTION))
    return data[:split], data[split:]


def _lm_model(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256, n_positions=_LM_CONTEXT, n_embd=128, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _lm_batches(seed: int, device: torch.device, batch_size: int = 32) -> Iterator[Batch]:
    train, _ = pydoc_bytes()
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(_LM_CONTEXT + 1)
    while True:
        starts = torch.randint(0, len(train) - _LM_CONTEXT - 1, (batch_size,), generator=gen)
        window = train[starts[:, None] + offsets]
        yield window[:, :-1].to(device), window[:, 1:].to(device)


def _lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    logits = model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def _lm_evaluate(model: nn.Module, device: torch.device) -> dict[str, float]:
    _, held_out = pydoc_bytes()
    stride = (len(held_out) - _LM_CONTEXT - 1) // _LM_EVAL_WINDOWS
    starts = torch.arange(_LM_EVAL_WINDOWS) * stride
    window = held_out[starts[:, None] + torch.arange(_LM_CONTEXT + 1)]
    losses = [_lm_loss(model, (w[:, :-1].to(device), w[:, 1:].to(device))).item() for w in window.split(32)]
    loss = sum(losses) / len(losses)
    return {"held_out_loss": loss, "perplexity": math.exp(loss)}


TASKS: dict[str, Task] = {
    "digits-cnn": Task(
        "digits-cnn", "cnn", "test_accuracy", True, 300, _digits_model, _digits_batches, _classification_loss,
        _digits_evaluate,
    ),
    "pydoc-lm": Task(
        "pydoc-lm", "transformer", "held_out_loss", False, 400, _lm_model, _lm_batches, _lm_loss, _lm_evaluate,
    ),
}
