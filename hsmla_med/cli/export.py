"""``hsmla-med export``: a checkpoint's network as ONNX, TorchScript or a MONAI Bundle."""

from __future__ import annotations

from pathlib import Path

from hsmla_med.cli.invocation import Invocation
from hsmla_med.pipelines import tasks_with


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint's network: ONNX, TorchScript or a MONAI Bundle",
                       description="Export the network of a checkpoint for deployment (docs/deployment.md): --format onnx writes OUTPUT/model.onnx "
                       "(opset 18), torchscript OUTPUT/model.ts (traced; hsmla-med infer --checkpoint takes it), bundle a MONAI "
                       f"Bundle in OUTPUT (configs/, models/model.ts, models/model.pt, docs/README.md; tasks {' and '.join(tasks_with('bundle'))}). The batch axis is "
                       "dynamic, and so are ONNX's spatial axes (traced at the checkpoint's sliding-window size or --input-size; export.json "
                       "records the range proven); TorchScript keeps the size it was traced at. Each graph is checked against the PyTorch network "
                       "(max |logit difference| <= 1e-4) before it is written; OUTPUT/export.json records the figures.")
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by train (best.ckpt or last.ckpt)")
    p.add_argument("--format", required=True, choices=["onnx", "torchscript", "bundle"], help="onnx | torchscript | bundle")
    p.add_argument("--output", required=True, help="folder for the exported files")
    p.add_argument("--input-size", type=int, nargs="+", metavar="N", help="spatial size the graph is traced at (TorchScript's fixed size), H W (2D) or H W D (3D); default: the checkpoint's sliding-window size")


def run(args, invocation: Invocation) -> list[Path]:
    from hsmla_med.export import export, format_report

    output = invocation.writable_folder(args.output, "--output")
    written, record = export(args.checkpoint, args.format, output, args.input_size)
    print(format_report(record))
    print(f"{len(written)} file(s) in {output}: " + ", ".join(str(p.relative_to(output)) for p in written))
    return written
