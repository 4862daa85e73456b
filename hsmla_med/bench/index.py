"""The index of ``hsmla-med bench``: every benchmark, by the name ``--only NAME`` takes, with
what it measures (its line in ``hsmla-med bench --help``) and the function that runs it.

The functions are named as ``module:function`` and imported only when their benchmark runs:
most modules load torch, MONAI or more, and ``hsmla-med bench --help`` loads none of them.
Without ``--only``, ``hsmla-med bench`` runs ``models`` and ``layers``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Benchmark", "BENCHMARKS"]


@dataclass(frozen=True)
class Benchmark:
    """One ``--only NAME``.

    Attributes:
        summary: what it measures, in one line.
        target: ``"module:function"``. With ``own_options`` the function takes the arguments
            after ``--only NAME`` (``main(argv) -> int``: its own parser and ``--help``);
            without, the namespace of ``hsmla-med bench``'s options (``--out``, ``--size``,
            ``--runs``, ``--threads`` and the option groups of ``learning``, ``gpu`` and
            ``contention``) and returns the exit status.
        own_options: see ``target``.
    """

    summary: str
    target: str
    own_options: bool = True

    def function(self) -> Callable:
        """The function of ``target``, its module imported now."""
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)


def _shared(summary: str, target: str) -> Benchmark:
    return Benchmark(summary, target, own_options=False)


BENCHMARKS: dict[str, Benchmark] = {
    # hsmla-med bench's own options (hsmla_med.bench.main)
    "models": _shared("CPU latency and parameters of HSMLA-B0/B1/B2 and variants against SegFormer, SwinUNETR and UNet at --size^2",
                      "hsmla_med.bench.main:networks"),
    "layers": _shared("one HSMLA layer against softmax attention over 32^2 .. 256^2 tokens: time and peak memory",
                      "hsmla_med.bench.main:networks"),
    "wsi": _shared("whole-slide heatmap throughput (256 px patches, batch 32) against the forward passes alone", "hsmla_med.bench.main:wsi_table"),
    "endovis": _shared("frames/s of HSMLA-B0 against SegFormer-B0 on 1024x1280 RGB EndoVis frames", "hsmla_med.bench.main:endovis_table"),
    "learning": _shared("networks trained and scored on MNI152 grey/white matter (Dice, HD95, NSD; a perturbed 'other scanner' copy)",
                        "hsmla_med.bench.learning:run"),
    "gpu": _shared("networks on a CUDA GPU: 2D/3D inference, kernels per forward, training (--device cpu: a smoke run)", "hsmla_med.bench.gpu:run"),
    "volume": _shared("peak memory of infer on a 512x512x300 CT, and of the CT as a 300-file DICOM series into a DICOM SEG",
                      "hsmla_med.bench.main:volume_table"),
    "processes": _shared("infer of 8 volumes in one process, with loader workers, and in two DDP processes", "hsmla_med.bench.main:processes_table"),
    "export": _shared("exported ONNX under onnxruntime (CPU) against PyTorch eager with the C kernels", "hsmla_med.bench.main:export_table"),
    "contention": _shared("HSMLA-B2, SegFormer-B2, UNet and hsmla-med infer quiet, beside a background train and beside two busy PyTorch processes",
                          "hsmla_med.bench.main:contention_table"),
    # options of their own (hsmla-med bench --only NAME --help)
    "inference-3d": Benchmark("3D inference on the CPU: HSMLA-B0 against MONAI's UNet, SegResNet and SwinUNETR on one volume",
                              "hsmla_med.bench.inference_3d:main"),
    "ab-revision": Benchmark("HSMLA-B2 with the refinement on and off, this working tree against a git revision, in one process",
                             "hsmla_med.bench.ab_revision:main"),
    "allocator": Benchmark("what the heap top pad does to the time and scaling of an HSMLA layer and a 1x1 convolution",
                           "hsmla_med.bench.allocator:main"),
    "asap-mask": Benchmark("the CAMELYON16 evaluation mask of a lesion outline: ASAP's rule against the pixel-centre fill",
                           "hsmla_med.bench.asap_mask:main"),
    "compile-cpu": Benchmark("HSMLA-B2 on the CPU: torch.compile's first call, then the compiled forward against eager",
                             "hsmla_med.bench.compile_cpu:main"),
    "crossval": Benchmark("5-fold cross-validation on synthetic BTCV, then each fold and their ensemble on unseen volumes",
                          "hsmla_med.bench.crossval:main"),
    "froc-band": Benchmark("time of the LUNA16 FROC bootstrap band (froc_band) on a full-size random submission", "hsmla_med.bench.froc_band:main"),
    "heatmap-dense": Benchmark("heatmap throughput of HSMLA-B0 on the dense slide alone (6400 tissue patches)", "hsmla_med.bench.heatmap_dense:main"),
    "kernels": Benchmark("the HSMLA Triton kernels against the reference path and softmax attention on a CUDA GPU (--check: without one)",
                         "hsmla_med.bench.kernels:main"),
    "norm": Benchmark("inference latency of HSMLA-SegNet with batch norm against three forms of instance norm", "hsmla_med.bench.norm:main"),
    "report": Benchmark("size, writing time and browser render time of the HTML report of a large evaluation", "hsmla_med.bench.report:main"),
    "slide-reading": Benchmark("per-patch slide reads with OpenSlide, tifffile and cuCIM; thumbnails and heatmap overlays",
                               "hsmla_med.bench.slide_reading:main"),
    "stain": Benchmark("slide-level stain normalisation: colour distance between two stainings, a patch classifier's AUC across stains",
                       "hsmla_med.bench.stain:main"),
    "training": Benchmark("training cost of the local window terms and of one optimizer step, MONAI UNet against HSMLA-B0",
                          "hsmla_med.bench.training:main"),
    "trust": Benchmark("calibration (ECE before and after hsmla-med calibrate), uncertainty and the gate as an error signal on real MRI",
                       "hsmla_med.bench.trust:main"),
    "window-refine": Benchmark("forward + backward of the local window terms: window_refine against local_refine and dense_refine",
                               "hsmla_med.bench.window_refine:main"),
    "profile-3d-step": Benchmark("one 3D training step of HSMLA-B0 against MONAI's UNet-3D, and where its time goes (torch.profiler)",
                                 "hsmla_med.bench.profile_3d_step:main"),
    "profile-contention": Benchmark("a network's per-operator profile quiet and beside busy neighbours", "hsmla_med.bench.profile_contention:main"),
    "profile-convolutions": Benchmark("where a quiet HSMLA forward spends its convolution time, by input and weight shape",
                                      "hsmla_med.bench.profile_convolutions:main"),
    "census": Benchmark("kernels, ATen operations, Triton launches and host syncs of one forward per network, counted without a GPU",
                        "hsmla_med.bench.census:main"),
    "scanner-shift": Benchmark("which part of the perturbed 'other scanner' MRI (geometry, bias field, noise) costs a checkpoint its Dice",
                               "hsmla_med.bench.scanner_shift:main"),
    "dicom-node": Benchmark("a CT from Orthanc through hsmla-med serve to its DICOM SEG in Orthanc against infer, and 20 series queued",
                            "hsmla_med.bench.dicom_node:main"),
    "slide-features": Benchmark("patch features per second on the CPU: the HSMLA-B0 classifier, a timm ViT-S/16 and a ResNet-50 on the same slides",
                                "hsmla_med.bench.slide_features:main"),
    "monai-wsi": Benchmark("MONAI's WSIReader and MaskedPatchWSIDataset against hsmla-med's patch reader and grid", "hsmla_med.bench.monai_wsi:main"),
}
