"""Parameter shape sets used by the benchmarks."""

from __future__ import annotations

import torch

Shape = tuple[int, ...]


def gpt2_like_shapes() -> list[Shape]:
    """The 52M-parameter GPT-2-like set: embedding, then 6 blocks of attention + MLP + norms."""
    block: list[Shape] = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (768,), (768,)]
    return [(12564, 768)] + block * 6


def gpt2_xl_like_shapes() -> list[Shape]:
    """A ~1.56B-parameter GPT-2-XL-like set: embedding 50257×1600, then 48 blocks."""
    block: list[Shape] = [(4800, 1600), (1600, 1600), (6400, 1600), (1600, 6400), (1600,), (1600,)]
    return [(50257, 1600)] + block * 48


def gpt2_xl_subset_shapes(blocks: int = 8) -> list[Shape]:
    """The 1.56B set's embedding and its first ``blocks`` blocks (326M params with 8): what fits beside
    every candidate's state on a 24 GB machine; the same shapes, so the same per-element cost."""
    return gpt2_xl_like_shapes()[: 1 + 6 * blocks]


def many_small_shapes(count: int = 256) -> list[Shape]:
    """``count`` 64×64 tensors: the step is all per-tensor overhead (ms / count = per tensor)."""
    return [(64, 64)] * count


def resnet50_shapes(num_labels: int = 1000) -> list[Shape]:
    """ResNet-50's trainable parameter shapes (the paper-table model, built on the meta device)."""
    from .models import resnet50

    return [tuple(p.shape) for p in resnet50(num_labels).parameters()]


def make_params(
    shapes: list[Shape], seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[torch.nn.Parameter]:
    """Real parameters with gradients set, for timing (drawn on ``device``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(0.02))
        p.grad = torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(1e-3)
        params.append(p)
    return params
