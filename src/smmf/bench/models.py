"""The paper's models, built from configs on the meta device (no download, no parameter memory).

Where the paper does not name the exact variant, the one whose parameter count matches the paper's
Adam figure (8 bytes per trainable parameter) is taken; ``variant`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    variant: str
    build: Callable[[], nn.Module]


def _meta(factory: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return factory()


def mobilenet_v2(num_labels: int) -> nn.Module:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    labels: dict[str, Any] = {"num_labels": num_labels}  # a keyword of every config, which their stubs leave out
    return _meta(lambda: MobileNetV2ForImageClassification(MobileNetV2Config(**labels)))


def resnet50(num_labels: int) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    labels: dict[str, Any] = {"num_labels": num_labels}
    config = ResNetConfig(depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck", **labels)
    return _meta(lambda: ResNetForImageClassification(config))


class Seq2SeqTransformer(nn.Module):
    """``torch.nn.Transformer`` with source, target and output embeddings of a WMT32k vocabulary."""

    def __init__(self, d_model: int, heads: int, ff: int, vocab: int = 32768, layers: int = 6, tied: bool = False):
        super().__init__()
        self.src_embed = nn.Embedding(vocab, d_model)
        self.tgt_embed = self.src_embed if tied else nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ff, batch_first=True)
        self.generator = nn.Linear(d_model, vocab, bias=False)
        if tied:
            self.generator.weight = self.src_embed.weight


def transformer_wmt(big: bool) -> nn.Module:
    d_model, heads, ff = (1024, 16, 4096) if big else (512, 8, 2048)
    return _meta(lambda: Seq2SeqTransformer(d_model, heads, ff))


def bert(large: bool, qa: bool) -> nn.Module:
    from transformers import BertConfig, BertForPreTraining, BertForQuestionAnswering

    size: dict[str, Any] = (dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
                            if large else {})
    config = BertConfig(vocab_size=30522, **size)
    return _meta(lambda: (BertForQuestionAnswering if qa else BertForPreTraining)(config))


def gpt2(medium: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    size: dict[str, Any] = dict(n_embd=1024, n_layer=24, n_head=16) if medium else {}
    return _meta(lambda: GPT2LMHeadModel(GPT2Config(vocab_size=50257, **size)))


def t5(base: bool) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    size: dict[str, Any] = (dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12) if base
                            else dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8))
    return _meta(lambda: T5ForConditionalGeneration(T5Config(vocab_size=32128, **size)))


def roberta_base() -> nn.Module:
    from transformers import RobertaConfig, RobertaForQuestionAnswering

    config = RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1)
    return _meta(lambda: RobertaForQuestionAnswering(config))


def albert_base_v2() -> nn.Module:
    from transformers import AlbertConfig, AlbertForQuestionAnswering

    config = AlbertConfig(
        vocab_size=30000, embedding_size=128, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    )
    return _meta(lambda: AlbertForQuestionAnswering(config))


def llama7b_lora(rank: int = 8) -> nn.Module:
    """LLaMA-7B with LoRA on every linear layer but the head; only the adapters are trainable."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000)
    return _meta(lambda: get_peft_model(LlamaForCausalLM(config), LoraConfig(r=rank, target_modules="all-linear")))


def marian_en_ro() -> nn.Module:
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(vocab_size=59543, decoder_vocab_size=59543, d_model=512, encoder_layers=6, decoder_layers=6,
                          encoder_ffn_dim=2048, decoder_ffn_dim=2048, encoder_attention_heads=8, decoder_attention_heads=8)
    return _meta(lambda: MarianMTModel(config))


def bart_base() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_ffn_dim=3072,
                        decoder_ffn_dim=3072, encoder_attention_heads=12, decoder_attention_heads=12)
    return _meta(lambda: BartForConditionalGeneration(config))


def mbart_large() -> nn.Module:
    from transformers import MBartConfig, MBartForConditionalGeneration

    return _meta(lambda: MBartForConditionalGeneration(MBartConfig(vocab_size=250027)))


def from_config_file(path: str) -> nn.Module:
    """Any ``transformers`` config file (JSON), built with its base ``AutoModel`` class."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(path)
    return _meta(lambda: AutoModel.from_config(config))
