"""Built-in comparison tasks on real data that ships with the dependencies (no downloads).

- ``digits-cnn``: a small CNN (4-D conv weights, BatchNorm, linear head) on scikit-learn's
  ``load_digits`` 8×8 images; metric: test accuracy (%).
- ``pydoc-lm``: a byte-level causal Transformer (GPT-2 architecture from a config) on CPython's
  ``pydoc_data.topics`` text, 300 steps; metric: held-out loss (and perplexity).

Opt-in (``--tasks``), longer:

- ``stdlib-lm``: a 6-layer, 256-wide byte-level GPT-2 (4.9M parameters, context 256) trained from
  scratch on the ``.py`` files of the running interpreter's standard library, split by file (held-out
  files are never seen in training); metric: held-out loss.
- ``finetune-lm``: that model pretrained once with AdamW on ``stdlib-lm``'s training files (cached on
  disk, keyed by a hash of everything that determines it), then fine-tuned from the same checkpoint
  with every optimizer on ``pydoc_data.topics``; metric: held-out loss.

Splits are fixed (independent of the seed); the seed sets the initialization and batch order,
which are the same for every optimizer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

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
    prepare: Optional[Callable[[bool], None]] = None  # one-time work before the runs (argument: show progress)


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


# 300 steps keep the default run (six optimizers on both quick tasks) under 10 minutes on 2 cores;
# the comparison's figures before this change were taken at 400 (``--steps 400``).
PYDOC_LM_STEPS = 300

# GPT-2's own GELU (tanh approximation) as torch's one fused op instead of transformers' "gelu_new",
# the same formula written as five elementwise ops: the same model, a tenth less time per CPU step.
FUSED_GELU = "gelu_pytorch_tanh"


def _lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    logits = model(input_ids=x).logits.float()  # a bf16 model's too, as transformers' own loss does
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


# --------------------------------------------------------------------------- byte-level GPT on larger text


@dataclass(frozen=True)
class ByteGPT:
    """A byte-level GPT-2 (vocabulary of 256 bytes, no dropout) and the shape of its batches."""

    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 8
    context: int = 256
    batch: int = 16
    activation: str = FUSED_GELU

    def build(self, seed: int) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(seed)
        config = GPT2Config(
            vocab_size=256, n_positions=self.context, n_embd=self.n_embd, n_layer=self.n_layer, n_head=self.n_head,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            activation_function=self.activation,
        )
        return GPT2LMHeadModel(config)


# pydoc-lm's model: 4 layers, 128 wide, 4 heads, context 128, batches of 32.
PYDOC_GPT = ByteGPT(n_layer=4, n_embd=128, n_head=4, context=_LM_CONTEXT, batch=32)


def _window_batches(stream: Tensor, context: int, batch_size: int, seed: int,
                    device: torch.device) -> Iterator[Batch]:
    """Random windows of ``context + 1`` bytes of ``stream`` (inputs, next-byte targets), in ``seed``'s order."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1)
    while True:
        starts = torch.randint(0, len(stream) - context - 1, (batch_size,), generator=gen)
        window = stream[starts[:, None] + offsets].long()
        yield window[:, :-1].to(device), window[:, 1:].to(device)


_EVAL_BATCH = 64


@torch.no_grad()
def _held_out_loss(model: nn.Module, stream: Tensor, context: int, windows: int, device: torch.device,
                   batch_size: int = _EVAL_BATCH) -> dict[str, float]:
    """Mean next-byte loss over ``windows`` evenly spaced windows of ``stream``; at most as many as fit
    without overlapping."""
    windows = max(1, min(windows, (len(stream) - 1) // context))
    stride = (len(stream) - context - 1) // max(1, windows - 1)  # the last window ends at the stream's end
    window = stream[(torch.arange(windows) * stride)[:, None] + torch.arange(context + 1)].long()
    was_training = model.training
    model.eval()
    total = 0.0
    for part in window.split(batch_size):
        total += _lm_loss(model, (part[:, :-1].to(device), part[:, 1:].to(device))).item() * len(part)
    model.train(was_training)
    loss = total / windows
    return {"held_out_loss": loss, "perplexity": math.exp(loss)}


# --------------------------------------------------------------------------- stdlib-lm

_STDLIB_HELD_OUT_EVERY = 20  # a file is held out when its path's hash is 0 modulo this: about 5% of the files
_STDLIB_EVAL_WINDOWS = 128
_FILE_SEPARATOR = b"\0"
# Left out of the corpus: installed packages, and pydoc_data (finetune-lm's fine-tuning text)
_STDLIB_EXCLUDED = {"site-packages", "dist-packages", "__pycache__", "pydoc_data"}


def stdlib_files(root: Optional[Path] = None) -> list[str]:
    """The ``.py`` files of the standard library at ``root`` (default: this interpreter's), as sorted
    relative POSIX paths."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = (path.relative_to(root) for path in root.rglob("*.py") if path.is_file())
    return sorted(rel.as_posix() for rel in found if not _STDLIB_EXCLUDED & set(rel.parts))


def is_held_out(relative_path: str) -> bool:
    """Whether a file is in the held-out split: decided by a hash of its path alone, so a file's side
    does not change when others are added or removed."""
    return hashlib.sha256(relative_path.encode()).digest()[0] % _STDLIB_HELD_OUT_EVERY == 0


@functools.lru_cache(maxsize=4)
def stdlib_bytes(root: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """(train, held-out) uint8 byte streams of the standard library's ``.py`` files, in sorted order,
    each file followed by a NUL byte."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    return split_files(base, stdlib_files(base))


def split_files(root: Path, files: list[str]) -> tuple[Tensor, Tensor]:
    """(train, held-out) uint8 byte streams of ``files`` (paths relative to ``root``) in their order, each
    followed by a NUL byte, split by :func:`is_held_out`."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for rel in files:
        parts[is_held_out(rel)].append((root / rel).read_bytes() + _FILE_SEPARATOR)
    train, held_out = (torch.frombuffer(bytearray(b"".join(parts[side])), dtype=torch.uint8) for side in (False, True))
    return train, held_out


STDLIB_GPT = ByteGPT()


def stdlib_lm_task(model: ByteGPT = STDLIB_GPT, default_steps: int = 2000) -> Task:
    return from_scratch_lm_task("stdlib-lm", model, stdlib_bytes, default_steps)


def stdlib_lm_small_task(default_steps: int = 400) -> Task:
    """``pydoc-lm``'s model (4 layers, 128 wide, context 128, batches of 32) trained from scratch on ``stdlib-lm``'s
    corpus and file split: the studies' held-out task, a few minutes a run."""
    return from_scratch_lm_task("stdlib-lm-small", PYDOC_GPT, stdlib_bytes, default_steps)


def from_scratch_lm_task(name: str, model: ByteGPT, streams: Callable[[], tuple[Tensor, Tensor]],
                         default_steps: int, windows: int = _STDLIB_EVAL_WINDOWS) -> Task:
    """``model`` trained from scratch on ``streams()[0]`` (random windows), its held-out loss measured on
    ``windows`` windows of ``streams()[1]``."""
    def evaluate(net: nn.Module, device: torch.device) -> dict[str, float]:
        return _held_out_loss(net, streams()[1], model.context, windows, device)

    return Task(
        name, "transformer", "held_out_loss", False, default_steps, model.build,
        lambda seed, device: _window_batches(streams()[0], model.context, model.batch, seed, device),
        _lm_loss, evaluate,
    )


# --------------------------------------------------------------------------- finetune-lm

# How the checkpoint that every optimizer fine-tunes is made: stdlib-lm's training files, AdamW, the
# comparison's warmup + cosine schedule. Every entry goes into the checkpoint's cache key; bump
# "recipe" when the code that pretrains changes. On a CPU it always runs on ``cpu_threads`` threads,
# whatever the caller's setting: the thread count changes how torch's CPU kernels split their sums, so
# one step on 1 thread and on 2 already gives other weights, and 2000 steps another checkpoint (seed 0's
# first fine-tuning loss 1.7508 against 1.7478).
PRETRAIN: dict[str, Any] = dict(recipe=1, optimizer="AdamW", lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=1e-2,
                                 schedule="warmup-cosine", seed=0, cpu_threads=2)
PRETRAIN_STEPS = 2000


def cache_root(cache: Optional[str] = None) -> Path:
    """Where pretrained checkpoints are kept: ``cache``, else ``$SMMF_CACHE``, else ``$XDG_CACHE_HOME/smmf``
    (``~/.cache/smmf``)."""
    if cache:
        return Path(cache).expanduser()
    if os.environ.get("SMMF_CACHE"):
        return Path(os.environ["SMMF_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smmf"


def pretrain_facts(model: ByteGPT, steps: int, device: torch.device) -> dict[str, object]:
    """Everything that determines the pretrained checkpoint (its cache key is their hash)."""
    import transformers

    train, _ = stdlib_bytes()
    return {"model": asdict(model), "steps": steps, **PRETRAIN,
            "data": hashlib.sha256(train.numpy().tobytes()).hexdigest(), "device": device.type,
            "torch": str(torch.__version__), "transformers": str(transformers.__version__)}


def pretrained_path(model: ByteGPT, steps: int, device: torch.device, cache: Optional[str] = None) -> Path:
    facts = pretrain_facts(model, steps, device)
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root(cache) / "pretrain" / f"stdlib-lm-{key}.pt"


def pretrain(model: ByteGPT, steps: int, device: torch.device, show_progress: bool = True) -> dict[str, Tensor]:
    """Train ``model`` from scratch on stdlib-lm's training files with AdamW (see ``PRETRAIN``); its state dict."""
    caller_threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(int(PRETRAIN["cpu_threads"]))
    try:
        return _pretrain(model, steps, device, show_progress)
    finally:
        torch.set_num_threads(caller_threads)


def _pretrain(model: ByteGPT, steps: int, device: torch.device, show_progress: bool) -> dict[str, Tensor]:
    from .optimizers import warmup_cosine
    from .progress import progress

    net = model.build(int(PRETRAIN["seed"])).to(device)
    net.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=PRETRAIN["lr"], betas=tuple(PRETRAIN["betas"]),
                                  eps=PRETRAIN["eps"], weight_decay=PRETRAIN["weight_decay"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, min(100, max(1, steps // 10))))
    batches = _window_batches(stdlib_bytes()[0], model.context, model.batch, int(PRETRAIN["seed"]), device)
    for _ in progress(range(steps), "pretraining stdlib-lm with AdamW for finetune-lm", steps, show_progress):
        loss = _lm_loss(net, next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return {name: tensor.detach().cpu() for name, tensor in net.state_dict().items()}


def pretrained_checkpoint(model: ByteGPT, steps: int, device: torch.device, cache: Optional[str] = None,
                          show_progress: bool = True) -> Path:
    """The pretrained checkpoint's file: from the cache, or pretrained now (and cached) when missing."""
    path = pretrained_path(model, steps, device, cache)
    if path.exists():
        return path
    state = pretrain(model, steps, device, show_progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"facts": pretrain_facts(model, steps, device), "state_dict": state}, partial)
    os.replace(partial, path)  # atomic: a reader sees the whole file or none
    return path


_FINETUNE_EVAL_WINDOWS = 1 << 30  # all of pydoc's held-out text, in disjoint windows


def finetune_lm_task(model: ByteGPT = STDLIB_GPT, pretrain_steps: int = PRETRAIN_STEPS, cache: Optional[str] = None,
                     device: str = "cpu", default_steps: int = 300) -> Task:
    def prepare(show_progress: bool) -> None:
        pretrained_checkpoint(model, pretrain_steps, torch.device(device), cache, show_progress)

    def build(seed: int) -> nn.Module:
        path = pretrained_checkpoint(model, pretrain_steps, torch.device(device), cache, show_progress=False)
        net = model.build(seed)
        net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["state_dict"])
        return net

    def evaluate(net: nn.Module, on: torch.device) -> dict[str, float]:
        return _held_out_loss(net, pydoc_bytes()[1], model.context, _FINETUNE_EVAL_WINDOWS, on)

    return Task(
        "finetune-lm", "finetune", "held_out_loss", False, default_steps, build,
        lambda seed, device: _window_batches(pydoc_bytes()[0], model.context, model.batch, seed, device),
        _lm_loss, evaluate, prepare,
    )


TASKS: dict[str, Task] = {
    "digits-cnn": Task(
        "digits-cnn", "cnn", "test_accuracy", True, 300, _digits_model, _digits_batches, _classification_loss,
        _digits_evaluate,
    ),
    "pydoc-lm": Task(
        "pydoc-lm", "transformer", "held_out_loss", False, PYDOC_LM_STEPS, PYDOC_GPT.build,
        lambda seed, device: _window_batches(pydoc_bytes()[0], PYDOC_GPT.context, PYDOC_GPT.batch, seed, device),
        _lm_loss, _lm_evaluate,
    ),
}
DEFAULT_TASKS = tuple(TASKS)  # the default run; the longer tasks below are opt-in
TASKS["stdlib-lm"] = stdlib_lm_task()
TASKS["stdlib-lm-small"] = stdlib_lm_small_task()
TASKS["finetune-lm"] = finetune_lm_task()


def make_task(name: str, cache: Optional[str] = None, pretrain_steps: Optional[int] = None,
              device: str = "cpu") -> Task:
    """The task ``name``; ``finetune-lm`` with its checkpoint's cache, pretraining length and device."""
    if name == "finetune-lm":
        return finetune_lm_task(STDLIB_GPT, pretrain_steps or PRETRAIN_STEPS, cache, device)
    return TASKS[name]
