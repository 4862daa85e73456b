"""Where a quiet HSMLA forward spends its convolution time: torch's profiler over 3 forwards of
a network of ``hsmla-med bench --only models`` (tau calibrated to alpha 0.3, 2 threads, the heap
top pad), oneDNN convolutions grouped by input and weight shape, largest first (the
convolutions are three quarters of HSMLA-B2's forward at 512^2: which of them to make faster).

    hsmla-med bench --only profile-convolutions [--variant b2] [--size 512] [--top 18]
"""

from __future__ import annotations

import torch

from hsmla_med import runtime
from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.bench.models import _hsmla
from hsmla_med.nn import VARIANTS


def main(argv: list[str]) -> int:
    parser = own_parser("profile-convolutions", __doc__)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="b2", help="HSMLA variant (default b2)")
    parser.add_argument("--size", type=positive_int, default=512, help="input side (default 512)")
    parser.add_argument("--top", type=positive_int, default=18, help="convolution shapes listed (default 18)")
    args = parser.parse_args(argv)
    runtime.tune_cpu_allocator()
    torch.set_num_threads(2)
    x = torch.randn(1, 1, args.size, args.size)
    net = _hsmla(args.variant, "gate", x)
    with torch.inference_mode():
        net(x), net(x)
        with torch.profiler.profile(record_shapes=True) as prof:
            for _ in range(3):
                net(x)
    convs = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mkldnn_convolution"),
                   key=lambda e: -e.self_cpu_time_total)
    every = sum(e.self_cpu_time_total for e in prof.key_averages())
    total = sum(e.self_cpu_time_total for e in convs)
    print(f"HSMLA-{args.variant.upper()} at {args.size}^2: convolutions {total / 3e3:.0f} of {every / 3e3:.0f} ms self CPU per forward")
    print("| ms per forward | calls | input | weight |\n|---|---|---|---|")
    for e in convs[: args.top]:
        print(f"| {e.self_cpu_time_total / 3e3:.1f} | {e.count // 3} | {e.input_shapes[0]} | {e.input_shapes[1]} |")
    return 0
