"""``hsmla-med bench``: the benchmarks (:mod:`hsmla_med.bench`); its options are the benchmark's
own (``hsmla-med bench --help``), passed through unparsed."""

from __future__ import annotations

from hsmla_med.cli.invocation import Invocation

#: the command whose unknown arguments are its own, not errors
PASSES_ARGUMENTS = True


def add_parser(sub) -> None:
    sub.add_parser("bench", help="benchmarks of HSMLA networks vs SegFormer, SwinUNETR and UNet (CPU; --only gpu on a CUDA GPU; --help lists them all)",
                   add_help=False)


def run(args, invocation: Invocation) -> int:
    from hsmla_med.bench.main import main as bench_main

    return bench_main(args.args)
