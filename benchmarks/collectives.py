"""What one FSDP2 training step costs in collectives and bytes per rank, AdamW against SMMF, worked
out from a model's shapes (nothing is run; the model is built on the meta device).

The setting: ``fully_shard`` on each decoder layer and on the root, bf16 parameters for compute and
fp32 gradient reduction (``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``),
``reshard_after_forward=True`` (layers gather their parameters again in backward). FSDP2's own
collectives are the same for both optimizers; AdamW's step adds none (it is elementwise on the
shards). SMMF's step adds the all-reduce of each sharded parameter's partial row and column sums
(one per parameter today, two with the magnitude flag), fp32. Bytes are what one rank sends, with
ring algorithms: all-gather and reduce-scatter (N−1)/N·S, all-reduce 2(N−1)/N·S, for a payload of
S bytes. State per rank: AdamW 8 B per parameter / N; SMMF the sign bits of its own elements
(1 bit per parameter / N, 2 with the flag) plus the factor vectors, which every rank keeps whole.

    python benchmarks/collectives.py [--ranks 8,64,1024]
"""

from __future__ import annotations

import argparse

import torch

from smmf.state import matrix_shape, momentum_matrix_shape

GROUP = {"beta": 0.9, "vector_reshape": True, "momentum_shape": "square", "magnitude_bits": 0}


def llama_7b() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         vocab_size=32000)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,1024")
    args = parser.parse_args()
    model = llama_7b()
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    layers = model.config.num_hidden_layers
    factors = 0  # fp32 elements of the factor vectors of V and M, all params
    for p in params:
        rows, cols = matrix_shape(p)
        m_rows, m_cols = momentum_matrix_shape(p, GROUP)
        factors += rows + cols + m_rows + m_cols
    print(f"LLaMA-7B shapes: {total / 1e9:.2f}B parameters in {len(params)} tensors; FSDP2 units: {layers} layers + root")
    print(f"SMMF factor vectors, all tensors: {factors:,} fp32 ({mib(4 * factors)} MiB), kept whole on every rank\n")
    print("| ranks | | collectives per step | bytes each rank sends per step, MiB | optimizer state per rank, MiB |")
    print("|---|---|---|---|---|")
    for n in [int(r) for r in args.ranks.split(",")]:
        ring = (n - 1) / n
        gathers = (layers + 1) + layers  # forward, and backward again for the layers
        fsdp_bytes = ring * 2 * total * 2 + ring * 4 * total  # two bf16 all-gathers of everything, one fp32 reduce-scatter
        fsdp_count = gathers + layers + 1
        sums_bytes = 2 * ring * 4 * factors  # the all-reduce of every tensor's partial row and column sums
        adam_state = 8 * total / n
        smmf_state = total / 8 / n + 4 * factors
        print(f"| {n} | FSDP2 itself (both optimizers) | {fsdp_count} | {mib(fsdp_bytes)} | |")
        print(f"| | + AdamW's step | +0 | +0 | {mib(adam_state)} |")
        print(f"| | + SMMF's step, one all-reduce per tensor (the sharded torch path) | +{len(params)} | +{mib(sums_bytes)} | "
              f"{mib(smmf_state)} |")
        print(f"| | + SMMF's step, coalesced into one all-reduce (the fused kernels) | +1 | +{mib(sums_bytes)} | {mib(smmf_state)} |")
        flag_bytes, flag_state = sums_bytes + 2 * ring * 16 * len(params), smmf_state + total / 8 / n + 8 * len(params)
        print(f"| | + SMMF with the magnitude flag, two all-reduces per tensor (the sharded torch path) | +{2 * len(params)} | "
              f"+{mib(flag_bytes)} | {mib(flag_state)} |")
        print(f"| | + SMMF with the magnitude flag, coalesced (the fused kernels) | +2 | +{mib(flag_bytes)} | {mib(flag_state)} |")


if __name__ == "__main__":
    main()
