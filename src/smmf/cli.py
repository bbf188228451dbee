"""``smmf`` command line: ``compare`` (the main job), ``memory`` and ``bench``."""

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
    args = parser.parse_args(argv)
    runner = {"compare": compare.main, "memory": memory.main, "bench": bench.main}[args.command]
    return runner(args)


if __name__ == "__main__":
    sys.exit(main())
