"""An image part's URL -> its bytes, under the operator's policy (``MediaPolicy``).

- ``data:`` URLs (base64) always.
- ``file://`` only under ``--allowed-local-media-path DIR``: the path resolved (symlinks
  too) must lie inside DIR, and is opened as resolved, without following a link.
- ``http(s)://`` only to hosts named in ``--allowed-media-domains`` (exact names), and
  never to an address that is not public. Against server-side request forgery (vLLM's
  CVE-2025-6242 was this): the host is resolved once, every address it resolves to is
  checked (``public_only``) before any connection, the connection goes to a checked
  address (no second resolution, so DNS rebinding cannot swap it), and redirects are
  followed here, at most ``MAX_REDIRECTS``, each hop checked the same way. The body is
  capped (``max_bytes``) and the whole fetch, every hop, is bounded (``timeout``).

No HTTP client library: one GET over HTTP/1.1 with ``h11`` on an anyio TCP stream (TLS
from the standard ``ssl`` module, SNI and the certificate's host name checked). The
resolver, the address check and the connector are fields of the policy, so tests feed
addresses and a loopback server without a packet leaving the machine.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import anyio
import anyio.abc
import h11

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
AddressCheck = Callable[[IPAddress], str | None]  # why an address is refused, or None
Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
Connector = Callable[[IPAddress, int, str, bool], Awaitable[anyio.abc.ByteStream]]

MAX_REDIRECTS = 5
MAX_HEADER_BYTES = 32 << 10
REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class MediaError(ValueError):
    """A URL this server will not or cannot read; the message says why (a 400)."""


def public_only(addr: IPAddress) -> str | None:
    """Why ``addr`` must not be connected to (``"loopback"``, ``"private"``...), or None
    for a public address. IPv6 forms that carry an IPv4 address (mapped ``::ffff:a.b.c.d``,
    compatible ``::a.b.c.d``, 6to4, Teredo, NAT64) are judged by that address too."""
    if isinstance(addr, ipaddress.IPv6Address):
        inner = _embedded_ipv4(addr)
        if inner is not None and (why := public_only(inner)) is not None:
            return why
    for kind in ("unspecified", "loopback", "link_local", "multicast", "reserved", "private"):
        if getattr(addr, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if addr.is_global else "non-public"


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr.teredo is not None:
        return addr.teredo[1]  # the client's address
    if addr in _NAT64 or (int(addr) >> 32 == 0 and int(addr) > 1):  # NAT64, ::a.b.c.d
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to (an IP literal: itself)."""
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise MediaError(f"cannot resolve {host}: {e}") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


async def connect(addr: IPAddress, port: int, host: str, tls: bool) -> anyio.abc.ByteStream:
    """A TCP stream to ``addr`` itself (no resolution); with ``tls``, TLS with SNI and
    the certificate checked against ``host``."""
    if not tls:
        return await anyio.connect_tcp(str(addr), port)
    ctx = ssl.create_default_context()
    return await anyio.connect_tcp(str(addr), port, tls=True, ssl_context=ctx, tls_hostname=host)


@dataclass(frozen=True)
class MediaPolicy:
    """What may be read: ``allowed_domains`` (exact host names; empty: no http(s)),
    ``local_path`` (the directory ``file://`` URLs may name; None: none), the size of
    one image's bytes and the time all of a request's fetches may take."""

    allowed_domains: frozenset[str] = frozenset()
    local_path: Path | None = None
    max_bytes: int = 20 << 20
    timeout: float = 10.0
    check_address: AddressCheck = public_only
    resolve: Resolver = resolve
    connect: Connector = connect
    max_redirects: int = MAX_REDIRECTS


async def fetch_all(urls: list[str], policy: MediaPolicy) -> list[bytes]:
    """The bytes of every URL, fetched concurrently, all within ``policy.timeout``."""
    out: list[bytes] = [b""] * len(urls)

    async def one(i: int) -> None:
        try:
            out[i] = await fetch(urls[i], policy)
        except MediaError as e:
            raise MediaError(f"image {i + 1} of {len(urls)}: {e}") from None

    try:
        with anyio.fail_after(policy.timeout):
            async with anyio.create_task_group() as tg:
                for i in range(len(urls)):
                    tg.start_soon(one, i)
    except TimeoutError:
        raise MediaError(f"fetching the images took longer than {policy.timeout:g}s") from None
    except ExceptionGroup as eg:  # the first failure names the image
        raise _first_media_error(eg) from None
    return out


def _first_media_error(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            return _first_media_error(e)
        return e
    return eg


async def fetch(url: str, policy: MediaPolicy) -> bytes:
    """One URL's bytes; ``MediaError`` saying why not."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":  # base64 of up to the body's size: off the event loop
        return await anyio.to_thread.run_sync(data_url, url, policy.max_bytes)
    if scheme == "file":
        if policy.local_path is None:
            raise MediaError(
                "file:// URLs are off (the server allows them with --allowed-local-media-path DIR)"
            )
        return await anyio.to_thread.run_sync(local_file, url, policy.local_path, policy.max_bytes)
    if scheme in ("http", "https"):
        return await http_get(url, policy)
    raise MediaError(
        f"unsupported URL scheme {scheme!r}: give a data: URL (base64), or an http(s) or "
        "file URL the server allows"
    )


def data_url(url: str, max_bytes: int) -> bytes:
    """``data:[<type>];base64,<data>`` -> the bytes."""
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise MediaError("a data: URL must be base64 (data:image/png;base64,...)")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise MediaError(f"the image is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise MediaError(f"the data: URL's base64 is malformed: {e}") from None
    if len(data) > max_bytes:
        raise MediaError(f"the image is larger than {max_bytes} bytes")
    return data


def local_file(url: str, root: Path, max_bytes: int) -> bytes:
    """A ``file://`` URL's bytes if its path, resolved (symlinks too), lies in ``root``."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"a file URL names this machine only, not {parts.netloc!r}")
    base = root.resolve()
    try:
        path = Path(unquote(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaError(f"{unquote(parts.path)} does not exist") from None
    if not path.is_relative_to(base):
        raise MediaError(f"{unquote(parts.path)} is outside the allowed media directory")
    try:  # opened as resolved; a link swapped in since is not followed
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise MediaError(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            raise MediaError(f"{path} is not a regular file of at most {max_bytes} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(max_bytes)
    finally:
        os.close(fd)


async def http_get(url: str, policy: MediaPolicy) -> bytes:
    """GET ``url``, following redirects (each hop checked as the first)."""
    for _ in range(policy.max_redirects + 1):
        status, location, body = await _get_once(url, policy)
        if status not in REDIRECTS:
            if status != 200:
                raise MediaError(f"fetching {_origin(url)} answered HTTP {status}")
            return body
        if location is None:
            raise MediaError(f"{_origin(url)} redirected (HTTP {status}) without a Location")
        url = urljoin(url, location)
    raise MediaError(f"more than {policy.max_redirects} redirects")


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


async def _get_once(url: str, policy: MediaPolicy) -> tuple[int, str | None, bytes]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise MediaError(f"a redirect to a {scheme!r} URL is not followed")
    host = (parts.hostname or "").lower()
    if host not in policy.allowed_domains:
        raise MediaError(
            f"the host {host!r} is not an allowed media domain (--allowed-media-domains)"
        )
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise MediaError(f"the URL's port is not valid: {parts.netloc!r}") from None
    addrs = await policy.resolve(host, port)
    if not addrs:
        raise MediaError(f"{host} resolves to no address")
    for addr in addrs:  # all of them, before connecting to any
        if (why := policy.check_address(addr)) is not None:
            raise MediaError(f"{host} resolves to {addr}, a {why} address: refused")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        stream = await policy.connect(addrs[0], port, host, scheme == "https")
    except (OSError, ssl.SSLError, anyio.BrokenResourceError) as e:
        raise MediaError(f"cannot connect to {host}: {e}") from None
    async with stream:
        return await _exchange(stream, parts.netloc.rsplit("@", 1)[-1], target, policy.max_bytes)


async def _exchange(
    stream: anyio.abc.ByteStream, host_header: str, target: str, max_bytes: int
) -> tuple[int, str | None, bytes]:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
    request = h11.Request(
        method="GET",
        target=target,
        headers=[
            ("Host", host_header),
            ("User-Agent", "structllm"),
            ("Accept", "image/*"),
            ("Connection", "close"),
        ],
    )
    try:
        await stream.send(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
        status, location, chunks, size = 0, None, [], 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    conn.receive_data(await stream.receive(65536))
                except anyio.EndOfStream:
                    conn.receive_data(b"")
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
                location = headers.get("location")
                length = headers.get("content-length", "")
                if status == 200 and length.isdigit() and int(length) > max_bytes:
                    raise MediaError(f"the image is larger than {max_bytes} bytes")
                if status != 200:  # a redirect or an error: its body is not wanted
                    return status, location, b""
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > max_bytes:
                    raise MediaError(f"the image is larger than {max_bytes} bytes")
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return status, location, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise MediaError("the connection closed before the response was complete")
    except h11.RemoteProtocolError as e:
        raise MediaError(f"a malformed HTTP response: {e}") from None
    except (OSError, anyio.BrokenResourceError, ssl.SSLError) as e:
        raise MediaError(f"the connection failed: {e}") from None
