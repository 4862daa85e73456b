"""Sending results: DICOM files to a destination, by C-STORE over one association (pynetdicom as
SCU) or by DICOMweb STOW-RS (dicomweb-client, one request per file), tried ``retry.attempts``
times with growing waits; each attempt sends only the files not stored yet. What is left after
the last attempt is a :class:`SendError` naming the destination and the reason, which fails the
job."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from hsmla_med.serve.config import Destination, Retry

__all__ = ["SendError", "Stopped", "send_files", "TIMEOUT_S"]

log = logging.getLogger("hsmla_med")

TIMEOUT_S = 30  # association, DIMSE, network and HTTP timeouts: a peer silent this long is down
# C-STORE statuses that store the instance (PS3.4 B.2.3: success and the warnings; 0x0107/0x0116: attributes not stored)
_STORED = {0x0000, 0xB000, 0xB006, 0xB007, 0x0107, 0x0116}


class SendError(Exception):
    """Results that did not reach a destination after every attempt."""


class Stopped(Exception):
    """The node stops: a wait between attempts ends, the job stays for the next start."""


def _stow(remaining: list[Path], destination: Destination, stored: Callable[[Path], None]) -> str | None:
    """STOW-RS of each remaining file; the first problem, or ``None`` when the server stored them all."""
    import pydicom
    import requests
    from dicomweb_client.api import DICOMwebClient

    client = DICOMwebClient(url=destination.url, timeout=TIMEOUT_S)
    client.set_http_retry_params(retry=False)  # the attempts are ours (retry.attempts), with the node's waits
    for path in list(remaining):
        try:
            response = client.store_instances(datasets=[pydicom.dcmread(path)])
        except requests.RequestException as err:
            return f"STOW-RS failed ({type(err).__name__}: {err})"
        failed = response.get("FailedSOPSequence") if response is not None else None
        if failed:
            reason = failed[0].get("FailureReason")
            return f"STOW-RS refused {path.name}" + (f" (failure reason 0x{int(reason):04X})" if reason is not None else "")
        stored(path)
        remaining.remove(path)
    return None


def _c_store(remaining: list[Path], destination: Destination, calling_ae: str, tls, stored: Callable[[Path], None]) -> str | None:
    """C-STORE of each remaining file over one association; the first problem, or ``None`` when
    the destination stored them all."""
    import pydicom
    from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian
    from pynetdicom import AE

    syntaxes: dict[str, list] = {}
    for path in remaining:
        meta = pydicom.dcmread(path, stop_before_pixels=True).file_meta
        syntax = meta.TransferSyntaxUID
        # an uncompressed file is offered in both little-endian syntaxes: pynetdicom converts between them
        offered = [syntax] if syntax.is_compressed else [syntax, ExplicitVRLittleEndian, ImplicitVRLittleEndian]
        syntaxes[meta.MediaStorageSOPClassUID] = list(dict.fromkeys([*syntaxes.get(meta.MediaStorageSOPClassUID, []), *offered]))
    ae = AE(ae_title=calling_ae)
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = ae.connection_timeout = TIMEOUT_S
    for sop_class, offered in syntaxes.items():
        ae.add_requested_context(sop_class, offered)
    assoc = ae.associate(destination.host, destination.port, ae_title=destination.ae_title, tls_args=None if tls is None else (tls, destination.host))
    if assoc.is_rejected:
        return f"association rejected (is calling AE title {calling_ae} accepted there?)"
    if not assoc.is_established:
        return "no association (connection refused, aborted or timed out)"
    try:
        for path in list(remaining):
            status = assoc.send_c_store(path)
            if "Status" not in status:
                return f"no C-STORE response for {path.name} (aborted or timed out)"
            if int(status.Status) not in _STORED:
                comment = f" ({status.ErrorComment})" if "ErrorComment" in status else ""
                return f"C-STORE of {path.name} failed with status 0x{int(status.Status):04X}{comment}"
            stored(path)
            remaining.remove(path)
    finally:
        assoc.release()
    return None


def send_files(paths: Sequence[Path], destination: Destination, calling_ae: str, retry: Retry, stop: threading.Event, tls=None,
               stored: Callable[[Path], None] = lambda path: None) -> int:
    """Send ``paths`` to ``destination`` (as ``calling_ae`` by C-STORE), calling ``stored`` with
    each file the destination stored, as it does; returns the attempts it took. :class:`SendError`
    after the last failed attempt, :class:`Stopped` when ``stop`` is set during a wait.
    ``tls``: the client's :class:`ssl.SSLContext` for a DIMSE destination with ``tls``."""
    remaining = list(paths)
    waits = retry.waits()
    attempt = 0
    while True:
        attempt += 1
        try:
            if destination.type == "dicomweb":
                problem = _stow(remaining, destination, stored)
            else:
                problem = _c_store(remaining, destination, calling_ae, tls, stored)
        except (OSError, ValueError, RuntimeError) as err:  # a file pynetdicom cannot encode, a TLS failure
            problem = f"{type(err).__name__}: {err}"
        if problem is None:
            return attempt
        if attempt >= retry.attempts:
            raise SendError(f"destination {destination}: {problem} (after {attempt} attempt(s))")
        log.warning("destination %s: %s; attempt %d of %d in %.1f s", destination, problem, attempt + 1, retry.attempts, waits[attempt - 1])
        if stop.wait(waits[attempt - 1]):
            raise Stopped
