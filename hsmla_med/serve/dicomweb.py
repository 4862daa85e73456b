"""One study on demand, for ``infer --input dicomweb:URL --study UID``: its series found by
QIDO-RS, each retrieved by WADO-RS (dicomweb-client) into ``<folder>/<Study>/<Series>/<SOP>.dcm``,
where ``infer`` then reads it as any folder of series; and the ``--send`` destinations of
``infer`` (``dicomweb:URL``, ``dimse:AETITLE@HOST:PORT``) as the node's
:class:`~hsmla_med.serve.config.Destination`, which :func:`~hsmla_med.serve.send.send_files`
takes.

UIDs name the folders and files, so only UIDs of the standard's syntax are written (as in the
node's spool): a server's crafted UID cannot reach outside the folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from hsmla_med.errors import InputError
from hsmla_med.serve.config import Destination
from hsmla_med.serve.spool import is_uid

__all__ = ["DICOMWEB", "DIMSE", "dicomweb_url", "destination", "pull_study", "TIMEOUT_S"]

DICOMWEB, DIMSE = "dicomweb:", "dimse:"
TIMEOUT_S = 60  # a DICOMweb server silent this long is down (a series' retrieval is one request)
_URL = re.compile(r"https?://[^/\s]+(/\S*)?")
_DIMSE = re.compile(r"(?P<ae>[^@\\]{1,16})@(?P<host>[^:\s]+):(?P<port>\d{1,5})")


def dicomweb_url(value: str, option: str) -> str:
    """The base URL of ``dicomweb:URL`` (the one ``/studies`` hangs under); :class:`InputError`
    naming ``option`` for another scheme."""
    url = value[len(DICOMWEB):].rstrip("/")
    if not _URL.fullmatch(url):
        raise InputError(f"{option} {value}: {url!r} is no http:// or https:// URL (dicomweb:http://HOST:PORT/dicom-web)")
    return url


def destination(value: str) -> Destination:
    """The destination of ``--send dicomweb:URL`` or ``--send dimse:AETITLE@HOST:PORT``."""
    if value.startswith(DICOMWEB):
        return Destination(value, "dicomweb", url=dicomweb_url(value, "--send"))
    found = _DIMSE.fullmatch(value[len(DIMSE):]) if value.startswith(DIMSE) else None
    if found is None or not 0 < int(found["port"]) < 65536 or not found["ae"].strip().isprintable() or not found["ae"].isascii():
        raise InputError(f"--send {value}: use dicomweb:http://HOST:PORT/dicom-web or dimse:AETITLE@HOST:PORT "
                         "(an AE title of 1 to 16 printable ASCII characters, a port 1 to 65535)")
    return Destination(value, "dimse", found["ae"].strip(), found["host"], int(found["port"]))


def pull_study(url: str, study_uid: str, folder: Path, progress=print) -> Path:
    """Retrieve every series of study ``study_uid`` from the DICOMweb server at ``url`` into
    ``folder/<Study>/<Series>/<SOP>.dcm`` (each file written atomically; a file there already is
    replaced by the server's); returns ``folder/<Study>``. :class:`InputError` for a study the
    server does not hold, or a server that does not answer."""
    import pydicom
    import requests
    from dicomweb_client.api import DICOMwebClient

    from hsmla_med.io.atomic import atomic_path

    if not is_uid(study_uid):
        raise InputError(f"--study {study_uid!r}: no Study Instance UID (digits and dots, at most 64 characters)")
    client = DICOMwebClient(url=url, timeout=TIMEOUT_S)
    client.set_http_retry_params(retry=False)  # a server that is down: one line now, not minutes of retries
    try:
        found = client.search_for_series(study_instance_uid=study_uid)
    except requests.RequestException as err:
        raise InputError(f"--input dicomweb:{url}: QIDO-RS search for the series of study {study_uid} failed ({type(err).__name__}: {err})") from None
    series = sorted({str(pydicom.Dataset.from_json(s).get("SeriesInstanceUID", "")) for s in found})
    if not series:
        raise InputError(f"--study {study_uid}: no such study at dicomweb:{url} (QIDO-RS finds no series of it)")
    study_folder = folder / study_uid
    for uid in series:
        if not is_uid(uid):
            raise InputError(f"--input dicomweb:{url}: the server names a series of study {study_uid} {uid!r}, no Series Instance UID")
        try:
            datasets = client.retrieve_series(study_uid, uid)
        except requests.RequestException as err:
            raise InputError(f"--input dicomweb:{url}: WADO-RS retrieval of series {uid} failed ({type(err).__name__}: {err})") from None
        for ds in datasets:
            sop = str(ds.get("SOPInstanceUID", ""))
            if not is_uid(sop) or str(ds.get("SeriesInstanceUID")) != uid or str(ds.get("StudyInstanceUID")) != study_uid:
                raise InputError(f"--input dicomweb:{url}: an instance of series {uid} with no valid SOP Instance UID, or of another series")
            with atomic_path(study_folder / uid / f"{sop}.dcm") as tmp:
                ds.save_as(tmp, enforce_file_format=True)
        progress(f"series {uid} of study {study_uid}: {len(datasets)} instance(s) retrieved into {study_folder / uid}")
    return study_folder
