"""``hsmla-med serve`` end to end against a real Orthanc (hsmla_med/bench/orthanc.py), no mocks: a CT series
uploaded to Orthanc and pushed to the node comes back as a DICOM SEG in its study, equal to
``infer`` on the same series; peers the configuration does not name are refused at association;
damaged instances get a failure status while the node goes on; a result that finds its
destination down fails, and is delivered once when the destination is back and the job retried.

One Orthanc and one node (a process of its own, as a hospital runs it) serve the module's tests;
the node's stop by SIGTERM is checked at the end."""

from __future__ import annotations

import io
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pydicom
import pytest
import yaml

from hsmla_med.bench import orthanc
from hsmla_med.bench.orthanc import MISSING, ORTHANC, Orthanc, free_port

pytestmark = pytest.mark.skipif(not ORTHANC.exists(), reason=MISSING)

NODE_AET, SCU_AET = "HSMLA", "TESTSCU"
LABEL_NAMES = ["background", "disc", "bar"]  # tests/conftest.py LABELS, the tiny checkpoint's classes
STABLE_S = 1.5  # long enough for a test to act between Orthanc's push and the node's sending


def ct_series(folder: Path, seed: int = 3, **attributes) -> list[Path]:
    """The phantom of tests/conftest.py as a CT series (tests/test_dicom_seg.py's writer: a series
    the tiny checkpoint finds foreground in), with ``attributes`` set in every instance."""
    from tests.conftest import phantom
    from tests.test_dicom_seg import write_series

    image, _ = phantom((36, 32, 6), np.random.default_rng(seed))
    files = write_series(folder, image)
    for path in files:
        ds = pydicom.dcmread(path)
        for keyword, value in {"AccessionNumber": f"ACC{seed}", **attributes}.items():
            setattr(ds, keyword, value)
        ds.save_as(path, enforce_file_format=True)
    return files


class NodeProcess(orthanc.NodeProcess):
    """The node in a process of its own, ready when it answers this module's C-ECHO."""

    def wait_ready(self, port: int, timeout: float = 120) -> None:
        super().wait_ready(port, NODE_AET, SCU_AET, timeout)


def associate(port: int, calling: str = SCU_AET):
    """An association with the node for C-ECHO and for CT instances as their files are (Explicit
    VR Little Endian: pynetdicom's chunked sending needs the file's own transfer syntax)."""
    from pydicom.uid import ExplicitVRLittleEndian
    from pynetdicom import AE
    from pynetdicom.sop_class import CTImageStorage, Verification

    ae = AE(ae_title=calling)
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = 10
    ae.add_requested_context(Verification)
    ae.add_requested_context(CTImageStorage, ExplicitVRLittleEndian)
    return ae.associate("127.0.0.1", port, ae_title=NODE_AET)


def echo(port: int, calling: str = SCU_AET) -> int | None:
    """The C-ECHO status, ``None`` without an association."""
    return orthanc.echo(port, NODE_AET, calling)


def wait_for(what: str, check, timeout: float = 90, log=None, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"no {what} after {timeout} s" + (f"; node log:\n{log()}" if log else ""))


def seg_series(pacs: Orthanc, study: str) -> list[dict]:
    return [s for s in pacs.series(study) if s["MainDicomTags"].get("Modality") == "SEG"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_btcv_checkpoint):
    """Orthanc (which knows the node as modality ``hsmla``) and the node (which sends to Orthanc)."""
    root = tmp_path_factory.mktemp("serve")
    node_port = free_port()
    pacs = Orthanc(root / "orthanc", modalities={"hsmla": (NODE_AET, "127.0.0.1", node_port)}).start()
    config = {
        "ae_title": NODE_AET, "port": node_port, "spool": "spool", "stable_after_s": STABLE_S, "stop_grace_s": 30,
        "accept": [{"ae_title": pacs.aet, "hosts": ["127.0.0.1"]}, {"ae_title": SCU_AET}, {"ae_title": "REMOTE", "hosts": ["10.1.2.0/24"]}],
        "routes": [{"name": "abdomen-ct", "match": {"Modality": "CT", "BodyPartExamined": "ABDOMEN|"}, "checkpoint": tiny_btcv_checkpoint}],
        "destinations": [{"name": "pacs", "type": "dimse", "ae_title": pacs.aet, "host": "127.0.0.1", "port": pacs.dicom_port}],
        "retry": {"attempts": 2, "backoff_s": 0.2},
    }
    (root / "node.yaml").write_text(yaml.safe_dump(config))
    state = {"root": root, "pacs": pacs, "node": NodeProcess(root / "node.yaml", root / "node.log"), "port": node_port,
             "config": root / "node.yaml", "spool": root / "spool"}
    try:
        state["node"].wait_ready(node_port)
        yield state  # a test may replace the node (a restart)
        assert state["node"].stop() == 0, state["node"].text()
        assert "node HSMLA stopped" in state["node"].text()
    finally:
        if state["node"].process.poll() is None:
            state["node"].process.kill()
        pacs.stop()


def _push(pacs: Orthanc, files: list[Path], modality: str = "hsmla") -> tuple[str, str]:
    """Upload to Orthanc and let Orthanc send the series to the node; Orthanc's study and series IDs."""
    answers = pacs.upload(files)
    study, series = answers[0]["ParentStudy"], answers[0]["ParentSeries"]
    pacs.push(modality, series)
    return study, series


def _queue(setup):
    from hsmla_med.serve.queue import QUEUE_FILE, JobQueue

    return JobQueue(setup["spool"] / QUEUE_FILE, create=False)


def test_series_pushed_by_orthanc_comes_back_as_a_seg_equal_to_infer(setup, tmp_path, capsys, tiny_btcv_checkpoint):
    import highdicom as hd

    from hsmla_med.cli import main
    from hsmla_med.io.dicom import find_series
    from hsmla_med.io.dicom_seg import read_seg

    pacs = setup["pacs"]
    files = ct_series(tmp_path / "series", BodyPartExamined="ABDOMEN")
    source = pydicom.dcmread(files[0], stop_before_pixels=True)
    study, series = _push(pacs, files)
    (seg,) = wait_for("SEG in Orthanc", lambda: seg_series(pacs, study), log=setup["node"].text)
    (instance,) = seg["Instances"]
    seg_file = pacs.download(instance, tmp_path / "node.seg.dcm")

    segmentation = hd.seg.segread(seg_file)
    assert segmentation.StudyInstanceUID == source.StudyInstanceUID  # in the study of its series
    assert [str(s.SeriesInstanceUID) for s in segmentation.ReferencedSeriesSequence] == [source.SeriesInstanceUID]

    # infer on the series as Orthanc exports it, into a folder
    for i, uid in enumerate(pacs.get(f"/series/{series}")["Instances"]):
        pacs.download(uid, tmp_path / "exported" / "case" / f"{i}.dcm")
    assert main(["infer", "--checkpoint", tiny_btcv_checkpoint, "--input", str(tmp_path / "exported"), "--output", str(tmp_path / "infer"),
                 "--output-format", "dicom-seg"]) == 0
    (by_infer,) = (tmp_path / "infer").glob("*.seg.dcm")
    (exported,) = find_series(tmp_path / "exported" / "case")
    labels = read_seg(seg_file, exported.files, LABEL_NAMES)
    assert labels.any()
    np.testing.assert_array_equal(labels, read_seg(by_infer, exported.files, LABEL_NAMES))

    job = next(j for j in _queue(setup).jobs() if j.series_uid == source.SeriesInstanceUID)
    assert (job.state, job.attempts, job.seg_uid, job.accession) == ("sent", 1, segmentation.SOPInstanceUID, "ACC3")
    assert not (setup["spool"] / "jobs" / job.folder).exists()  # a sent job's files are gone
    capsys.readouterr()
    assert main(["serve", "status", "--config", str(setup["config"])]) == 0
    assert "0 received, 0 running, 1 sent, 0 failed" in capsys.readouterr().out
    log = setup["node"].text()
    assert f"job {job.id} (series {source.SeriesInstanceUID} of study {source.StudyInstanceUID}, accession ACC3)" in log
    assert "P001" not in log and "Phantom" not in log  # never the patient


def test_a_series_no_route_takes_is_logged_without_the_patient_and_left(setup, tmp_path):
    files = ct_series(tmp_path / "mr", seed=4, Modality="MR")
    source = pydicom.dcmread(files[0], stop_before_pixels=True)
    _push(setup["pacs"], files)
    line = f"series {source.SeriesInstanceUID} of study {source.StudyInstanceUID} (accession ACC4; MR"
    wait_for("log line of the unrouted series", lambda: line in setup["node"].text(), log=setup["node"].text)
    assert "no route takes it; left in the spool" in setup["node"].text().split(line, 1)[1].splitlines()[0]
    assert len(list((setup["spool"] / source.StudyInstanceUID / source.SeriesInstanceUID).glob("*.dcm"))) == len(files)
    assert all(j.series_uid != source.SeriesInstanceUID for j in _queue(setup).jobs(limit=100))


def test_peers_the_configuration_does_not_name_are_refused_at_association(setup):
    port = setup["port"]
    assert echo(port) == 0
    for calling in ("INTRUDER", "REMOTE"):  # unknown; known but only from 10.1.2.0/24
        assoc = associate(port, calling)
        assert assoc.is_rejected and not assoc.is_established
    assert "association from 'INTRUDER' at 127.0.0.1 refused" in setup["node"].text()
    assert echo(port) == 0


def _listening_addresses(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on ``port`` (Linux's /proc/net/tcp and
    tcp6: the kernel's own table, whoever opened them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                if len(address) == 8:  # IPv4, little-endian
                    found.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="no /proc/net/tcp (not Linux)")
def test_nothing_listens_beyond_the_configured_address(setup):
    """The node's configuration names no bind address: it listens on 127.0.0.1 alone, not on
    every interface (0.0.0.0), so another machine cannot reach it."""
    assert _listening_addresses(setup["port"]) == ["127.0.0.1"]


def _instance_file(tmp_path: Path, cut: int | None = None, garbage: bool = False, pixels: bool = True) -> tuple[Path, str]:
    """A CT instance's file: whole, its data set cut ``cut`` bytes short, or garbage after the file meta."""
    path = ct_series(tmp_path / f"bad-{cut}-{garbage}-{pixels}", seed=5)[0]
    ds = pydicom.dcmread(path)
    if not pixels:
        del ds.PixelData
    buffer = io.BytesIO()
    ds.save_as(buffer, enforce_file_format=True)
    raw = buffer.getvalue()
    meta_end = 132 + 12 + int.from_bytes(raw[140:144], "little")  # preamble, DICM, (0002,0000) group length element, the group
    if garbage:
        raw = raw[:meta_end] + bytes(range(256)) * 4
    elif cut:
        raw = raw[:-cut]
    path.write_bytes(raw)
    return path, str(ds.SOPInstanceUID)


def test_a_full_spool_refuses_with_out_of_resources_and_leaves_no_half_file(tmp_path, monkeypatch):
    """The disk fills while an instance is written (the kernel's ENOSPC, raised where the write is
    made durable): the C-STORE answer is 0xA700 (out of resources) naming the folder, and neither
    the instance nor a temporary of it stays in the spool."""
    import errno
    import os

    from hsmla_med.serve import spool as spool_module
    from hsmla_med.serve.spool import OUT_OF_RESOURCES, Refused, Spool

    path, uid = _instance_file(tmp_path)
    ds = pydicom.dcmread(path)
    spool = Spool(tmp_path / "spool")
    spool.prepare()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(spool_module.os, "fsync", full)
    with pytest.raises(Refused) as refused:
        spool.store(path.read_bytes(), ds.SOPClassUID, uid)
    assert refused.value.status == OUT_OF_RESOURCES and "No space left on device" in str(refused.value)
    assert [p for p in (tmp_path / "spool").rglob("*") if p.is_file()] == []
    monkeypatch.undo()
    stored, _ = spool.store(path.read_bytes(), ds.SOPClassUID, uid)  # space again: the same instance is taken
    assert stored.read_bytes() == path.read_bytes()


def test_damaged_instances_get_a_failure_status_and_the_node_goes_on(setup, tmp_path, monkeypatch):
    """Sent as their bytes (pynetdicom's chunked sending does not parse the file): a truncated
    instance, garbage after the file meta, and a CT instance without pixel data."""
    from pynetdicom import _config

    monkeypatch.setattr(_config, "STORE_SEND_CHUNKED_DATASET", True)
    cases = {"truncated": (_instance_file(tmp_path, cut=300), 0xC000), "garbage": (_instance_file(tmp_path, garbage=True), 0xC000),
             "no pixels": (_instance_file(tmp_path, pixels=False), 0xA900)}
    for what, ((path, uid), expected) in cases.items():
        assoc = associate(setup["port"])
        assert assoc.is_established
        try:
            status = assoc.send_c_store(path)
        finally:
            assoc.release()
        assert int(status.Status) == expected, what
        refused = [line for line in setup["node"].text().splitlines() if f"of instance {uid} refused" in line]
        assert len(refused) == 1, what
        assert not list(setup["spool"].rglob(f"{uid}.dcm")), what
    assert "truncated pixel data" in setup["node"].text()
    assert echo(setup["port"]) == 0


def test_result_for_a_destination_that_is_down_is_delivered_once_when_it_is_back(setup, tmp_path, capsys):
    from hsmla_med.cli import main

    pacs, queue = setup["pacs"], _queue(setup)
    files = ct_series(tmp_path / "series", seed=6, BodyPartExamined="ABDOMEN")
    uid = pydicom.dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID
    study, _ = _push(pacs, files)
    # down at once, before the series is stable in the node: down when the result is ready (a
    # SIGTERM shutdown kept accepting for seconds under load, and the SEG arrived)
    pacs.stop(at_once=True)
    job = wait_for("failed job", lambda: next((j for j in queue.jobs("failed") if j.series_uid == uid), None), log=setup["node"].text)
    assert job.last_error.startswith("destination pacs (PACS@127.0.0.1:") and "(after 2 attempt(s))" in job.last_error
    assert queue.deliveries(job.id) == []
    capsys.readouterr()
    assert main(["serve", "status", "--config", str(setup["config"])]) == 0
    assert f"job {job.id} failed" in capsys.readouterr().out

    pacs.start()
    assert main(["serve", "retry", str(job.id), "--config", str(setup["config"])]) == 0
    wait_for("sent job", lambda: queue.job(job.id).state == "sent", log=setup["node"].text)
    (seg,) = seg_series(pacs, study)
    assert len(seg["Instances"]) == 1
    done = queue.job(job.id)
    assert done.attempts == 2 and queue.deliveries(job.id) == [("pacs", done.seg_uid)]
    # the SEG written before the outage is the one delivered, with the UID the job got when it was queued
    assert done.seg_uid == job.seg_uid == queue.job(job.id).seg_uid
    assert pacs.get(f"/instances/{seg['Instances'][0]}/simplified-tags")["SOPInstanceUID"] == done.seg_uid


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    return [int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat") if _stat_fields(stat)[1] == str(pid)]


def _stat_fields(stat: Path) -> list[str]:
    """State and parent pid of a /proc/PID/stat (after the command name, which may hold spaces)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, IndexError):
        return ["", ""]


def _state(pid: int) -> str:
    return _stat_fields(Path(f"/proc/{pid}/stat"))[0]


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="no /proc (not Linux)")
def test_node_killed_during_a_job_sends_exactly_one_seg_after_restart(setup, tmp_path):
    """kill -9 while a job runs (predicting or sending): the worker process running it ends with
    the node; the restarted node runs it again and Orthanc holds one SEG, of the UID the job got
    when it was queued (whether the SEG was written before the kill, and sent as it is, or
    predicted again)."""
    pacs, queue = setup["pacs"], _queue(setup)
    files = ct_series(tmp_path / "series", seed=7, BodyPartExamined="ABDOMEN")
    uid = pydicom.dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID
    study, _ = _push(pacs, files)
    job = wait_for("running job", lambda: next((j for j in queue.jobs("running") if j.series_uid == uid), None), every=0.01,
                   log=setup["node"].text)
    workers = _children(setup["node"].process.pid)
    assert workers  # the worker process (and multiprocessing's resource tracker)
    setup["node"].process.kill()
    setup["node"].process.wait()
    wait_for("the workers' end", lambda: not any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in workers), timeout=10)
    assert queue.job(job.id).state == "running"  # killed before it could end

    setup["node"] = NodeProcess(setup["config"], setup["root"] / "node-restarted.log")
    setup["node"].wait_ready(setup["port"])
    assert "1 job(s) of an interrupted node queued again" in setup["node"].text()
    wait_for("sent job", lambda: queue.job(job.id).state == "sent", log=setup["node"].text)
    (seg,) = seg_series(pacs, study)
    assert len(seg["Instances"]) == 1
    assert queue.job(job.id).attempts == 2
    assert pacs.get(f"/instances/{seg['Instances'][0]}/simplified-tags")["SOPInstanceUID"] == job.seg_uid == queue.job(job.id).seg_uid


def test_series_still_arriving_when_the_node_is_killed_completes_after_the_restart(setup, tmp_path, tiny_btcv_checkpoint):
    """Half a series stored, then kill -9 (the sender's association breaks); the node restarts
    and the sender sends the series again: one job of the whole series, one SEG. The half in the
    spool, older than ``stable_after_s`` by the time the node is back, is not taken for a whole
    series: its time counts from the node's start."""
    from hsmla_med.serve.queue import QUEUE_FILE, JobQueue

    pacs = setup["pacs"]
    port = free_port()
    pacs.request("PUT", "/modalities/restarted", {"AET": NODE_AET, "Host": "127.0.0.1", "Port": port})
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump({
        "ae_title": NODE_AET, "port": port, "spool": "spool", "stable_after_s": 6, "accept": [{"ae_title": pacs.aet}, {"ae_title": SCU_AET}],
        "routes": [{"name": "ct", "match": {"Modality": "CT"}, "checkpoint": tiny_btcv_checkpoint}],
        "destinations": [{"name": "pacs", "type": "dimse", "ae_title": pacs.aet, "host": "127.0.0.1", "port": pacs.dicom_port}]}))
    files = ct_series(tmp_path / "series", seed=10)
    answers = pacs.upload(files)
    study, series = answers[0]["ParentStudy"], answers[0]["ParentSeries"]
    source = pydicom.dcmread(files[0], stop_before_pixels=True)
    node = NodeProcess(config, tmp_path / "node.log")
    try:
        node.wait_ready(port)
        assoc = associate(port)
        assert assoc.is_established
        try:
            assert [int(assoc.send_c_store(f).Status) for f in files[:3]] == [0, 0, 0]
        finally:
            assoc.release()
        node.process.kill()
        node.process.wait()
        time.sleep(6)  # the half in the spool is older than stable_after_s when the node is back
        node = NodeProcess(config, tmp_path / "node-restarted.log")
        node.wait_ready(port)
        time.sleep(2)  # the sender tries again a while later, within stable_after_s of the restart
        pacs.push("restarted", series)  # the whole series
        queue = JobQueue(tmp_path / "spool" / QUEUE_FILE, create=False)
        wait_for("sent job", lambda: queue.counts()["sent"] == 1, log=node.text)
        time.sleep(1)  # a second job would have been queued by now (the scheduler looks every second)
    finally:
        node.process.kill()
        node.process.wait()
    (job,) = queue.jobs(limit=10)
    assert (job.series_uid, job.instances, job.attempts) == (source.SeriesInstanceUID, len(files), 1)
    (seg,) = seg_series(pacs, study)
    assert [pacs.get(f"/instances/{i}/simplified-tags")["SOPInstanceUID"] for i in seg["Instances"]] == [job.seg_uid]


def test_dicomweb_destination_gets_the_seg_and_a_burned_in_series(setup, tmp_path, tiny_btcv_checkpoint):
    """A node in this process, sending by STOW-RS to Orthanc's DICOMweb plugin, for a route with
    burned_in: Orthanc's study gets the SEG and a Secondary Capture series, one RGB image per
    slice, grey where the SEG has no class and coloured where it has one."""
    from hsmla_med.io.dicom import find_series
    from hsmla_med.io.dicom_seg import read_seg
    from hsmla_med.serve.config import load_node_config
    from hsmla_med.serve.node import Node

    if orthanc.dicomweb_plugin() is None:
        pytest.skip("Orthanc's DICOMweb plugin is not installed (apt-get install orthanc-dicomweb)")
    pacs, port = setup["pacs"], free_port()
    pacs.request("PUT", "/modalities/web", {"AET": "WEBNODE", "Host": "127.0.0.1", "Port": port})
    (tmp_path / "node.yaml").write_text(yaml.safe_dump({
        "ae_title": "WEBNODE", "port": port, "spool": "spool", "stable_after_s": 0.5, "accept": [{"ae_title": pacs.aet}],
        "routes": [{"name": "ct", "match": {"Modality": "CT"}, "checkpoint": tiny_btcv_checkpoint, "burned_in": True}],
        "destinations": [{"type": "dicomweb", "name": "web", "url": f"{pacs.url}/dicom-web"}]}))
    node = Node(load_node_config(tmp_path / "node.yaml"))
    node.start()
    try:
        files = ct_series(tmp_path / "series", seed=9)
        study, _ = _push(pacs, files, "web")
        (seg,) = wait_for("SEG in Orthanc", lambda: seg_series(pacs, study))
        (burned,) = wait_for("burned-in series", lambda: [s for s in pacs.series(study) if s["MainDicomTags"].get("SeriesNumber") == "301"])
        wait_for("every burned-in image", lambda: len(pacs.get(f"/series/{burned['ID']}")["Instances"]) == len(files))
    finally:
        node.stop()
    (series,) = find_series(tmp_path / "series")
    labels = read_seg(pacs.download(seg["Instances"][0], tmp_path / "web.seg.dcm"), series.files, LABEL_NAMES)
    assert labels.any()
    for instance in pacs.get(f"/series/{burned['ID']}")["Instances"]:
        image = pydicom.dcmread(pacs.download(instance, tmp_path / "sc" / f"{instance}.dcm"))
        z = int(image.InstanceNumber) - 1
        assert image.BurnedInAnnotation == "YES" and image.PhotometricInterpretation == "RGB"
        assert image.SourceImageSequence[0].ReferencedSOPInstanceUID == pydicom.dcmread(series.files[z]).SOPInstanceUID
        rgb, classes = image.pixel_array.astype(int), labels[:, :, z].T
        grey = (rgb[..., 0] == rgb[..., 1]) & (rgb[..., 1] == rgb[..., 2])
        assert grey[classes == 0].all() and not grey[classes > 0].any()


def _certificates(folder: Path) -> dict[str, Path]:
    """A certificate authority, and certificates it signs for the node and for a client (EC keys,
    the node's for IP 127.0.0.1), made with the openssl command."""
    folder.mkdir()
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=hsmla-med test CA")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("node", "client"):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
            "-extfile", "san.ext")
    return {name: folder / name for name in ("ca.pem", "node.pem", "node.key", "client.pem", "client.key")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command makes the test's certificates")
def test_tls_node_takes_tls_associations_and_refuses_plain_ones(tmp_path, tiny_btcv_checkpoint):
    """A node with a tls section, in this process: C-ECHO and C-STORE (send_files with the node's
    client context) over TLS with a certificate of its CA; a plain association gets nowhere."""
    import ssl

    from pynetdicom import AE
    from pynetdicom.sop_class import Verification

    from hsmla_med.serve.config import Destination, Retry, Tls, load_node_config
    from hsmla_med.serve.node import Node
    from hsmla_med.serve.tls import client_context
    from hsmla_med.serve.send import send_files

    certs = _certificates(tmp_path / "certs")
    port = free_port()
    (tmp_path / "node.yaml").write_text(yaml.safe_dump({
        "ae_title": NODE_AET, "port": port, "spool": "spool", "accept": [{"ae_title": SCU_AET}],
        "routes": [{"name": "ct", "match": {"Modality": "CT"}, "checkpoint": tiny_btcv_checkpoint}],
        "destinations": [{"type": "dimse", "ae_title": "PACS", "host": "127.0.0.1", "port": 4242}],
        "tls": {"certificate": str(certs["node.pem"]), "key": str(certs["node.key"]), "ca": str(certs["ca.pem"])}}))
    node = Node(load_node_config(tmp_path / "node.yaml"))
    node.start()
    try:
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs["ca.pem"]))
        client.load_cert_chain(str(certs["client.pem"]), str(certs["client.key"]))
        ae = AE(ae_title=SCU_AET)
        ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = 10
        ae.add_requested_context(Verification)
        assoc = ae.associate("127.0.0.1", port, ae_title=NODE_AET, tls_args=(client, "127.0.0.1"))
        assert assoc.is_established
        assert int(assoc.send_c_echo().Status) == 0
        assoc.release()
        assert echo(port) is None  # plain: the TLS handshake fails, no association

        # the client side of the node: its context, towards a TLS peer (here the node itself)
        files = ct_series(tmp_path / "series", seed=8)
        tls = Tls(certs["node.pem"], certs["node.key"], certs["ca.pem"])
        destination = Destination("self", "dimse", NODE_AET, "127.0.0.1", port, tls=True)
        assert send_files(files[:1], destination, SCU_AET, Retry(attempts=1), threading.Event(), client_context(tls)) == 1
        ds = pydicom.dcmread(files[0], stop_before_pixels=True)
        assert (tmp_path / "spool" / ds.StudyInstanceUID / ds.SeriesInstanceUID / f"{ds.SOPInstanceUID}.dcm").is_file()
    finally:
        node.stop()


def test_cli_refuses_bad_node_configurations_in_one_line(tmp_path, capsys, tiny_btcv_checkpoint):
    from tests.conftest import cli_error

    good = {"ae_title": "N", "port": 11112, "spool": "s", "accept": [{"ae_title": "PACS"}],
            "routes": [{"name": "r", "match": {"Modality": "CT"}, "checkpoint": tiny_btcv_checkpoint}],
            "destinations": [{"type": "dimse", "ae_title": "PACS", "host": "127.0.0.1", "port": 4242}]}
    bad = {
        "routes[0].match.Modalty: not a DICOM keyword": {"routes": [{**good["routes"][0], "match": {"Modalty": "CT"}}]},
        "routes[0].match.Modality: '(' is no regular expression": {"routes": [{**good["routes"][0], "match": {"Modality": "("}}]},
        "routes[0].checkpoint: ": {"routes": [{**good["routes"][0], "checkpoint": "missing.ckpt"}]},
        "routes[0].output_formats: must hold dicom-seg": {"routes": [{**good["routes"][0], "output_formats": ["nifti"]}]},
        "port: 70000 is out of range": {"port": 70000},
        "ae_title: 'A_TITLE_LONGER_THAN_16' is no AE title": {"ae_title": "A_TITLE_LONGER_THAN_16"},
        "accept[0].hosts[0]: 'pacs.example.org' is no IP address": {"accept": [{"ae_title": "PACS", "hosts": ["pacs.example.org"]}]},
        "destinations[0].type: 'ftp'": {"destinations": [{**good["destinations"][0], "type": "ftp"}]},
        "destinations[0].url: required key missing": {"destinations": [{"type": "dicomweb", "name": "web"}]},
        "destinations: expected a list of at least one entry": {"destinations": []},
        "stable_after_s: expected a number": {"stable_after_s": "soon"},
        "retry.attemps: unknown key": {"retry": {"attemps": 3}},
    }
    for expected, change in bad.items():
        path = tmp_path / "node.yaml"
        path.write_text(yaml.safe_dump({**good, **change}))
        assert f"{path}: {expected}" in cli_error(capsys, ["serve", "--config", str(path)]), expected
    path.write_text(yaml.safe_dump(good))
    assert "no job queue there" in cli_error(capsys, ["serve", "status", "--config", str(path)])
    assert "serve retry JOB: give the job's number" in cli_error(capsys, ["serve", "retry", "--config", str(path)])


def test_documented_node_configuration_is_valid(tmp_path, tiny_btcv_checkpoint):
    """docs/node.yaml, the README's example, reads as it says (its checkpoint replaced by one that exists)."""
    from hsmla_med.serve.config import load_node_config

    example = yaml.safe_load((Path(__file__).resolve().parents[1] / "docs" / "node.yaml").read_text())
    for route in example["routes"]:
        route["checkpoint"] = tiny_btcv_checkpoint
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(example))
    config = load_node_config(tmp_path / "node.yaml")
    (route,) = config.routes
    assert route.match["BodyPartExamined"].fullmatch("") and route.match["SeriesDescription"].fullmatch("CT ABD PORTAL VENOUS")
    assert [d.type for d in config.destinations] == ["dimse", "dicomweb"] and config.retry.waits() == [2.0, 4.0]
    assert config.admits("CT_SCANNER_1", "10.20.31.7") and not config.admits("CT_SCANNER_1", "10.20.32.7")
    assert not config.admits("ORTHANC", "10.20.0.16") and config.admits("ORTHANC", "::ffff:10.20.0.15")


def test_serve_help_loads_no_framework():
    from tests.conftest import modules_loaded_by

    assert modules_loaded_by([["serve", "--help"]], {"torch", "pynetdicom", "pydicom", "numpy", "lightning"}) == []
