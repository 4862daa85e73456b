"""The DICOM node's other deliverables against a real Orthanc (hsmla_med/bench/orthanc.py), no mocks:
``infer`` on one study pulled by DICOMweb (QIDO-RS, WADO-RS) with its SEG stored back (STOW-RS
and C-STORE); a route's structured report of the volumes, read back from Orthanc by highdicom;
many series queued at once, each delivered once. And the SEG UID that a caller fixes before the
prediction (the node, when it queues a job), which needs no Orthanc."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pydicom
import pytest
import yaml

from hsmla_med.bench.orthanc import MISSING, ORTHANC, Orthanc, dicomweb_plugin, free_port
from tests.test_serve import LABEL_NAMES, ct_series, seg_series, wait_for

@pytest.fixture(scope="module")
def pacs(tmp_path_factory):
    if not ORTHANC.exists() or dicomweb_plugin() is None:
        pytest.skip(f"{MISSING}; its DICOMweb plugin too")
    root = tmp_path_factory.mktemp("orthanc")
    orthanc = Orthanc(root, modalities={})
    orthanc.start()
    try:
        yield orthanc
    finally:
        orthanc.stop()


def test_seg_gets_the_uid_given_before_the_prediction(tmp_path, capsys, tiny_btcv_checkpoint):
    """``InferenceOptions.seg_uids`` (what the node's worker passes): the SEG of the series has
    that UID, also when predicted again; bad UIDs, and one UID for two cases, are refused."""
    from hsmla_med.errors import InputError
    from hsmla_med.pipelines import get_task
    from hsmla_med.pipelines.task import InferenceOptions

    files = ct_series(tmp_path / "in" / "a")
    series = str(pydicom.dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID)
    task = get_task("btcv")
    module, _ = task.load(tiny_btcv_checkpoint)
    options = InferenceOptions(output_formats=("dicom-seg",), seg_uids={series: "1.2.826.0.1.3680043.10.1.7"}, progress=lambda _: None)
    for run in ("first", "again"):
        (seg,) = [p for p in task.predict(module, tmp_path / "in", tmp_path / run, options) if p.name.endswith(".seg.dcm")]
        segmentation = pydicom.dcmread(seg)
        assert segmentation.SOPInstanceUID == "1.2.826.0.1.3680043.10.1.7"
        assert segmentation.SeriesInstanceUID == pydicom.dcmread(tmp_path / "first" / seg.name).SeriesInstanceUID  # derived from it

    with pytest.raises(InputError, match=r"seg_uids: 'not-a-uid' is no valid DICOM UID"):
        InferenceOptions(seg_uids={series: "not-a-uid"})
    with pytest.raises(InputError, match="one SOP Instance UID given to several series"):
        InferenceOptions(seg_uids={series: "1.2.3", "1.2.4": "1.2.3"})
    for f in files:  # the same series in a second input folder: two cases, one SEG UID
        (tmp_path / "copy").mkdir(exist_ok=True)
        (tmp_path / "copy" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(InputError, match=f"series {series}: found in several cases"):
        task.predict(module, [tmp_path / "in", tmp_path / "copy"], tmp_path / "twice", options)


def test_infer_on_a_dicomweb_study_stores_its_seg_back(pacs, tmp_path, tiny_btcv_checkpoint):
    """``infer --input dicomweb:URL --study UID --send dicomweb:URL --send dimse:...``: the study's
    series retrieved under OUTPUT/<Study>/<Series>/, its SEG in Orthanc's study once (both sends
    store the same object), with the labels of infer on the series' folder."""
    from hsmla_med.cli import main
    from hsmla_med.io.dicom import find_series
    from hsmla_med.io.dicom_seg import read_seg

    files = ct_series(tmp_path / "series", seed=11)
    source = pydicom.dcmread(files[0], stop_before_pixels=True)
    study = pacs.upload(files)[0]["ParentStudy"]
    web = f"dicomweb:{pacs.url}/dicom-web"
    assert main(["infer", "--checkpoint", tiny_btcv_checkpoint, "--input", web, "--study", source.StudyInstanceUID, "--output",
                 str(tmp_path / "pulled"), "--output-format", "dicom-seg", "--send", web,
                 "--send", f"dimse:{pacs.aet}@127.0.0.1:{pacs.dicom_port}"]) == 0
    pulled = tmp_path / "pulled" / source.StudyInstanceUID / source.SeriesInstanceUID
    assert sorted(p.name for p in pulled.iterdir()) == sorted(f"{pydicom.dcmread(f).SOPInstanceUID}.dcm" for f in files)
    (seg,) = seg_series(pacs, study)
    (instance,) = seg["Instances"]

    assert main(["infer", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "series"), "--output", str(tmp_path / "folder"),
                 "--output-format", "dicom-seg"]) == 0
    (by_folder,) = (tmp_path / "folder").glob("*.seg.dcm")
    (series,) = find_series(tmp_path / "series")
    labels = read_seg(pacs.download(instance, tmp_path / "stored.seg.dcm"), series.files, LABEL_NAMES)
    assert labels.any()
    np.testing.assert_array_equal(labels, read_seg(by_folder, series.files, LABEL_NAMES))


def test_infer_refuses_bad_dicomweb_inputs_and_destinations_in_one_line(pacs, tmp_path, capsys, tiny_btcv_checkpoint):
    from tests.conftest import cli_error

    web = f"dicomweb:{pacs.url}/dicom-web"
    base = ["infer", "--checkpoint", tiny_btcv_checkpoint, "--output", str(tmp_path / "out")]
    bad = {
        "--input dicomweb:ftp://pacs/dicom-web: 'ftp://pacs/dicom-web' is no http:// or https:// URL":
            ["--input", "dicomweb:ftp://pacs/dicom-web", "--study", "1.2.3"],
        f"--study 1.2.3.999: no such study at {web}": ["--input", web, "--study", "1.2.3.999"],
        "--input dicomweb:URL needs --study UID": ["--input", web],
        "--study: only with --input dicomweb:URL": ["--input", str(tmp_path), "--study", "1.2.3"],
        "--send: sends the DICOM SEG results; add --output-format dicom-seg": ["--input", web, "--study", "1.2.3", "--send", web],
        "--send ftp://pacs: use dicomweb:": ["--input", web, "--study", "1.2.3", "--output-format", "dicom-seg", "--send", "ftp://pacs"],
        "--send dimse:PACS@host:99999: use dicomweb:": ["--input", web, "--study", "1.2.3", "--output-format", "dicom-seg",
                                                        "--send", "dimse:PACS@host:99999"],
    }
    for expected, argv in bad.items():
        assert f"hsmla-med: error: {expected}" in cli_error(capsys, base + argv), expected
    assert "--send: task endovis writes no DICOM results to send" in cli_error(
        capsys, ["infer", "--task", "endovis", "--checkpoint", "x.ckpt", "--input", web, "--study", "1.2.3", "--output", str(tmp_path / "o"),
                 "--send", web])
    assert not (tmp_path / "out").exists()  # refused before any folder was made


def test_infer_help_loads_no_dicom_networking():
    from tests.conftest import modules_loaded_by

    assert modules_loaded_by([["infer", "--help"]], {"pynetdicom", "dicomweb_client", "requests", "pydicom", "torch"}) == []


def _node(pacs: Orthanc, folder: Path, checkpoint: str, workers: int = 1, **route):
    """A node in this process (its ``workers`` processes of their own) that Orthanc knows as
    modality ``node``, sending by STOW-RS to Orthanc, its one route taking every CT series (with
    ``route``'s options)."""
    from hsmla_med.serve.config import load_node_config
    from hsmla_med.serve.node import Node

    port = free_port()
    pacs.request("PUT", "/modalities/node", {"AET": "STUDYNODE", "Host": "127.0.0.1", "Port": port})
    (folder / "node.yaml").write_text(yaml.safe_dump({
        "ae_title": "STUDYNODE", "port": port, "spool": "spool", "stable_after_s": 0.5, "workers": workers,
        "accept": [{"ae_title": pacs.aet}], "routes": [{"name": "ct", "match": {"Modality": "CT"}, "checkpoint": checkpoint, **route}],
        "destinations": [{"type": "dicomweb", "name": "web", "url": f"{pacs.url}/dicom-web"}]}))
    node = Node(load_node_config(folder / "node.yaml"))
    node.start()
    return node


def test_structured_report_holds_each_segments_volume_in_ml(pacs, tmp_path, tiny_btcv_checkpoint):
    """A route with ``structured_report: true``: Orthanc's study gets a Comprehensive 3D SR
    (TID 1500) beside the SEG, whose volumes, read by highdicom, are the SEG's voxel counts
    times the voxel's volume, each group referencing its segment of that SEG."""
    import highdicom as hd

    from hsmla_med.io.dicom import find_series
    from hsmla_med.io.dicom_seg import read_seg

    node = _node(pacs, tmp_path, tiny_btcv_checkpoint, structured_report=True)
    try:
        files = ct_series(tmp_path / "series", seed=12)
        answers = pacs.upload(files)
        study = answers[0]["ParentStudy"]
        pacs.push("node", answers[0]["ParentSeries"])
        (seg,) = wait_for("SEG in Orthanc", lambda: seg_series(pacs, study))
        (report,) = wait_for("SR in Orthanc", lambda: [s for s in pacs.series(study) if s["MainDicomTags"].get("Modality") == "SR"])
    finally:
        node.stop()
    seg_file = pacs.download(seg["Instances"][0], tmp_path / "stored.seg.dcm")
    sr = hd.sr.srread(pacs.download(report["Instances"][0], tmp_path / "stored.sr.dcm"))
    (series,) = find_series(tmp_path / "series")
    labels = read_seg(seg_file, series.files, LABEL_NAMES)
    spacing = (0.8, 0.9, 2.5)  # tests/test_dicom_seg.py write_series's default grid
    segments = {int(s.SegmentNumber): str(s.SegmentLabel) for s in pydicom.dcmread(seg_file).SegmentSequence}
    groups = sr.content.get_volumetric_roi_measurement_groups()
    assert len(groups) == len(segments) >= 1
    for group in groups:
        referenced = group.referenced_segment
        assert referenced.referenced_sop_instance_uid == pydicom.dcmread(seg_file).SOPInstanceUID
        (number,) = referenced.referenced_segment_numbers
        (volume,) = group.get_measurements()
        assert (volume.name.meaning, volume.unit.value, group.tracking_identifier) == ("Volume", "mL", segments[number])
        expected = np.count_nonzero(labels == LABEL_NAMES.index(segments[number])) * np.prod(spacing) / 1000
        assert volume.value == pytest.approx(expected, rel=1e-6)


N_SERIES = 20


def test_many_series_queued_at_once_are_each_delivered_once(pacs, tmp_path, capfd, tiny_btcv_checkpoint):
    """N_SERIES small series (8 slices of 32 x 32) pushed at once, in one C-STORE association, to
    a node with two worker processes: Orthanc ends with one SEG per series, each the UID of its
    job, each job ran once and was delivered once, and both workers ran jobs."""
    from hsmla_med.serve.queue import QUEUE_FILE, JobQueue
    from tests.conftest import phantom
    from tests.test_dicom_seg import write_series

    uploaded = []
    for i in range(N_SERIES):
        image, _ = phantom((32, 32, 8), np.random.default_rng(100 + i))
        uploaded += pacs.upload(write_series(tmp_path / "series" / str(i), image))
    studies = sorted({a["ParentStudy"] for a in uploaded})
    series = sorted({a["ParentSeries"] for a in uploaded})
    assert len(series) == N_SERIES
    node = _node(pacs, tmp_path, tiny_btcv_checkpoint, workers=2)
    started = time.monotonic()
    try:
        pacs.post("/modalities/node/store", {"Resources": series, "Synchronous": True})
        queue = JobQueue(tmp_path / "spool" / QUEUE_FILE, create=False)
        wait_for(f"{N_SERIES} sent jobs", lambda: queue.counts()["sent"] == N_SERIES, timeout=300, every=0.5)
    finally:
        node.stop()
    elapsed = time.monotonic() - started
    jobs = queue.jobs(limit=100)
    assert queue.counts() == {"received": 0, "running": 0, "sent": N_SERIES, "failed": 0}
    assert all(job.attempts == 1 for job in jobs)
    assert sorted(d for job in jobs for d in queue.deliveries(job.id)) == sorted(("web", job.seg_uid) for job in jobs)
    stored = [pacs.get(f"/instances/{i}/simplified-tags")["SOPInstanceUID"]
              for study in studies for s in seg_series(pacs, study) for i in s["Instances"]]
    assert sorted(stored) == sorted(job.seg_uid for job in jobs)
    assert len({job.series_uid for job in jobs}) == N_SERIES
    sent = [line for line in capfd.readouterr().err.splitlines() if " sent to web (" in line]
    assert len(sent) == N_SERIES and {line.split("]")[0] for line in sent} == {"hsmla-med: [worker 0", "hsmla-med: [worker 1"}
    print(f"{N_SERIES} series predicted and delivered in {elapsed:.1f} s")
