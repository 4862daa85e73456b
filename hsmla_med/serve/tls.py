"""TLS for the DICOM node (DICOM PS3.15 Annex B): the context of its listening port, and the one
its workers reach TLS destinations with."""

from __future__ import annotations

import ssl

__all__ = ["server_context", "client_context"]


def server_context(tls) -> ssl.SSLContext:
    """TLS on the node's port: its certificate, and a certificate signed by ``tls.ca`` required of every peer."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    context.load_cert_chain(str(tls.certificate), str(tls.key))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls) -> ssl.SSLContext:
    """TLS towards a destination: the node's certificate, the peer's checked against ``tls.ca`` and its host name."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca))
    context.load_cert_chain(str(tls.certificate), str(tls.key))
    return context
