"""torchvision (which timm needs, and torchmetrics imports) imports after hsmla_med, even where
its wheel was built for another torch (hsmla_med/torchvision_ops.py), and its operators behave as
torchvision means them to: they run where they loaded, and fail where they did not."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import hsmla_med
import lightning.pytorch  # torchmetrics imports torchvision
import timm
import torch
from torchvision import extension
from torchvision.ops import nms

print(tuple(timm.create_model("resnet18", num_classes=0).eval()(torch.zeros(1, 3, 32, 32)).shape))
try:
    kept = nms(torch.tensor([[0.0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]]), torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist()
except RuntimeError:
    kept = None
print(extension._has_ops(), kept)
"""


def test_torchvision_imports_after_hsmla_med_and_its_operators_stay_as_loaded():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    shape, ops = result.stdout.strip().splitlines()
    assert shape == "(1, 512)"
    # with its C++ operators, nms keeps boxes 0 and 2 (box 1 overlaps box 0 by IoU 0.81); without, it refuses
    assert ops in ("True [0, 2]", "False None")
