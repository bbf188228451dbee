"""``smmf.zero.check_checkpoint`` / ``load_checkpoint`` on stand-ins for DeepSpeed's engine and checkpoint folder:
a checkpoint of another number of data-parallel ranks (under ZeRO) or of another stage is refused by name before
the engine loads anything; the same layout loads; below ZeRO-3 the weights alone load at any world size."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from smmf.zero import check_checkpoint, load_checkpoint


class Engine(SimpleNamespace):
    """What the check reads of DeepSpeed's engine, and its load recorded."""

    def zero_optimization_stage(self) -> int:
        return self.stage

    def load_checkpoint(self, load_dir: str, tag=None, **kwargs):
        self.loaded.append((load_dir, tag, kwargs))
        return load_dir, {}


def _saved(folder: Path, tag: str, world: int, stage: int) -> Path:
    (folder / tag).mkdir(parents=True)
    torch.save({"dp_world_size": world, "ds_config": {"zero_optimization": {"stage": stage}}, "module": {}},
               folder / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    torch.save({"dp_world_size": world}, folder / tag / "expert_0_mp_rank_00_model_states.pt")  # sorted first
    (folder / "latest").write_text(tag)
    return folder


def test_another_world_size_or_stage_is_refused_by_name_before_the_engine_loads(tmp_path: Path) -> None:
    folder = _saved(tmp_path, "global_step3", world=2, stage=3)
    for world, stage, message in [(1, 3, "saved at 2 data-parallel ranks and this engine runs 1"),
                                  (3, 3, "saved at 2 data-parallel ranks and this engine runs 3"),
                                  (2, 2, "saved under ZeRO stage 3 and this engine runs stage 2")]:
        engine = Engine(dp_world_size=world, seq_dp_world_size=world, stage=stage, loaded=[])
        with pytest.raises(ValueError, match=message):
            load_checkpoint(engine, folder)  # the tag from 'latest'
        assert engine.loaded == []
    engine = Engine(dp_world_size=2, seq_dp_world_size=2, stage=3, loaded=[])
    assert load_checkpoint(engine, folder, tag="global_step3", load_lr_scheduler_states=False) == (str(folder), {})
    assert engine.loaded == [(str(folder), "global_step3", {"load_lr_scheduler_states": False})]


def test_without_zero_or_without_the_optimizer_below_zero3_any_world_size_loads(tmp_path: Path) -> None:
    plain = _saved(tmp_path / "plain", "t", world=2, stage=0)
    check_checkpoint(Engine(dp_world_size=4, seq_dp_world_size=4, stage=0), plain)  # no ZeRO: whole state per rank
    zero2 = _saved(tmp_path / "zero2", "t", world=2, stage=2)
    engine = Engine(dp_world_size=1, seq_dp_world_size=1, stage=2, loaded=[])
    load_checkpoint(engine, zero2, load_module_only=True)
    load_checkpoint(engine, zero2, load_optimizer_states=False)
    assert len(engine.loaded) == 2
    with pytest.raises(ValueError, match="saved at 2"):
        load_checkpoint(engine, zero2)


def test_a_folder_without_a_checkpoint_is_named(tmp_path: Path) -> None:
    engine = Engine(dp_world_size=1, seq_dp_world_size=1, stage=2)
    with pytest.raises(ValueError, match="no 'latest' file"):
        check_checkpoint(engine, tmp_path)
    (tmp_path / "t").mkdir()
    with pytest.raises(ValueError, match="holds no DeepSpeed checkpoint"):
        check_checkpoint(engine, tmp_path, tag="t")


def _smmf_state_after_steps(shapes, steps: int = 2, **options):
    """A plain SMMF's state dict and groups after ``steps`` of random gradients on params of ``shapes``."""
    from smmf import SMMF

    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    optimizer = SMMF(params, lr=1e-2, backend="torch", **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return optimizer


def _zero_folder(folder: Path, optimizer, cuts: list[int], frozen_first: bool = False, counts: bool = True) -> Path:
    """Stand-ins for the optimizer-state files of a ZeRO-2 checkpoint at ``len(cuts) - 1`` ranks: the params of
    ``optimizer``'s one group laid end to end in one flat buffer, cut at ``cuts`` (elements of that buffer), each
    rank's client state dict holding its pieces as SMMF's ZeRO engine keeps them."""
    from smmf.partitions import Piece, cut_piece_state
    from smmf.zero import GIVEN_GROUPS

    group = optimizer.param_groups[0]
    params, first = group["params"], int(frozen_first)
    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    torch.save({"dp_world_size": len(cuts) - 1}, folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    starts = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    for rank, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        pieces, places = {}, {}
        for ordinal, (param, start) in enumerate(zip(params, starts)):
            a, b = max(lo, start), min(hi, start + param.numel())
            if a < b:
                piece = Piece(ordinal + first, tuple(param.shape), a - start, b - a, a - lo)
                pieces[piece.ordinal] = cut_piece_state(optimizer.state[param], piece, group, torch.float32)
                places[piece.ordinal] = piece.place
        options = {key: value for key, value in group.items() if key != "params"}
        client = {"state": {0: {"pieces": pieces, "places": places}}, "param_groups": [{**options, "params": [0]}],
                  **({GIVEN_GROUPS: [len(params) + first]} if counts else {})}
        torch.save({"optimizer_state_dict": {"base_optimizer_state": client}},
                   folder / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return folder


@pytest.mark.parametrize("options", [{}, {"magnitude_bits": 3}, {"magnitude_bits": 1}], ids=["paper", "levels", "flag"])
def test_tensorwise_state_joins_the_ranks_pieces_into_the_plain_state(tmp_path: Path, options: dict) -> None:
    """Three ranks' files whose pieces cut tensors mid-row and mid-byte (and a frozen param given first): the state
    dict ``smmf.zero.tensorwise_state`` makes is the plain optimizer's, bit for bit, its group listing the frozen
    param too; ``smmf zero-to-plain`` writes the same."""
    from smmf.cli import main
    from smmf.zero import tensorwise_state

    optimizer = _smmf_state_after_steps([(37, 129), (129,), (300, 7)], **options)
    total = sum(p.numel() for p in optimizer.param_groups[0]["params"])
    folder = _zero_folder(tmp_path, optimizer, [0, 1000 + 3, total - 250, total], frozen_first=True)
    joined = tensorwise_state(folder)
    expected = optimizer.state_dict()
    assert joined["param_groups"][0]["params"] == [0, 1, 2, 3]  # the frozen one at place 0, without state
    assert {k: v for k, v in joined["param_groups"][0].items() if k != "params"} == \
        {k: v for k, v in expected["param_groups"][0].items() if k != "params"}
    assert sorted(joined["state"]) == [1, 2, 3]
    for pid, state in expected["state"].items():
        got = joined["state"][pid + 1]
        assert got.keys() == state.keys() and got["step"] == state["step"]
        assert all(torch.equal(got[key], value) for key, value in state.items() if isinstance(value, torch.Tensor))
    older = _zero_folder(tmp_path / "older", optimizer, [0, 1000 + 3, total - 250, total], frozen_first=True,
                         counts=False)  # saved before the counts were: a frozen param first still counts
    with pytest.warns(UserWarning, match="does not record how many params each group was given"):
        assert tensorwise_state(older)["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert main(["zero-to-plain", str(folder), str(tmp_path / "plain.pt")]) == 0
    written = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert all(torch.equal(written["state"][3][key], value) for key, value in joined["state"][3].items()
               if isinstance(value, torch.Tensor))


def test_tensorwise_state_refuses_missing_ranks_other_optimizers_and_folders_without_state(tmp_path: Path,
                                                                                          capsys) -> None:
    from smmf.cli import main
    from smmf.zero import tensorwise_state

    optimizer = _smmf_state_after_steps([(37, 129)])
    folder = _zero_folder(tmp_path / "smmf", optimizer, [0, 2000, 37 * 129])
    (folder / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match=r"files of ranks \[0\], and was saved at 2 ranks: are the files of some"):
        tensorwise_state(folder)
    (folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()  # the count unknown
    with pytest.raises(ValueError, match="do not tile it: are the files of some ranks missing"):
        tensorwise_state(folder)
    other = _smmf_state_after_steps([(37, 129)])
    other_run = _zero_folder(tmp_path / "mixed", other, [0, 2000, 37 * 129])
    mixed = other_run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    saved = torch.load(mixed, weights_only=False)
    saved["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["pieces"][0]["row_v"].mul_(2)
    torch.save(saved, mixed)
    with pytest.raises(ValueError, match="disagree on its 'row_v'"):
        tensorwise_state(other_run)
    saved["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["pieces"][0]["sign_m"] = torch.zeros(3, dtype=torch.uint8)
    torch.save(saved, mixed)
    with pytest.raises(ValueError, match="state 'sign_m' has shape"):
        tensorwise_state(other_run)
    adam = tmp_path / "adam" / "t"
    adam.mkdir(parents=True)
    state = {"state": {0: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3), "step": torch.tensor(1.0)}},
             "param_groups": [{"lr": 1e-3, "params": [0]}]}
    torch.save({"optimizer_state_dict": {"optimizer_state_dict": state}}, adam / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match=r"another optimizer's state \(keys \['exp_avg', 'exp_avg_sq', 'step'\]\)"):
        tensorwise_state(tmp_path / "adam", tag="t")
    (tmp_path / "weights" / "t").mkdir(parents=True)
    with pytest.raises(ValueError, match="no optimizer state of DeepSpeed ZeRO"):
        tensorwise_state(tmp_path / "weights", tag="t")
    with pytest.raises(SystemExit):
        main(["zero-to-plain", str(tmp_path / "adam"), str(tmp_path / "out.pt"), "--tag", "t"])
    assert "another optimizer's state" in capsys.readouterr().err and not (tmp_path / "out.pt").exists()
