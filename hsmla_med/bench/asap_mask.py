"""The CAMELYON16 evaluation mask of a lesion-sized outline (3000 vertices, about 20000 level-0
pixels across) on a 98000 x 220000 slide at level 5: ASAP's rule (``asap_mask``: the mask the
challenge's evaluation read, as ASAP makes it) against the pixel-centre fill it replaced
(``rasterise``, scikit-image's polygon fill), interleaved in one run; and how many level-5
pixels the two rules disagree on.

    hsmla-med bench --only asap-mask [--rounds 3]
"""

from __future__ import annotations

import time

import numpy as np

from hsmla_med.bench.common import own_parser, positive_int
from hsmla_med.data.asap import Polygon, asap_mask, rasterise


def main(argv: list[str]) -> int:
    parser = own_parser("asap-mask", __doc__)
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds of both rules (default 3)")
    args = parser.parse_args(argv)
    t = np.linspace(0, 2 * np.pi, 3000, endpoint=False)
    r = 10000 * (1 + 0.2 * np.sin(7 * t))
    polygons = [Polygon("lesion", "_0", np.stack([50000 + r * np.cos(t), 100000 + r * np.sin(t)], 1))]
    size = (98000, 220000)
    for round_ in range(args.rounds):
        start = time.perf_counter()
        ours = asap_mask(polygons, size, 32)
        middle = time.perf_counter()
        centres = rasterise(polygons, size, 32)[: ours.shape[0], : ours.shape[1]]
        end = time.perf_counter()
        print(f"round {round_}: asap_mask {middle - start:.3f} s, rasterise {end - middle:.3f} s; "
              f"{int(ours.sum())} vs {int(centres.sum())} tumour pixels, {int((ours != centres).sum())} differ")
    return 0
