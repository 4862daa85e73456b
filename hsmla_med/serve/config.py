"""The node's YAML (``hsmla-med serve --config node.yaml``; docs/node.yaml is a commented
example), read into :class:`NodeConfig`. Every key is checked when the file is read, and a bad
one is a :class:`~hsmla_med.errors.ConfigError` naming the file and the key
(``node.yaml: routes[1].match.Modality: ...``); unknown keys are refused, as a misspelt key
would otherwise be a default silently kept. Relative paths are taken from the file's folder,
so that a node's folder can be moved as a whole."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsmla_med.errors import ConfigError, InputError

__all__ = ["NodeConfig", "Peer", "Route", "Destination", "Retry", "Tls", "load_node_config", "SEG_FORMAT"]

#: the output format that the node sends (a route may keep others beside it in the job's folder)
SEG_FORMAT = "dicom-seg"
DESTINATION_TYPES = ("dimse", "dicomweb")


@dataclass(frozen=True)
class Peer:
    """A calling AE title that may open associations, from the listed hosts (IP addresses or
    networks; none listed: from any host)."""

    ae_title: str
    hosts: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    def admits(self, ae_title: str, address: str) -> bool:
        if ae_title.strip() != self.ae_title:
            return False
        if not self.hosts:
            return True
        try:
            host = ipaddress.ip_address(address)
        except ValueError:
            return False
        if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
            host = host.ipv4_mapped  # a dual-stack socket reports an IPv4 peer as ::ffff:a.b.c.d
        return any(host in network for network in self.hosts)


@dataclass(frozen=True)
class Route:
    """A rule that gives the series it matches to a model. ``match``: DICOM keyword -> regular
    expression that must match the whole attribute value, case-insensitively (a multi-valued
    attribute as its values joined with ``\\``; an absent one as ``""``). ``burned_in``: also send
    a Secondary Capture series of the slices with the labels drawn in (:mod:`.capture`), for
    viewers that do not show a SEG. ``structured_report``: also send a DICOM SR (TID 1500) with
    each segment's volume in mL (:mod:`.report`)."""

    name: str
    match: dict[str, re.Pattern]
    checkpoint: Path
    task: str | None
    output_formats: tuple[str, ...]
    burned_in: bool = False
    structured_report: bool = False


@dataclass(frozen=True)
class Destination:
    """Where each result goes: a DICOM node by C-STORE (``dimse``: ``ae_title``, ``host``,
    ``port``; over TLS with ``tls``: the node's certificate, the peer's checked against the
    node's ``tls.ca``), or a DICOMweb server by STOW-RS (``dicomweb``: its base ``url``, the
    one ``/studies`` hangs under)."""

    name: str
    type: str
    ae_title: str = ""
    host: str = ""
    port: int = 0
    tls: bool = False
    url: str = ""

    def __str__(self) -> str:
        return f"{self.name} ({self.url if self.type == 'dicomweb' else f'{self.ae_title}@{self.host}:{self.port}'})"


@dataclass(frozen=True)
class Retry:
    """Sending a result: ``attempts`` tries per destination, waiting ``backoff_s``, then twice
    as long each time, up to ``max_backoff_s``."""

    attempts: int = 3
    backoff_s: float = 2.0
    max_backoff_s: float = 60.0

    def waits(self) -> list[float]:
        """The waits between the attempts."""
        return [min(self.backoff_s * 2**i, self.max_backoff_s) for i in range(self.attempts - 1)]


@dataclass(frozen=True)
class Tls:
    """TLS on the node's port (only: a plain association is refused) and towards its DIMSE
    destinations with ``tls: true``: the node's certificate and key (PEM), and the certificate
    authority whose certificates the peers must present (``ca``)."""

    certificate: Path
    key: Path
    ca: Path


@dataclass(frozen=True)
class NodeConfig:
    """The node: who it is (``ae_title``, ``bind``, ``port``), whom it accepts (``accept``),
    where it keeps what it received and its queue (``spool``), when a series is complete
    (``stable_after_s`` without a new instance), how many jobs run at once (``workers``), on
    which device (``device``), which model takes which series (``routes``, the first that
    matches), where results go (``destinations``) and how sending is retried (``retry``);
    ``stop_grace_s``: how long a stop waits for a running job before it re-queues it."""

    source: Path
    ae_title: str
    port: int
    accept: tuple[Peer, ...]
    spool: Path
    routes: tuple[Route, ...]
    destinations: tuple[Destination, ...]
    bind: str = "127.0.0.1"
    stable_after_s: float = 10.0
    workers: int = 1
    device: str = "auto"
    stop_grace_s: float = 60.0
    retry: Retry = Retry()
    tls: Tls | None = None

    def admits(self, ae_title: str, address: str) -> bool:
        """Whether a calling AE title from ``address`` may open an association."""
        return any(peer.admits(ae_title, address) for peer in self.accept)


class _Reader:
    """Checks of the values of one YAML file, each error naming the file and the key."""

    def __init__(self, path: Path) -> None:
        self.path = path  # the YAML file

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {problem}")

    def mapping(self, value: Any, key: str, known: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
        if not isinstance(value, dict):
            raise self.error(key, f"expected a mapping, got {type(value).__name__}")
        prefix = f"{key}." if key else ""
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ConfigError(f"{self.path}: {prefix}{unknown[0]}: unknown key; known: {', '.join(known)}")
        missing = [k for k in required if k not in value]
        if missing:
            raise ConfigError(f"{self.path}: {prefix}{missing[0]}: required key missing")
        return value

    def listing(self, value: Any, key: str, empty: bool = False) -> list:
        if not isinstance(value, list) or (not value and not empty):
            raise self.error(key, "expected a list" + ("" if empty else " of at least one entry"))
        return value

    def text(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"expected a non-empty string, got {value!r}")
        return value.strip()

    def ae_title(self, value: Any, key: str) -> str:
        title = self.text(value, key)
        if len(title) > 16 or "\\" in title or not title.isascii() or not title.isprintable():
            raise self.error(key, f"{title!r} is no AE title (1 to 16 printable ASCII characters, no backslash)")
        return title

    def number(self, value: Any, key: str, kind: type, low: float, high: float | None = None) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise self.error(key, f"expected {'an integer' if kind is int else 'a number'}, got {value!r}")
        if value < low or (high is not None and value > high):
            raise self.error(key, f"{value} is out of range ({low} to {high if high is not None else 'any'})")
        return kind(value)

    def flag(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {value!r}")
        return value

    def port(self, value: Any, key: str) -> int:
        return self.number(value, key, int, 1, 65535)

    def file(self, value: Any, key: str) -> Path:
        path = self.path_of(value, key)
        if not path.exists():
            raise self.error(key, f"{path}: not found")
        return path

    def path_of(self, value: Any, key: str) -> Path:
        path = Path(self.text(value, key)).expanduser()
        return path if path.is_absolute() else (self.path.parent / path).resolve()


def _peer(reader: _Reader, value: Any, key: str) -> Peer:
    entry = reader.mapping(value, key, ("ae_title", "hosts"), ("ae_title",))
    hosts = []
    for i, host in enumerate(reader.listing(entry.get("hosts", []), f"{key}.hosts", empty=True)):
        try:
            hosts.append(ipaddress.ip_network(str(host), strict=False))
        except ValueError:
            raise reader.error(f"{key}.hosts[{i}]", f"{host!r} is no IP address or network (10.0.0.0/24); host names are not resolved") from None
    return Peer(reader.ae_title(entry["ae_title"], f"{key}.ae_title"), tuple(hosts))


def _match(reader: _Reader, value: Any, key: str) -> dict[str, re.Pattern]:
    from pydicom.datadict import tag_for_keyword

    if not isinstance(value, dict) or not value:
        raise reader.error(key, "expected a mapping of DICOM keywords to regular expressions (Modality: CT)")
    patterns = {}
    for keyword, pattern in value.items():
        if tag_for_keyword(str(keyword)) is None:
            raise reader.error(f"{key}.{keyword}", "not a DICOM keyword (as pydicom names them: Modality, BodyPartExamined, SeriesDescription)")
        if isinstance(pattern, bool) or not isinstance(pattern, (str, int, float)):
            raise reader.error(f"{key}.{keyword}", f"expected a regular expression, got {pattern!r}")
        try:
            patterns[str(keyword)] = re.compile(str(pattern), re.IGNORECASE)
        except re.error as err:
            raise reader.error(f"{key}.{keyword}", f"{pattern!r} is no regular expression ({err})") from None
    return patterns


def _route(reader: _Reader, value: Any, key: str) -> Route:
    from hsmla_med.io.volumes import OUTPUT_FORMATS
    from hsmla_med.tasks import task_name

    entry = reader.mapping(value, key, ("name", "match", "checkpoint", "task", "output_formats", "burned_in", "structured_report"),
                           ("name", "match", "checkpoint"))
    task = None
    if entry.get("task") is not None:
        try:
            task = task_name(reader.text(entry["task"], f"{key}.task"))
        except InputError as err:
            raise reader.error(f"{key}.task", str(err)) from None
    formats = tuple(reader.text(f, f"{key}.output_formats[{i}]") for i, f in enumerate(reader.listing(entry.get("output_formats", [SEG_FORMAT]), f"{key}.output_formats")))
    for i, name in enumerate(formats):
        if name not in OUTPUT_FORMATS:
            raise reader.error(f"{key}.output_formats[{i}]", f"{name!r} is no output format; use {', '.join(OUTPUT_FORMATS)}")
    if SEG_FORMAT not in formats:
        raise reader.error(f"{key}.output_formats", f"must hold {SEG_FORMAT}: the node sends DICOM SEG results")
    return Route(reader.text(entry["name"], f"{key}.name"), _match(reader, entry["match"], f"{key}.match"),
                 reader.file(entry["checkpoint"], f"{key}.checkpoint"), task, tuple(dict.fromkeys(formats)),
                 reader.flag(entry.get("burned_in", False), f"{key}.burned_in"),
                 reader.flag(entry.get("structured_report", False), f"{key}.structured_report"))


def _destination(reader: _Reader, value: Any, key: str) -> Destination:
    kind = reader.text(reader.mapping(value, key, ("type", "name", "ae_title", "host", "port", "tls", "url"), ("type",))["type"], f"{key}.type")
    if kind not in DESTINATION_TYPES:
        raise reader.error(f"{key}.type", f"{kind!r}: use {', '.join(DESTINATION_TYPES)}")
    if kind == "dicomweb":
        entry = reader.mapping(value, key, ("type", "name", "url"), ("url", "name"))
        url = reader.text(entry["url"], f"{key}.url").rstrip("/")
        if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
            raise reader.error(f"{key}.url", f"{url!r} is no http:// or https:// URL")
        return Destination(reader.text(entry["name"], f"{key}.name"), kind, url=url)
    entry = reader.mapping(value, key, ("type", "name", "ae_title", "host", "port", "tls"), ("ae_title", "host", "port"))
    title = reader.ae_title(entry["ae_title"], f"{key}.ae_title")
    return Destination(reader.text(entry.get("name", title), f"{key}.name"), kind, title, reader.text(entry["host"], f"{key}.host"),
                       reader.port(entry["port"], f"{key}.port"), reader.flag(entry.get("tls", False), f"{key}.tls"))


def _unique(reader: _Reader, names: list[str], key: str) -> None:
    for i, name in enumerate(names):
        if name in names[:i]:
            raise reader.error(f"{key}[{i}].name", f"{name!r} is named twice; names must differ")


def load_node_config(path: str | Path) -> NodeConfig:
    """The node configuration of the YAML file at ``path``, every value checked."""
    from hsmla_med.config import load_yaml

    path = Path(path)
    reader = _Reader(path)
    data = reader.mapping(load_yaml(path), "", ("ae_title", "bind", "port", "accept", "spool", "stable_after_s", "workers", "device",
                                                "stop_grace_s", "routes", "destinations", "retry", "tls"),
                          ("ae_title", "port", "accept", "spool", "routes", "destinations"))
    routes = tuple(_route(reader, r, f"routes[{i}]") for i, r in enumerate(reader.listing(data["routes"], "routes")))
    destinations = tuple(_destination(reader, d, f"destinations[{i}]") for i, d in enumerate(reader.listing(data["destinations"], "destinations")))
    _unique(reader, [r.name for r in routes], "routes")
    _unique(reader, [d.name for d in destinations], "destinations")
    device = reader.text(data.get("device", "auto"), "device")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise reader.error("device", f"{device!r}: use auto, cpu, cuda or cuda:N")
    retry = reader.mapping(data.get("retry", {}), "retry", ("attempts", "backoff_s", "max_backoff_s"))
    tls = None
    if data.get("tls") is not None:
        entry = reader.mapping(data["tls"], "tls", ("certificate", "key", "ca"), ("certificate", "key", "ca"))
        tls = Tls(*(reader.file(entry[k], f"tls.{k}") for k in ("certificate", "key", "ca")))
    for i, destination in enumerate(destinations):
        if destination.tls and tls is None:
            raise reader.error(f"destinations[{i}].tls", "needs the node's tls section (its certificate, key and ca)")
    bind = reader.text(data.get("bind", NodeConfig.bind), "bind")
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise reader.error("bind", f"{bind!r} is no IP address (127.0.0.1 for this machine only, 0.0.0.0 for every interface)") from None
    return NodeConfig(
        source=path,
        ae_title=reader.ae_title(data["ae_title"], "ae_title"),
        port=reader.port(data["port"], "port"),
        accept=tuple(_peer(reader, p, f"accept[{i}]") for i, p in enumerate(reader.listing(data["accept"], "accept"))),
        spool=reader.path_of(data["spool"], "spool"),
        routes=routes,
        destinations=destinations,
        bind=bind,
        stable_after_s=reader.number(data.get("stable_after_s", NodeConfig.stable_after_s), "stable_after_s", float, 0.1),
        workers=reader.number(data.get("workers", NodeConfig.workers), "workers", int, 1, 64),
        device=device,
        stop_grace_s=reader.number(data.get("stop_grace_s", NodeConfig.stop_grace_s), "stop_grace_s", float, 0),
        retry=Retry(reader.number(retry.get("attempts", Retry.attempts), "retry.attempts", int, 1, 100),
                    reader.number(retry.get("backoff_s", Retry.backoff_s), "retry.backoff_s", float, 0),
                    reader.number(retry.get("max_backoff_s", Retry.max_backoff_s), "retry.max_backoff_s", float, 0)),
        tls=tls,
    )
