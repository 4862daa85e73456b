"""A real Orthanc PACS for the DICOM node's benchmark and tests: started from ``/usr/sbin/Orthanc``
with a configuration of its own (free localhost ports for HTTP and DICOM, storage in a folder of
the caller's, its AE title, the node as a modality, the DICOMweb plugin when installed), stopped
by the caller. Its REST API (stdlib urllib) uploads instances, pushes them to a modality and lists
what it holds. And the node itself as a hospital runs it: ``hsmla-med serve`` in a process of its
own (:class:`NodeProcess`).

Here rather than under tests/ because ``hsmla-med bench --only dicom-node`` (an installed
package, without the tests) measures the node against the same Orthanc."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ORTHANC = Path("/usr/sbin/Orthanc")
# where Debian's orthanc-dicomweb installs the plugin (dpkg -L orthanc-dicomweb)
DICOMWEB_PLUGINS = (Path("/usr/share/orthanc/plugins/libOrthancDicomWeb.so"), Path("/usr/lib/orthanc/libOrthancDicomWeb.so"))
MISSING = f"{ORTHANC} is not installed (apt-get install orthanc orthanc-dicomweb)"


def free_port() -> int:
    """A TCP port free on localhost now (the OS's choice; free until someone takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dicomweb_plugin() -> Path | None:
    return next((p for p in DICOMWEB_PLUGINS if p.is_file()), None)


class Orthanc:
    """An Orthanc of its own in ``folder`` (storage, configuration, log). ``modalities``: name ->
    (AE title, host, port) of the nodes it may send to. :meth:`start` and :meth:`stop` may
    alternate: it comes back with the same ports and storage, as a PACS back from an outage."""

    def __init__(self, folder: Path, aet: str = "PACS", modalities: dict[str, tuple[str, str, int]] | None = None) -> None:
        self.folder = Path(folder)
        self.aet = aet
        self.http_port, self.dicom_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log = self.folder / "orthanc.log"
        self.process: subprocess.Popen | None = None
        plugin = dicomweb_plugin()
        self.config = {
            "Name": f"test-{aet}", "StorageDirectory": str(self.folder / "storage"), "IndexDirectory": str(self.folder / "storage"),
            "HttpPort": self.http_port, "DicomPort": self.dicom_port, "DicomAet": aet, "RemoteAccessAllowed": False,
            "AuthenticationEnabled": False, "DicomScuTimeout": 10, "StableAge": 1, "SaveJobs": False,
            "DicomModalities": {name: {"AET": a, "Host": h, "Port": p} for name, (a, h, p) in (modalities or {}).items()},
            "Plugins": [str(plugin)] if plugin else [], "DicomWeb": {"Enable": plugin is not None, "Root": "/dicom-web/"},
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "orthanc.json").write_text(json.dumps(self.config, indent=2))

    def start(self, timeout: float = 30) -> Orthanc:
        """Start it and wait until its REST API answers; a RuntimeError with its log's end if it does not."""
        with self.log.open("a") as log:
            self.process = subprocess.Popen([str(ORTHANC), str(self.folder / "orthanc.json")], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                self.get("/system")
                return self
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"Orthanc did not start in {timeout} s:\n" + self.log.read_text()[-3000:])

    def stop(self, at_once: bool = False) -> None:
        """Stop it: by SIGTERM, Orthanc's own shutdown (which may take seconds and keeps serving
        meanwhile), or ``at_once`` by SIGKILL, an outage that starts the moment this returns."""
        if self.process is not None and self.process.poll() is None and at_once:
            self.process.kill()
            self.process.wait()
        elif self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def request(self, method: str, path: str, body: bytes | dict | None = None, timeout: float = 60) -> bytes:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        request = urllib.request.Request(self.url + path, data=data, method=method)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()

    def get(self, path: str):
        return json.loads(self.request("GET", path))

    def post(self, path: str, body: bytes | dict):
        return json.loads(self.request("POST", path, body))

    def upload(self, files) -> list[dict]:
        """Store DICOM files (REST ``POST /instances``); each one's answer (``ID``, ``ParentSeries``, ``ParentStudy``)."""
        return [self.post("/instances", Path(f).read_bytes()) for f in files]

    def push(self, modality: str, resource: str) -> dict:
        """Send a study, series or instance to a modality by C-STORE, waiting for the end."""
        return self.post(f"/modalities/{modality}/store", {"Resources": [resource], "Synchronous": True})

    def series(self, study: str) -> list[dict]:
        """The series of a study (Orthanc's ID), with their ``MainDicomTags`` and ``Instances``."""
        return self.get(f"/studies/{study}/series")

    def download(self, instance: str, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.request("GET", f"/instances/{instance}/file"))
        return path


def echo(port: int, node_aet: str, calling: str) -> int | None:
    """The C-ECHO status of the node at ``port`` called by ``calling``; ``None`` without an association."""
    from pynetdicom import AE
    from pynetdicom.sop_class import Verification

    ae = AE(ae_title=calling)
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = 10
    ae.add_requested_context(Verification)
    assoc = ae.associate("127.0.0.1", port, ae_title=node_aet)
    if not assoc.is_established:
        return None
    try:
        return int(assoc.send_c_echo().Status)
    finally:
        assoc.release()


class NodeProcess:
    """``hsmla-med serve --config CONFIG`` in a process of its own, its output in ``log``."""

    def __init__(self, config: Path, log: Path, env: dict | None = None) -> None:
        self.config, self.log = config, log
        with log.open("a") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "hsmla_med.cli", "serve", "--config", str(config)], stdout=out,
                                            stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log.read_text()

    def wait_ready(self, port: int, node_aet: str, calling: str, timeout: float = 120) -> None:
        """Until it logs that it listens and answers a C-ECHO of ``calling``; an error with its log if it ends or does not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the node ended:\n{self.text()}")
            if "listening on" in self.text() and echo(port, node_aet, calling) == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the node did not answer C-ECHO in {timeout} s:\n{self.text()}")

    def stop(self) -> int:
        """SIGTERM, and its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=90)
