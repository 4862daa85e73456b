"""A real Orthanc PACS for the tests of the DICOM node: started from ``/usr/sbin/Orthanc`` with a
configuration of its own (free localhost ports for HTTP and DICOM, storage in a test folder, its
AE title, the node as a modality, the DICOMweb plugin when installed), stopped at teardown. Its
REST API (stdlib urllib) uploads instances, pushes them to a modality and lists what it holds."""

from __future__ import annotations

import json
import socket
import subprocess
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
