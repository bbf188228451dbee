"""The command line: an error is one line with exit status 2, before any work; an optional
dependency that is missing skips its row with a note."""

from __future__ import annotations

import sys

import pytest
import torch



# CLI errors: one line, exit status 2, before any work.

CLI_CASES = {
    "config missing": (["memory", "--config", "/nonexistent.json"], "No such file"),
    "config a directory": (["memory", "--config", "/"], "Is a directory"),
    "config malformed": (["memory", "--config", "{tmp}/bad.json"], "not valid JSON"),
    "config a list": (["memory", "--config", "{tmp}/list.json"], "a JSON object with a 'model_type'"),
    "config unknown type": (["memory", "--config", "{tmp}/unknown.json"], "unknown model_type 'nope'"),
    "memory unknown model": (["memory", "--model", "nope"], "--model: unknown 'nope'"),
    "opt-args not a number": (["compare", "--opt-args", "smmf:lr=abc"], "lr should be a number but is: 'abc'"),
    "opt-args unknown key": (["compare", "--opt-args", "smmf:foo=1"], "unexpected keyword argument 'foo'"),
    "opt-args no colon": (["compare", "--opt-args", "smmflr=1"], "expects NAME:key=value"),
    "opt-args after adam": (["compare", "--optimizers", "adam,smmf", "--opt-args", "smmf:lr=abc"], "lr should be"),
    "opt-args unlisted optimizer": (["compare", "--optimizers", "adam", "--opt-args", "smmf:lr=1"], "not among"),
    "compare device": (["compare", "--device", "nope"], "invalid choice: 'nope'"),
    "compare no tasks": (["compare", "--tasks", ","], "--tasks names nothing"),
    "compare unknown task": (["compare", "--tasks", "digits-cnn,nope"], "--tasks: unknown 'nope'"),
    "compare negative steps": (["compare", "--steps", "-5"], "--steps must be at least 1, got -5"),
    "compare zero steps": (["compare", "--steps", "0"], "--steps must be at least 1, got 0"),
    "compare zero seeds": (["compare", "--seeds", "0"], "--seeds must be between 1 and 1000, got 0"),
    "compare huge seeds": (["compare", "--seeds", "1000000000000"], "--seeds must be between 1 and 1000"),
    "compare empty out": (["compare", "--out", ""], "--out names no directory"),
    "compare bad seeds with a new cache": (["compare", "--tasks", "finetune-lm", "--cache", "{tmp}/new-cache",
                                            "--seeds", "0"], "--seeds must be between 1 and 1000, got 0"),
    "compare into another study": (["compare", "--out", "{tmp}/study"], "--out {tmp}/study holds another study (1 "
                                   "run(s) of `smmf compare --tasks digits-cnn`): add --resume"),
    "compare into a folder with foreign results": (["compare", "--out", "{tmp}/foreign"], "holds another study (a "
                                                   "results.json that is not smmf compare's)"),
    "bench bad largest with a plot folder": (["bench", "--training", "--plot", "{tmp}/d/e/p.png", "--largest", "abc"],
                                             "--largest takes positive numbers of GiB, got 'abc'"),
    "compare unwritable out": (["compare", "--out", "/proc/forbidden"], "--out /proc/forbidden: cannot write"),
    "resume truncated results": (["compare", "--resume", "--out", "{tmp}/truncated"], "not a results file of smmf "
                                 "compare (Expecting"),
    "resume foreign results": (["compare", "--resume", "--out", "{tmp}/foreign"], "runs each have task, optimizer, label"),
    "bench unknown set": (["bench", "--sets", "nope"], "--sets: unknown 'nope'"),
    "bench one unknown set": (["bench", "--sets", "resnet50,nope"], "--sets: unknown 'nope'"),
    "bench zero repeats": (["bench", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    "bench zero threads": (["bench", "--threads", "0"], "--threads must be between 1 and"),
    "bench plot without training": (["bench", "--plot", "{tmp}/p.png"], "--plot is for --training"),
    "bench largest without training": (["bench", "--largest", "1"], "--largest is for --training"),
    "bench threads with training": (["bench", "--training", "--threads", "1"], "--threads is for the step benchmarks"),
    "opt-args key a kwargs optimizer drops": (["compare", "--optimizers", "adafactor", "--opt-args",
                                               "adafactor:bogus=1"], "AdaFactor has no option 'bogus'"),
    "compare seed too large": (["compare", "--seed", str(2**64)], "--seed must be between 0 and 2**63"),
    "compare negative seed": (["compare", "--seed", "-1"], "--seed must be between 0 and 2**63"),
    "resume run without its figures": (["compare", "--resume", "--out", "{tmp}/bare"], "those that trained metric"),
    "resume command not text": (["compare", "--resume", "--out", "{tmp}/numeric"], "not a results file"),
    "resume pretrain steps not a number": (["compare", "--resume", "--out", "{tmp}/pretrain"],
                                           "--pretrain-steps is not a number"),
}
if not torch.cuda.is_available():
    CLI_CASES |= {
        "compare cuda": (["compare", "--device", "cuda"], "needs a CUDA device"),
        "bench cuda": (["bench", "--device", "cuda"], "needs a CUDA device"),
        "memory measure cuda": (["memory", "--measure", "cuda"], "needs a CUDA device"),
    }


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_error_is_one_line_exit_2_before_any_work(case: str, tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("transformers")
    from smmf import cli
    from smmf.bench import bench, compare, memory

    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "unknown.json").write_text('{"model_type": "nope"}')
    for name, text in (("truncated", '{"meta": {}, "results": [{"task"'), ("foreign", '{"results": [{"foo": 1}]}'),
                       ("bare", '{"results": [{"task": "digits-cnn", "optimizer": "adam", "label": "Adam"}]}'),
                       ("numeric", '{"meta": {"command": 5}, "results": []}'),
                       ("pretrain", '{"meta": {"command": "smmf compare --pretrain-steps x"}, "results": []}'),
                       ("study", '{"meta": {"command": "smmf compare --tasks digits-cnn"}, "results": [{}]}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(text)
    cwd = tmp_path / "cwd"  # where the default --out would be made
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = sorted(tmp_path.rglob("*"))

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    for module in (compare, memory, bench):
        monkeypatch.setattr(module, "run", no_work)
    monkeypatch.setattr(memory, "config_report", no_work)
    argv, match = CLI_CASES[case]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("smmf"), err
    assert match.replace("{tmp}", str(tmp_path)) in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing created, here or under the current directory


def test_memory_without_peft_skips_the_lora_row_with_a_note(monkeypatch, capsys) -> None:
    pytest.importorskip("transformers")
    from smmf.bench import memory

    monkeypatch.setitem(sys.modules, "peft", None)  # as if the [bench] extra were not installed
    assert memory.main(memory.build_parser().parse_args(["--model", "LLaMA-7b LoRA"])) == 0
    assert "LLaMA-7b LoRA: skipped, it needs peft (pip install 'smmf[bench]')" in capsys.readouterr().out
