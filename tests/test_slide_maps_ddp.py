"""CAMELYON16 validation across processes: the per-patch rows reduced into per-slide maps give
the summary that gathering every patch's record gave, in one process and
in two gloo processes fed as Lightning's distributed sampler feeds them.

Kept apart from test_camelyon16 so that the spawned processes import little."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hsmla_med.engine.base import gather_records
from hsmla_med.engine.classification import COLUMNS, ClassificationModule, slide_maps
from hsmla_med.metrics.pathology import auc, detect_lesions, lesion_froc, slide_fp_tp, slide_score

INFERENCE = {"slide_sigma": 1.0, "lesion_threshold": 0.5, "lesion_radius": 2}  # configs/camelyon16.yaml


def _module() -> ClassificationModule:
    config = {"network": {}, "spatial_dims": 2, "in_channels": 3, "label_names": ["normal", "tumour"], "optim": {}, "loss": {},
              "inference": INFERENCE, "data": {}}
    return ClassificationModule(config, network=nn.Identity())


def whole_gather_summary(records: list[dict], inference: dict) -> dict:
    """The summary as it was computed before the reduction: every patch's record gathered, one
    map per slide built record by record, the metrics of :mod:`hsmla_med.metrics.pathology`."""
    by_slide: dict[int, list[dict]] = {}
    for record in records:
        by_slide.setdefault(record["slide"], []).append(record)
    probs, lesions, slide_labels, counts = [], [], [], []
    for slide in sorted(by_slide):
        patches = by_slide[slide]
        prob = np.full((max(p["row"] for p in patches) + 1, max(p["col"] for p in patches) + 1), np.nan)
        lesion = np.zeros(prob.shape, np.int64)
        for p in patches:
            prob[p["row"], p["col"]], lesion[p["row"], p["col"]] = p["prob"], p["lesion"]
        probs.append(prob), lesions.append(lesion), slide_labels.append(patches[0]["slide_label"])
        counts.append((patches[0]["num_lesions"], patches[0]["num_labels"]))
    slides = []
    for prob, lesion, (num_lesions, num_labels) in zip(probs, lesions, counts):
        found = detect_lesions(prob, inference["lesion_threshold"], inference["lesion_radius"])
        hits = [lesion[int(r), int(c)] for r, c in found[:, 1:]]
        slides.append((*slide_fp_tp(found[:, 0], hits, num_lesions, num_labels), num_lesions))
    froc = lesion_froc(slides)
    return {
        "auc": auc([slide_score(p, inference["slide_sigma"]) for p in probs], slide_labels),
        "patch_auc": auc([r["prob"] for r in records], [r["label"] for r in records]),
        "froc": froc["froc"], "froc_sensitivity": froc["sensitivity"], "slides": len(probs), "cases": len(records),
    }


def random_rows(seed: int = 0) -> np.ndarray:
    """Patches of four slides (two tumour, with lesions 1 and 2 and an ITC, label 3) on grids of a
    few cells, each cell once."""
    rng = np.random.default_rng(seed)
    rows = []
    for slide, (height, width, tumour) in enumerate([(5, 7, 1), (4, 4, 0), (6, 3, 1), (3, 8, 0)]):
        cells = np.argwhere(rng.random((height, width)) < 0.7)
        lesion = np.where(tumour & (cells[:, 0] < 2), 1 + (cells[:, 1] > width // 2), 0)
        lesion = np.where(tumour & (cells[:, 0] == height - 1) & (cells[:, 1] == 0), 3, lesion)
        prob = (rng.random(len(cells)) * 0.8 + 0.2 * (lesion > 0)).astype(np.float32)  # float32, as the network's
        rows += [[slide, r, c, p, int(les > 0), les, tumour, 2 * tumour, 3 * tumour] for (r, c), p, les in zip(cells, prob, lesion)]
    return np.array(rows, np.float64)


def assert_same_summary(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def _records(rows: np.ndarray) -> list[dict]:
    return [{"key": k, **{c: (float(v) if c == "prob" else int(v)) for c, v in zip(COLUMNS, row)}} for k, row in enumerate(rows)]


def test_reduced_maps_give_the_whole_gather_summary():
    rows = random_rows()
    module = _module()
    reduced = module.summarize_records(module.collect_records(np.array_split(rows, 3)))
    assert_same_summary(reduced, whole_gather_summary(_records(rows), INFERENCE))
    assert 0 < reduced["patch_auc"] < 1 and 0 < reduced["froc"] < 1  # a case where mistakes would show
    assert reduced["cases"] == len(rows) and reduced["slides"] == 4 and reduced["froc"] is not None


def _rank(rank: int, world: int, store: str, out: str) -> None:
    """One gloo process: its share of the patches as the distributed sampler deals them (every
    world-th, the first ones repeated to even the shares), reduced, and the whole-gather summary."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = random_rows()
    order = np.concatenate([np.arange(len(rows)), np.arange(-len(rows) % world)])
    mine = order[rank::world]
    module = _module()
    reduced = module.summarize_records(module.collect_records([rows[mine[:5]], rows[mine[5:]]]))
    records = _records(rows)
    whole = whole_gather_summary(gather_records([records[i] for i in mine]), INFERENCE)
    torch.distributed.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"reduced": reduced, "whole": whole, "own": len(mine)}))


def test_two_process_gloo_reduction_equals_the_whole_gather(tmp_path):
    torch.multiprocessing.spawn(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    n = len(random_rows())
    assert results[0]["own"] + results[1]["own"] == n + n % 2
    assert results[0]["reduced"] == results[1]["reduced"]
    assert results[0]["reduced"]["cases"] == results[0]["whole"]["cases"] == n
    assert_same_summary(results[0]["reduced"], results[0]["whole"])
    assert_same_summary(results[0]["reduced"], _module().summarize_records(slide_maps(random_rows())))
