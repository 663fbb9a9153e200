"""``server/media.py``: image URLs -> bytes under the operator's policy. The SSRF rules
are checked with addresses fed to the check, a resolver and a connector that record
their calls, and loopback origins; no packet leaves the machine (the default policy
refuses loopback, so the origins here are reached only where a test's check allows
127.0.0.1 itself)."""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
import anyio.abc
import pytest

from structllm.server import media
from structllm.server.media import IPAddress, MediaError, MediaPolicy, public_only

pytestmark = pytest.mark.anyio

LOOPBACK = ipaddress.IPv4Address("127.0.0.1")


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def allow_127_0_0_1(addr: IPAddress) -> str | None:
    """The default check, but for 127.0.0.1 itself (a test's "public" origin)."""
    return None if addr == LOOPBACK else public_only(addr)


def ok(body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    ).encode() + body


def redirect(to: str) -> bytes:
    return f"HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\n\r\n".encode()


@dataclass
class Origin:
    """A loopback HTTP server: ``answer(path)`` is the raw response (None: never answer)."""

    host: str
    answer: Callable[[str], bytes | None]
    port: int = 0
    connections: int = 0
    paths: list[str] = field(default_factory=list)
    requested: anyio.Event = field(default_factory=anyio.Event)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def serve(self, stream: anyio.abc.SocketStream) -> None:
        self.connections += 1
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive()
            self.paths.append(head.split(b" ")[1].decode())
            self.requested.set()
            reply = self.answer(self.paths[-1])
            if reply is None:
                await anyio.sleep_forever()
            else:
                await stream.send(reply)


@asynccontextmanager
async def origin(
    answer: Callable[[str], bytes | None], host: str = "127.0.0.1"
) -> AsyncIterator[Origin]:
    o = Origin(host, answer)
    listener = await anyio.create_tcp_listener(local_host=host, local_port=0)
    o.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, o.serve)
        yield o
        tg.cancel_scope.cancel()


def policy(*domains: str, **kw: object) -> MediaPolicy:
    return MediaPolicy(**{"timeout": 5.0, **kw, "allowed_domains": frozenset(domains)})  # type: ignore[arg-type]


async def refused(url: str, p: MediaPolicy, match: str) -> None:
    with pytest.raises(MediaError, match=match):
        await media.fetch_all([url], p)


# -- the address check --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.1.2.3", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::127.0.0.1", "loopback"),  # IPv4-compatible
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("64:ff9b::7f00:1", "loopback"),  # NAT64 of 127.0.0.1
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("::ffff:10.0.0.1", "private"),
        ("fc00::1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-public"),  # carrier-grade NAT
    ],
)
def test_addresses_that_are_not_public_are_refused(addr: str, why: str) -> None:
    assert public_only(ipaddress.ip_address(addr)) == why


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888"])
def test_public_addresses_pass(addr: str) -> None:
    assert public_only(ipaddress.ip_address(addr)) is None


# -- http(s) ------------------------------------------------------------------------------


async def test_http_is_off_unless_the_host_is_an_allowed_domain() -> None:
    calls: list[str] = []

    async def resolver(host: str, port: int) -> list[IPAddress]:
        calls.append(host)
        return [ipaddress.ip_address("8.8.8.8")]

    await refused("http://example.com/a.png", policy(resolve=resolver), "not an allowed media")
    await refused(
        "http://evil.example.org/a.png",
        policy("example.com", resolve=resolver),
        "'evil.example.org' is not an allowed media domain",
    )
    assert calls == []  # refused before it was even resolved


async def test_every_resolved_address_is_checked_before_any_connection() -> None:
    connected: list[IPAddress] = []

    async def resolver(host: str, port: int) -> list[IPAddress]:
        return [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("10.0.0.7")]

    async def connector(addr: IPAddress, port: int, host: str, tls: bool) -> anyio.abc.ByteStream:
        connected.append(addr)
        raise AssertionError("connected")

    p = policy("images.example", resolve=resolver, connect=connector)
    await refused("https://images.example/cat.png", p, r"resolves to 10\.0\.0\.7, a private")
    assert connected == []


async def test_a_loopback_origin_is_refused_by_default_without_a_connection() -> None:
    async with origin(lambda _: ok(b"png")) as o:
        await refused(f"{o.url}/a.png", policy("127.0.0.1"), "a loopback address: refused")
        await refused(
            f"http://localhost:{o.port}/a.png", policy("localhost"), "loopback address: refused"
        )
        await refused(
            f"http://[::ffff:127.0.0.1]:{o.port}/", policy("::ffff:127.0.0.1"), "loopback"
        )
        assert o.connections == 0


async def test_an_allowed_origin_is_fetched_from_the_checked_address() -> None:
    async with origin(lambda _: ok(b"\x89PNG...")) as o:
        p = policy("127.0.0.1", check_address=allow_127_0_0_1)
        assert await media.fetch_all([f"{o.url}/a.png?x=1"], p) == [b"\x89PNG..."]
        assert o.paths == ["/a.png?x=1"]


async def test_a_redirect_into_a_refused_address_is_refused_before_connecting() -> None:
    async with (
        origin(lambda _: ok(b"secret"), host="127.0.0.2") as inner,
        origin(lambda _: redirect(f"http://127.0.0.2:{inner.port}/admin")) as outer,
    ):
        p = policy("127.0.0.1", "127.0.0.2", check_address=allow_127_0_0_1)
        await refused(f"{outer.url}/a.png", p, r"127\.0\.0\.2, a loopback address: refused")
        # a redirect to a host that is not allowed, and to another scheme
        await refused(
            f"{outer.url}/a.png",
            policy("127.0.0.1", check_address=allow_127_0_0_1),
            "'127.0.0.2' is not an allowed media domain",
        )
        assert outer.connections == 2
        assert inner.connections == 0


async def test_redirects_are_followed_a_bounded_number_of_times() -> None:
    def answer(path: str) -> bytes:
        n = int(path.strip("/") or 0)
        return ok(b"there") if n == 3 else redirect(f"/{n + 1}")

    async with origin(answer) as o:
        p = policy("127.0.0.1", check_address=allow_127_0_0_1)
        assert await media.fetch_all([f"{o.url}/0"], p) == [b"there"]
        assert o.paths == ["/0", "/1", "/2", "/3"]
        await refused(f"{o.url}/0", replace(p, max_redirects=2), "more than 2 redirects")

    async with origin(lambda _: redirect("file:///etc/passwd")) as o:
        await refused(o.url, replace(p), "a redirect to a 'file' URL is not followed")


async def test_the_body_is_capped() -> None:
    big = b"x" * 2000
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"100\r\n" + b"y" * 256 + b"\r\n" for _ in range(8))
        + b"0\r\n\r\n"
    )
    async with origin(lambda p: ok(big) if p == "/sized" else chunked) as o:
        p = policy("127.0.0.1", check_address=allow_127_0_0_1, max_bytes=1000)
        await refused(f"{o.url}/sized", p, "larger than 1000 bytes")
        await refused(f"{o.url}/chunked", p, "larger than 1000 bytes")
        assert await media.fetch_all([f"{o.url}/chunked"], replace(p, max_bytes=2048)) == [
            b"y" * 2048
        ]


async def test_a_silent_origin_times_out() -> None:
    async with origin(lambda _: None) as o:
        p = policy("127.0.0.1", check_address=allow_127_0_0_1, timeout=0.3)
        await refused(f"{o.url}/slow", p, r"longer than 0\.3s")
        assert o.requested.is_set()


async def test_an_error_status_is_an_error() -> None:
    async with origin(lambda _: b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n") as o:
        await refused(o.url, policy("127.0.0.1", check_address=allow_127_0_0_1), "HTTP 404")


# -- data: and file: ----------------------------------------------------------------------


async def test_data_urls() -> None:
    png = b"\x89PNG\r\n\x1a\n"
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert await media.fetch_all([url, url], policy()) == [png, png]
    await refused("data:image/png,rawbytes", policy(), "must be base64")
    await refused("data:image/png;base64,@@@", policy(), "base64 is malformed")
    await refused(url, policy(max_bytes=4), "larger than 4 bytes")
    await refused("ftp://example.com/a.png", policy(), "unsupported URL scheme 'ftp'")
    await refused("/etc/passwd", policy(), "unsupported URL scheme ''")


async def test_file_urls_only_inside_the_allowed_directory(tmp_path: Path) -> None:
    allowed, other = tmp_path / "media", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    (allowed / "in.png").write_bytes(b"inside")
    (other / "out.png").write_bytes(b"outside")
    (allowed / "link.png").symlink_to(other / "out.png")
    (allowed / "sub").symlink_to(other)
    p = policy(local_path=allowed)
    assert await media.fetch_all([(allowed / "in.png").as_uri()], p) == [b"inside"]
    await refused((allowed / "in.png").as_uri(), policy(), "file:// URLs are off")
    await refused((other / "out.png").as_uri(), p, "outside the allowed media directory")
    await refused(f"file://{allowed}/../other/out.png", p, "outside the allowed media directory")
    await refused((allowed / "link.png").as_uri(), p, "outside the allowed media directory")
    await refused(f"file://{allowed}/sub/out.png", p, "outside the allowed media directory")
    await refused((allowed / "none.png").as_uri(), p, "does not exist")
    await refused(f"file://{allowed}", p, "not a regular file")
    await refused(f"file://otherhost{allowed}/in.png", p, "names this machine only")
