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
