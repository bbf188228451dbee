"""``smmf memory``: the paper's optimizer-memory tables, reproduced from model shapes.

Each row gives our figure as the CUDA caching allocator would hold it (every state tensor rounded
up to 512 B, as the paper measured), the exact bytes, the paper's figure and the difference. With
``--measure cuda`` the Adam and SMMF rows also get the state measured on the GPU: the model is built
there from its config (random weights), and the growth of ``torch.cuda.memory_allocated()`` over one
step is recorded.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..memory import CUDA_ALLOCATOR_BLOCK, OPTIMIZERS, predict_state_bytes
from . import models
from .args import OneLineParser, fail
from .models import ModelSpec
from .progress import progress
from ..table import format_table

ALL = OPTIMIZERS  # adam, adafactor, sm3, came, smmf


@dataclass(frozen=True)
class PaperRow:
    spec: ModelSpec
    paper: dict[str, float]  # optimizer -> figure in the table's unit


@dataclass(frozen=True)
class PaperTable:
    title: str
    unit: str  # "MiB" or "GiB"
    rows: list[PaperRow]
    missing: list[str] = field(default_factory=list)  # rows we cannot build, with the reason


def _row(name: str, variant: str, build: Callable[[], nn.Module], *figures: float, optimizers=ALL) -> PaperRow:
    return PaperRow(ModelSpec(name, variant, build), dict(zip(optimizers, figures)))


PAPER_TABLES: list[PaperTable] = [
    PaperTable("CNN, CIFAR100", "MiB", [
        _row("MobileNetV2", "MobileNetV2 1.0, 100-class head", partial(models.mobilenet_v2, 100), 18, 26, 9, 43, 0.7),
        _row("ResNet-50", "ResNet-50, 100-class head", partial(models.resnet50, 100), 184, 215, 93, 340, 3.5),
    ]),
    PaperTable("CNN, ImageNet", "MiB", [
        _row("MobileNetV2", "MobileNetV2 1.0, 1000-class head", partial(models.mobilenet_v2, 1000), 27, 30, 14, 47, 0.8),
        _row("ResNet-50", "ResNet-50, 1000-class head", partial(models.resnet50, 1000), 195, 220, 99, 346, 3.7),
    ], missing=["YOLOv5s / YOLOv5m (COCO): their shapes come only with the ultralytics code and weights, "
                "which need a download and torchvision; not reproduced"]),
    PaperTable("WMT32k full training", "GiB", [
        _row("Transformer-base", "nn.Transformer d=512, ff=2048, 6+6 layers; untied 32768-token src/tgt/output "
             "embeddings (tied ones would give Adam 0.45 GiB, not 0.7)", partial(models.transformer_wmt, False),
             0.7, 0.4, 0.4, 0.4, 0.01),
        _row("Transformer-big", "nn.Transformer d=1024, ff=4096, 16 heads, 6+6 layers; untied 32768-token embeddings",
             partial(models.transformer_wmt, True), 2.1, 1.1, 1.1, 1.1, 0.04),
    ]),
    PaperTable("Pre-training", "GiB", [
        _row("BERT", "BERT-large with pre-training heads (335M)", partial(models.bert, True, False), 2.5, 1.3, 1.3, 1.3, 0.04),
        _row("GPT-2", "GPT-2 medium (355M)", partial(models.gpt2, True), 2.6, 1.3, 1.3, 1.3, 0.04),
        _row("T5", "T5-base (223M)", partial(models.t5, True), 1.7, 0.8, 0.8, 0.9, 0.03),
    ]),
    PaperTable("Fine-tuning", "MiB", [
        _row("GPT-2", "GPT-2 small (124M)", partial(models.gpt2, False), 957, 478, 478, 468, 16),
        _row("T5-small", "T5-small (61M)", partial(models.t5, False), 464, 233, 233, 233, 8),
        _row("BERT", "BERT-base uncased, QA head (109M)", partial(models.bert, False, True), 849, 425, 425, 426, 15),
        _row("LLaMA-7b LoRA", "LLaMA-7B, LoRA r=8 on all linear layers but the head (20M trainable)", models.llama7b_lora,
             153, 86, 86, 86, 3.9),
        _row("RoBERTa-base", "RoBERTa-base, QA head (124M)", models.roberta_base, 972, 488, 488, 488, 16.3),
        _row("ALBERT-base-v2", "ALBERT-base-v2, QA head (11M)", models.albert_base_v2, 85, 43, 43, 43, 1.5),
    ]),
    PaperTable("Fine-tuning, Adam vs SMMF", "MiB", [
        _row("T5-small", "T5-small (61M)", partial(models.t5, False), 462, 8.3, optimizers=("adam", "smmf")),
        _row("MarianMT", "MarianMT en-ro (75M)", models.marian_en_ro, 569, 10.2, optimizers=("adam", "smmf")),
        _row("BART-base", "BART-base (139M)", models.bart_base, 1068, 18.5, optimizers=("adam", "smmf")),
        _row("mBART", "mBART-large (611M)", models.mbart_large, 4661, 77.8, optimizers=("adam", "smmf")),
    ]),
]

UNITS = {"MiB": 2**20, "GiB": 2**30}


def measure_row(row: PaperRow, unit: str, device: Optional[str] = None) -> list[dict[str, Any]]:
    model = row.spec.build()
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    measured = measured_state_bytes(row.spec.build, device) if device else {}
    out = []
    for optimizer, paper in row.paper.items():
        exact = predict_state_bytes(model, optimizer) / UNITS[unit]
        allocated = predict_state_bytes(model, optimizer, CUDA_ALLOCATOR_BLOCK) / UNITS[unit]
        entry: dict[str, Any] = dict(
            model=row.spec.name, variant=row.spec.variant, params=params, optimizer=optimizer, unit=unit,
            ours_allocated=allocated, ours_exact=exact, paper=paper, diff_pct=100.0 * (allocated - paper) / paper,
            same_when_printed=_printed_like(allocated, paper),
        )
        if optimizer in measured:
            entry["measured_on"] = torch.cuda.get_device_name(device)
            entry["measured"] = measured[optimizer] / UNITS[unit]
            entry["measured_vs_ours_pct"] = 100.0 * (entry["measured"] - allocated) / allocated
        out.append(entry)
    return out


def measured_state_bytes(build: Callable[[], nn.Module], device: str) -> dict[str, int]:
    """Growth of allocated device memory over the first step of Adam and of SMMF on the real model."""
    from .. import SMMF

    factories = {"adam": torch.optim.Adam, "smmf": SMMF}
    expected = sum(p.numel() for p in build().parameters() if p.requires_grad)
    out = {}
    for name, factory in factories.items():
        model = build().to_empty(device=device)  # uninitialized; only the trainable params get values
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()  # to_empty unties shared params (e.g. GPT-2's embedding and head)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if sum(p.numel() for p in trainable) != expected:
            raise RuntimeError(f"the model built on {device} has other trainable params than its meta twin")
        with torch.no_grad():
            for p in trainable:
                p.normal_(0.0, 0.02)
                p.grad = torch.randn_like(p).mul_(1e-3)
        opt = factory(trainable)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        opt.step()
        torch.cuda.synchronize(device)
        out[name] = torch.cuda.memory_allocated(device) - before
        del opt, model, trainable
        torch.cuda.empty_cache()
    return out


def _printed_like(ours: float, paper: float) -> bool:
    """Does our figure print as the paper's, at the paper's number of decimals?"""
    text = repr(float(paper))
    decimals = 0 if text.endswith(".0") else len(text.split(".")[1])
    return round(ours, decimals) == round(paper, decimals)


def run(
    model: Optional[str] = None, show_progress: bool = True, device: Optional[str] = None
) -> list[tuple[PaperTable, list[dict[str, Any]]]]:
    tables = [(t, [r for r in t.rows if model is None or r.spec.name.lower() == model.lower()]) for t in PAPER_TABLES]
    tables = [(t, rows) for t, rows in tables if rows]
    if not tables:
        raise ValueError(f"Unknown model: {model!r}. It needs to be one of {model_names()}")
    jobs = [(t, r) for t, rows in tables for r in rows]
    results: dict[int, list[dict[str, Any]]] = {id(t): [] for t, _ in tables}
    skipped: dict[int, list[str]] = {id(t): [] for t, _ in tables}
    for table, row in progress(jobs, "building models", len(jobs), show_progress):
        try:
            results[id(table)] += measure_row(row, table.unit, device)
        except ModuleNotFoundError as err:  # e.g. peft, for the LoRA row, without the [bench] extra
            skipped[id(table)].append(f"{row.spec.name}: skipped, it needs {err.name} (pip install 'smmf[bench]')")
    return [(replace(t, missing=t.missing + skipped[id(t)]), results[id(t)]) for t, _ in tables]


def model_names() -> list[str]:
    return sorted({r.spec.name for t in PAPER_TABLES for r in t.rows})


def format_results(results: list[tuple[PaperTable, list[dict[str, Any]]]], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([{"table": t.title, "unit": t.unit, "rows": rows, "missing": t.missing} for t, rows in results], indent=2)
    measured_on = {r["measured_on"] for _, rows in results for r in rows if "measured" in r}
    headers = ["model", "params", "optimizer", "ours", "ours exact", "paper", "diff %", "prints as paper"]
    if measured_on:
        headers += [f"measured ({', '.join(sorted(measured_on))})", "measured vs ours %"]
    parts = []
    for table, rows in results:
        body = [[r["model"], f"{r['params'] / 1e6:.1f}M", r["optimizer"], r["ours_allocated"], r["ours_exact"],
                 r["paper"], f"{r['diff_pct']:+.1f}", "yes" if r["same_when_printed"] else "no"] for r in rows]
        if measured_on:
            for line, r in zip(body, rows):
                line += [r.get("measured"), f"{r['measured_vs_ours_pct']:+.2f}" if "measured" in r else None]
        text = format_table(headers, body, fmt)
        if fmt == "csv":
            parts.append(f"# {table.title} ({table.unit})\n" + text)
            continue
        title = f"{table.title} — optimizer state, {table.unit} (ours: 512 B allocator blocks, as the paper measured)"
        variants = sorted({(r["model"], r["variant"]) for r in rows})
        bullet = "- " if fmt == "markdown" else "  "
        notes = [f"{bullet}{m}: {v}" for m, v in variants] + [f"{bullet}missing: {m}" for m in table.missing]
        heading = f"### {title}\n\n" if fmt == "markdown" else f"{title}\n"
        parts.append(heading + text + ("\n" if fmt == "markdown" else "") + "\n".join(notes) + "\n")
    return "\n".join(parts)


def config_report(path: str, fmt: str) -> str:
    from ..memory import report

    rep = report(models.from_config_file(path))
    if fmt == "json":
        return json.dumps({"params": rep.params, "exact": rep.exact, "allocated": rep.allocated}, indent=2)
    return f"{rep.params:,} trainable parameters ({path})\n" + rep.table(fmt)


PROG = "smmf memory"


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--model", help="only this model's rows (e.g. ResNet-50, GPT-2)")
    parser.add_argument("--config", help="report the state of any transformers config file instead")
    parser.add_argument("--format", default="table", choices=["table", "markdown", "csv", "json"])
    parser.add_argument("--measure", choices=["cuda"], help="also measure Adam's and SMMF's state on this device")
    return parser


def check_config(path: str) -> None:
    """A readable JSON object with a ``model_type`` that transformers knows, or a one-line error."""
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError as err:
        fail(PROG, f"--config {path}: {err.strerror or err}")
    except ValueError as err:
        fail(PROG, f"--config {path}: not valid JSON ({err})")
    if not isinstance(config, dict) or "model_type" not in config:
        fail(PROG, f"--config {path}: expected a transformers config, a JSON object with a 'model_type'")
    try:
        from transformers import CONFIG_MAPPING
    except ModuleNotFoundError:
        fail(PROG, "--config needs transformers: pip install 'smmf[bench]'")
    if config["model_type"] not in CONFIG_MAPPING:
        fail(PROG, f"--config {path}: unknown model_type {config['model_type']!r}")


def main(args: Optional[argparse.Namespace] = None) -> int:
    args = args or build_parser().parse_args()
    if args.model is not None and args.model.lower() not in {name.lower() for name in model_names()}:
        fail(PROG, f"--model: unknown {args.model!r}; choose from {model_names()}")
    if args.measure and not torch.cuda.is_available():
        fail(PROG, "--measure cuda needs a CUDA device, and none is available")
    if args.config:
        check_config(args.config)
        print(config_report(args.config, args.format))
        return 0
    print(format_results(run(args.model, device=args.measure), args.format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
