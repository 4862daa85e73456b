"""Time of metrics.detection.froc_band (the LUNA16 script's 1000-draw bootstrap) on a full-size random
submission: 888 scans x 100 marks, nodules in 600 scans. `.venv/bin/python scripts/bench_froc_band.py`."""
import time, numpy as np
from hsmla_med.metrics.detection import submission_matches, froc_band
rng = np.random.default_rng(0)
uids = [f"s{i}" for i in range(888)]
cands = {u: np.c_[rng.uniform(-150, 150, (100, 3)), rng.uniform(0, 1, 100)] for u in uids}
nods = {u: np.c_[rng.uniform(-150, 150, (2, 3)), rng.uniform(4, 20, 2)] for u in uids[:600]}
m = submission_matches(cands, nods, {}, uids)
for _ in range(3):
    t = time.perf_counter(); froc_band(m, seed=0); print(f"froc_band 1000 draws, 888 scans x 100 marks: {time.perf_counter()-t:.2f} s")
