"""The DICOM node against ``infer``: how long a CT takes from the PACS to its DICOM SEG back in the
PACS, and how many series an hour the node delivers with a queue, against ``hsmla-med infer``
on the same series exported to a folder. A real Orthanc plays the PACS
(:mod:`hsmla_med.bench.orthanc`; Debian's ``orthanc`` package), the node runs as a hospital
runs it (``hsmla-med serve`` in a process of its own), and the network is BTCV's HSMLA-B0 with
random weights (:func:`hsmla_med.bench.volume._checkpoint`: the time of a trained one).

    hsmla-med bench --only dicom-node [--slices 300] [--rounds 3] [--series 20] [--series-slices 30]
                                      [--stable-after 2] [--workers 1 2] [--out DIR]

**Latency.** One 512 x 512 x ``--slices`` CT series (int16, one file per slice, the ``volume``
benchmark's phantom), uploaded to Orthanc once. Each round, interleaved so that load from
elsewhere hits every path alike:

- ``infer`` (command): ``hsmla-med infer --output-format dicom-seg`` on the series' folder, a
  fresh process: what a user waits for, start-up (imports, model) included;
- ``infer`` (prediction): the same prediction in a fresh process, timed from the model loaded
  to the SEG written, twice: the first (the process's first forward passes, and imports made on
  first use, such as highdicom's) and a warm one, the work the node repeats for each series, its
  model loaded once at start (:func:`_predictions`: the node's own calls, ``Task.load`` and
  ``Task.predict`` with the options ``infer`` and the node give it);
- the node: Orthanc sends the series to the node (its REST ``/modalities/{id}/store``, which
  returns once the node has acknowledged, and so stored, the last instance); from then until the
  SEG is in Orthanc's study. Minus ``stable_after_s``, it is compared with the warm prediction:
  the target is at most 10% more.

**Throughput.** ``--series`` series of 512 x 512 x ``--series-slices`` (each its own study),
uploaded to Orthanc, then sent to the node in one request (one association, as the node's test
of many series does), for each ``--workers``: from the request until every SEG is in Orthanc;
against one ``hsmla-med infer`` process over a folder holding the same series (one model load,
series after series). ``jobs_s``: the node's jobs' own times summed (claimed to sent, from its
log), the rest being the wait for the series to be stable and the queue's hand-over.

Prints the tables and writes ``dicom_node_latency.csv`` and ``dicom_node_throughput.csv`` to
``--out``; the series, Orthanc's storage and the node's spool live in a temporary folder.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from hsmla_med.bench.common import markdown, out_folder, own_parser, positive_int, write_csv

NODE_AET = "HSMLA"
SIDE = 512
_JOB_DONE = re.compile(r"\] job \d+ .*: SEG .* sent to .*\((\d+(?:\.\d+)?) s\)$")  # a worker's line of a job sent, with its time


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _series(folder: Path, slices: int, seed: int) -> Path:
    """A 512 x 512 x ``slices`` CT series in ``folder`` (UIDs from ``seed``); the folder."""
    from hsmla_med.bench.volume import _affine, _volume
    from hsmla_med.data.synthetic.dicom_series import write_ct_series

    folder.mkdir(parents=True, exist_ok=True)
    volume = _volume(folder.parent / f"{folder.name}.nii.gz", (SIDE, SIDE, slices))
    write_ct_series(folder, volume, _affine(), np.random.default_rng(seed), f"bench{seed}", "benchmark CT")
    (folder.parent / f"{folder.name}.nii.gz").unlink()
    return folder


def _infer_command(checkpoint: Path, source: Path, out: Path) -> float:
    """Wall seconds of ``hsmla-med infer`` on ``source`` into DICOM SEG, in a fresh process."""
    cmd = [sys.executable, "-m", "hsmla_med.cli", "infer", "--task", "btcv", "--checkpoint", str(checkpoint), "--input", str(source),
           "--output", str(out), "--output-format", "dicom-seg"]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode:
        raise RuntimeError(f"hsmla-med infer failed:\n{result.stderr[-3000:]}")
    return seconds


def _predictions(checkpoint: str, source: str, out: str, repeats: int = 2) -> list[float]:
    """Seconds of ``repeats`` predictions of ``source`` into DICOM SEG in this process (the
    benchmark runs it in a fresh one), as the node makes them (``load_models``, ``run_job``)."""
    from hsmla_med.pipelines import get_task
    from hsmla_med.pipelines.task import InferenceOptions

    task = get_task("btcv")
    module, _ = task.load(checkpoint)
    options = InferenceOptions(device="cpu", output_formats=("dicom-seg",), progress=lambda _: None,
                               **task.inference_values({}, [checkpoint], lambda line: None))
    seconds = []
    for i in range(repeats):
        started = time.perf_counter()
        task.predict(module, Path(source), Path(out) / str(i), options)
        seconds.append(time.perf_counter() - started)
    return seconds


def _predictions_apart(checkpoint: Path, source: Path, out: Path) -> list[float]:
    """:func:`_predictions` in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "hsmla_med.bench.dicom_node", str(checkpoint), str(source), str(out)],
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"prediction failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _seg_uids(pacs, studies: list[str]) -> set[str]:
    """The SOP Instance UIDs of the SEG instances in Orthanc's ``studies`` (its IDs)."""
    found = set()
    for study in studies:
        for series in pacs.series(study):
            if series["MainDicomTags"].get("Modality") == "SEG":
                found.update(series["Instances"])
    return found


def _wait_segs(pacs, studies: list[str], before: set[str], count: int, timeout: float, node) -> float:
    """Until ``count`` SEG instances that were not in ``before`` are in ``studies``; the time.time() then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(_seg_uids(pacs, studies) - before) >= count:
            return time.time()
        if node.process.poll() is not None:
            raise RuntimeError(f"the node ended:\n{node.text()[-3000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"no {count} new SEG(s) in Orthanc after {timeout:.0f} s; node log:\n{node.text()[-3000:]}")


class _Bench:
    """Orthanc and the node's configuration in one temporary folder."""

    def __init__(self, root: Path, checkpoint: Path, stable_after: float) -> None:
        from hsmla_med.bench.orthanc import Orthanc, free_port

        self.root, self.checkpoint, self.stable_after = root, checkpoint, stable_after
        self.port = free_port()
        self.pacs = Orthanc(root / "orthanc", modalities={"node": (NODE_AET, "127.0.0.1", self.port)}).start()
        self.runs = 0

    def node(self, workers: int):
        """A node process with ``workers``, ready; its spool is the run's own."""
        from hsmla_med.bench.orthanc import NodeProcess

        self.runs += 1
        config = self.root / f"node{self.runs}.yaml"
        config.write_text(yaml.safe_dump({
            "ae_title": NODE_AET, "port": self.port, "spool": f"spool{self.runs}", "stable_after_s": self.stable_after, "workers": workers,
            "device": "cpu", "accept": [{"ae_title": self.pacs.aet, "hosts": ["127.0.0.1"]}],
            "routes": [{"name": "ct", "match": {"Modality": "CT"}, "task": "btcv", "checkpoint": str(self.checkpoint)}],
            "destinations": [{"name": "pacs", "type": "dimse", "ae_title": self.pacs.aet, "host": "127.0.0.1", "port": self.pacs.dicom_port}],
        }))
        node = NodeProcess(config, self.root / f"node{self.runs}.log")
        node.wait_ready(self.port, NODE_AET, self.pacs.aet, timeout=300)
        return node

    def upload(self, folder: Path) -> tuple[str, str]:
        """The series' files into Orthanc; its study and series IDs."""
        answers = self.pacs.upload(sorted(p for p in folder.iterdir() if p.is_file()))  # the files have random names, no suffix
        return answers[0]["ParentStudy"], answers[0]["ParentSeries"]

    def send(self, node, series: list[str], studies: list[str], timeout: float) -> tuple[float, float]:
        """Orthanc sends ``series`` to the node; the seconds of the sending (until the last instance
        is acknowledged) and from then until a new SEG of each is in Orthanc."""
        before = _seg_uids(self.pacs, studies)
        started = time.time()
        self.pacs.post("/modalities/node/store", {"Resources": series, "Synchronous": True})
        stored = time.time()
        return stored - started, _wait_segs(self.pacs, studies, before, len(series), timeout, node) - stored

    def stop(self) -> None:
        self.pacs.stop()


def latency(bench: _Bench, source: Path, rounds: int) -> list[dict]:
    """Rows per round: ``infer`` (command and prediction) on ``source`` and the node's latency."""
    study, series = bench.upload(source)
    node = bench.node(workers=1)
    rows = []
    try:
        for r in range(rounds):
            command = _infer_command(bench.checkpoint, source, bench.root / f"infer{r}")
            first, warm = _predictions_apart(bench.checkpoint, source, bench.root / f"predict{r}")
            sending, seg = bench.send(node, [series], [study], timeout=20 * command + 600)
            rows.append({"round": r + 1, "infer_command_s": round(command, 1), "prediction_first_s": round(first, 1),
                         "prediction_warm_s": round(warm, 1), "node_sending_s": round(sending, 1), "node_last_instance_to_seg_s": round(seg, 1),
                         "node_minus_stable_after_s": round(seg - bench.stable_after, 1),
                         "ratio_to_warm_prediction": round((seg - bench.stable_after) / warm, 3),
                         "ratio_to_command": round((seg - bench.stable_after) / command, 3)})
            print(f"  round {r + 1}: infer {command:.1f} s (prediction {first:.1f} s, warm {warm:.1f} s); node {seg:.1f} s after the "
                  f"last instance (sending {sending:.1f} s)", flush=True)
    finally:
        node.stop()
    return rows


def throughput(bench: _Bench, folders: list[Path], workers: list[int]) -> list[dict]:
    """One ``infer`` over the folder of ``folders`` (the series, each in its own), then the node with
    each ``workers``: seconds and series per hour."""
    (together,) = {folder.parent for folder in folders}
    command = _infer_command(bench.checkpoint, together, bench.root / "infer-all")
    rows = [{"path": f"hsmla-med infer over a folder of {len(folders)} series (1 process)", "seconds": round(command, 1),
             "series_per_hour": round(3600 * len(folders) / command), "relative": 1.0, "jobs_s": None}]
    print(f"  infer over {len(folders)} series: {command:.1f} s", flush=True)
    uploaded = [bench.upload(folder) for folder in folders]
    studies, series = [s for s, _ in uploaded], [s for _, s in uploaded]
    for n in workers:
        node = bench.node(workers=n)
        try:
            sending, seg = bench.send(node, series, studies, timeout=20 * command + 600)
        finally:
            node.stop()
        seconds = sending + seg
        jobs = sum(float(m.group(1)) for m in map(_JOB_DONE.search, node.text().splitlines()) if m)
        rows.append({"path": f"node, workers: {n} (request to the last SEG in Orthanc)", "seconds": round(seconds, 1),
                     "series_per_hour": round(3600 * len(folders) / seconds), "relative": round(command / seconds, 3),
                     "jobs_s": round(jobs, 1)})
        print(f"  node, {n} worker(s): {seconds:.1f} s (sending {sending:.1f} s)", flush=True)
    return rows


def main(argv: list[str]) -> int:
    from hsmla_med.bench.orthanc import MISSING, ORTHANC

    parser = own_parser("dicom-node", __doc__)
    parser.add_argument("--slices", type=positive_int, default=300, help="slices of the latency CT, 512 x 512 each (default 300)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="latency rounds (default 3)")
    parser.add_argument("--series", type=positive_int, default=20, help="series queued at once for the throughput (default 20)")
    parser.add_argument("--series-slices", type=positive_int, default=30, help="slices of each of those series (default 30)")
    parser.add_argument("--stable-after", type=_positive_float, default=2.0, help="the node's stable_after_s (default 2)")
    parser.add_argument("--workers", type=positive_int, nargs="+", default=[1, 2], help="the node's workers in the throughput runs (default 1 2)")
    parser.add_argument("--out", type=out_folder, default=Path("."), help="folder for the CSV tables (default: here)")
    args = parser.parse_args(argv)
    if not ORTHANC.exists():
        print(f"hsmla-med bench --only dicom-node: {MISSING}", file=sys.stderr)
        return 2
    from hsmla_med.bench.volume import _checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bench = _Bench(root, _checkpoint(root / "b0.ckpt"), args.stable_after)
        try:
            print(f"latency: a 512 x 512 x {args.slices} CT series, {args.rounds} round(s)", flush=True)
            late = latency(bench, _series(root / "ct", args.slices, seed=0), args.rounds)
            print(f"throughput: {args.series} series of 512 x 512 x {args.series_slices}", flush=True)
            folders = [_series(root / "many" / f"series{i:02d}", args.series_slices, seed=1 + i) for i in range(args.series)]
            through = throughput(bench, folders, args.workers)
        finally:
            bench.stop()
    summary = {key: statistics.median(row[key] for row in late) for key in late[0] if key != "round"}
    write_csv(args.out / "dicom_node_latency.csv", late)
    write_csv(args.out / "dicom_node_throughput.csv", through)
    print(f"\nlatency, a 512 x 512 x {args.slices} CT, stable_after_s {args.stable_after:g} (target: node minus stable_after_s "
          f"<= 1.1 x the warm prediction)\n\n{markdown(late)}\n\nmedians: {json.dumps(summary)}\n")
    print(f"throughput, {args.series} series of 512 x 512 x {args.series_slices}\n\n{markdown(through)}")
    return 0


if __name__ == "__main__":
    print(json.dumps(_predictions(sys.argv[1], sys.argv[2], sys.argv[3])))
