"""``smmf`` command line: ``compare`` (the main job), ``memory``, ``bench`` and ``zero-to-plain``."""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .bench import bench, compare, memory
    from .bench.args import OneLineParser

    parser = OneLineParser(prog="smmf", description="SMMF optimizer: comparisons, memory tables, benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)

    compare.build_parser(sub.add_parser("compare", help="train with Adam, Adafactor, SM3, CAME and SMMF side by side"))
    memory.build_parser(sub.add_parser("memory", help="the paper's optimizer-memory tables, reproduced"))
    bench.build_parser(sub.add_parser("bench", help="step time and peak memory against Adam"))
    zero = sub.add_parser("zero-to-plain", help="a DeepSpeed ZeRO checkpoint's SMMF state as a plain SMMF state dict, "
                          "which continues in one process, under FSDP2 or under ZeRO at any number of ranks")
    zero.add_argument("checkpoint_dir", help="the folder engine.save_checkpoint wrote")
    zero.add_argument("out", help="where to write the state dict (torch.save)")
    zero.add_argument("--tag", help="the checkpoint's tag (default: the one the folder's 'latest' file names)")
    args = parser.parse_args(argv)
    if args.command == "zero-to-plain":
        try:
            return _zero_to_plain(args.checkpoint_dir, args.out, args.tag)
        except ValueError as err:
            parser.error(str(err))
    runner = {"compare": compare.main, "memory": memory.main, "bench": bench.main}[args.command]
    return runner(args)


def _zero_to_plain(checkpoint_dir: str, out: str, tag: Optional[str]) -> int:
    import torch

    from .state import STEP
    from .zero import tensorwise_state

    state_dict = tensorwise_state(checkpoint_dir, tag)
    torch.save(state_dict, out)
    steps = sorted({int(state[STEP]) for state in state_dict["state"].values()})
    print(f"{out}: SMMF's state of {len(state_dict['state'])} parameters in {len(state_dict['param_groups'])} "
          f"group(s), at step {', '.join(map(str, steps)) or 'none'}; load it with SMMF.load_state_dict (one process, "
          "FSDP2) or smmf.zero.load_state(engine, state_dict) under ZeRO")
    return 0


if __name__ == "__main__":
    sys.exit(main())
