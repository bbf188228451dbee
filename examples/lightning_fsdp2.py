"""Lightning with SMMF: FSDP2 through ``ModelParallelStrategy`` (``fully_shard`` applied in ``configure_model``),
a distributed checkpoint at step 3 and a resume that equals the uninterrupted run; ``FSDPStrategy`` (FSDP1) is
refused by SMMF with a clear error.

    torchrun --nproc-per-node 2 examples/lightning_fsdp2.py [--out DIR] [--params PATH]

On CPU with gloo as written; on GPUs use ``accelerator="gpu"`` (nccl). ``--params PATH``: rank 0 writes the full
parameters of both runs and the FSDP1 error there (``torch.save``).
"""

import argparse
import os
import sys
import tempfile

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from smmf import SMMF

STEPS, SAVE_AT, BATCH = 6, 3, 8


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every run and on every rank
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 5))
        self.steps_run = 0

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):  # FSDP2: shard each layer, then the root
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        elif isinstance(self.trainer.strategy, FSDPStrategy) and self.device.type == "cpu":
            # Lightning would wrap with FSDP1 itself, with device_id=None on CPU, which torch's FSDP1 refuses
            # ("needs a non-CPU accelerator device"); wrapped here for the CPU, as FSDPStrategy allows.
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"), use_orig_params=True)

    def configure_optimizers(self):
        # Under FSDP2 these are the DTensor shards; under FSDPStrategy (FSDP1) flattened parameters, which
        # SMMF refuses ("flattened by FSDP1").
        return SMMF(self.parameters(), lr=1e-2, weight_decay=0.1, decay_rate=-0.8)

    def training_step(self, batch, batch_idx):
        # The data follow the global step, not the loader's position: a resumed run sees the same batches.
        gen = torch.Generator().manual_seed(100 + self.global_step)
        x, y = torch.randn(BATCH, 12, generator=gen), torch.randn(BATCH, 5, generator=gen)
        rank, world = self.global_rank, self.trainer.world_size
        self.steps_run += 1
        return torch.nn.functional.mse_loss(self.net(x.chunk(world)[rank]), y.chunk(world)[rank])

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(4 * STEPS)), batch_size=1)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, unchanged. Lightning refuses ``FSDPStrategy`` itself with ``accelerator="cpu"``
    ("requires a GPU accelerator", a check on the exact type); a subclass runs it on CPU. On GPUs pass
    ``FSDPStrategy()`` with ``accelerator="gpu"`` (Lightning wraps the model itself): SMMF refuses it the same way."""


def trainer(strategy, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def fsdp2() -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)  # the whole world shards (FSDP2)


def full_params(module: L.LightningModule) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in module.parameters()]  # a collective: every rank calls it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "smmf-lightning-example"))
    parser.add_argument("--params")
    args = parser.parse_args()

    straight = Net()
    trainer(fsdp2(), STEPS).fit(straight)
    optimizer = straight.trainer.optimizers[0]  # Lightning keeps SMMF itself; self.optimizers() wraps it
    kinds = {"optimizer": type(optimizer).__name__,
             "params": sorted({type(p).__name__ for p in straight.parameters()})}
    straight_params = full_params(straight)

    interrupted = Net()
    first = trainer(fsdp2(), SAVE_AT)
    first.fit(interrupted)
    checkpoint = os.path.join(args.out, "step3.ckpt")
    first.save_checkpoint(checkpoint)  # a directory: DCP shards of the model and of SMMF's state

    resumed = Net()
    trainer(fsdp2(), STEPS).fit(resumed, ckpt_path=checkpoint)
    resumed_params = full_params(resumed)

    # FSDPStrategy (FSDP1) flattens the parameters before configure_optimizers: SMMF refuses them.
    try:
        trainer(CPUFSDPStrategy(), STEPS).fit(Net())
        error = None
    except RuntimeError as err:
        error = str(err)
    if dist.get_rank() == 0:
        same = all(torch.equal(a, b) for a, b in zip(straight_params, resumed_params))
        print(f"ModelParallelStrategy (FSDP2): {kinds}; resumed from step {SAVE_AT} equals the uninterrupted run "
              f"bit for bit: {same}")
        print(f"FSDPStrategy (FSDP1): {error}")
        if args.params:
            torch.save({"straight": straight_params, "resumed": resumed_params, "fsdp1_error": error,
                        "resumed_steps": resumed.steps_run, **kinds},
                       args.params)
    finish()


def finish() -> None:
    # Leave together, then skip the interpreter's teardown: objects still holding gloo work can abort
    # the process at exit (pytorch/pytorch#179291).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
