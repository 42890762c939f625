"""Remote images and their SSRF rules.

Every request stays on loopback: an origin server on 127.0.0.1 plays every
host, and :class:`StandIn` plays "the public internet": it carries requests
for one public stand-in address to that origin and fails the test on any
other address, so a fetch that slipped past the rules could not leave the
machine either.
"""

from __future__ import annotations

import gzip
import ipaddress
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import httpx
import pytest
from anyio.abc import SocketStream

from mlx_pinned.server.inputs.remote import (
    RemoteImageError,
    RemoteImageFetcher,
    is_public_address,
)
from mlx_pinned.testing import make_test_image

from .conftest import assert_error, vision_body
from .kit import Serve

pytestmark = pytest.mark.anyio

PUBLIC = "93.184.215.14"  # a global address that no test ever reaches
PNG = make_test_image(16, 16, fmt="PNG")
PARAM = "messages[0].content[1].image_url"


class Origin:
    """A tiny HTTP/1.1 server on 127.0.0.1 that records what reached it."""

    def __init__(self) -> None:
        self.port = 0
        self.hits: list[tuple[str, dict[str, str]]] = []

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.hits]

    async def handle(self, stream: SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            lines = data.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
            target = lines[0].split(" ")[1]
            pairs = (line.split(":", 1) for line in lines[1:])
            headers = {k.strip().lower(): v.strip() for k, v in pairs}
            self.hits.append((target, headers))
            path, _, query = target.partition("?")
            args = dict(urllib.parse.parse_qsl(query))
            head, body = b"HTTP/1.1 200 OK\r\nconnection: close\r\n", PNG
            if path == "/redirect":
                head = b"HTTP/1.1 302 Found\r\nconnection: close\r\n"
                head += b"location: " + args["to"].encode() + b"\r\n"
                body = b""
            elif path == "/missing":
                head, body = b"HTTP/1.1 404 Not Found\r\nconnection: close\r\n", b""
            elif path == "/huge-declared":
                await stream.send(head + b"content-length: 999999999\r\n\r\n")
                return
            elif path == "/endless":
                await stream.send(head + b"\r\n")
                try:
                    while True:
                        await stream.send(b"\0" * 65536)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
            elif path == "/gzip-bomb":  # 20 MB of zeros in ~20 KB
                bomb = gzip.compress(b"\0" * 20_000_000)
                head += b"content-encoding: gzip\r\n"
                head += b"content-length: " + str(len(bomb)).encode() + b"\r\n\r\n"
                await stream.send(head + bomb)
                return
            elif path == "/slow":  # answers never: only a timeout ends the fetch
                await anyio.sleep_forever()
            head += b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
            await stream.send(head + body)


@pytest.fixture
async def origin() -> AsyncIterator[Origin]:
    server = Origin()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    server.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, server.handle)
        yield server
        group.cancel_scope.cancel()


class StandIn(httpx.AsyncBaseTransport):
    """The public internet of these tests: :data:`PUBLIC` is the origin."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.inner = httpx.AsyncHTTPTransport()
        self.requests: list[httpx.Request] = []
        self.hosts: list[str] = []  # where each request was addressed

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.hosts.append(request.url.host)
        if request.url.host != PUBLIC:
            raise AssertionError(f"a fetch to {request.url.host} left the stand-in")
        if request.url.scheme == "https":  # no TLS here: answer for the origin
            return httpx.Response(200, content=PNG)
        request.url = request.url.copy_with(host="127.0.0.1", port=self.origin.port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def resolver(table: dict[str, Sequence[str]]) -> Callable[[str, int], object]:
    calls: list[str] = []

    async def resolve(host: str, port: int) -> Sequence[str]:
        calls.append(host)
        if host not in table:
            raise OSError(f"unknown host {host}")
        return table[host]

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


def fetcher(origin: Origin, **table: Sequence[str]) -> RemoteImageFetcher:
    names = {name.replace("_", "."): addrs for name, addrs in table.items()}
    return RemoteImageFetcher(
        resolver=resolver({"public.test": [PUBLIC], **names}),  # type: ignore[arg-type]
        transport=StandIn(origin),
        timeout=2.0,
        max_bytes=100_000,
    )


def watched(origin: Origin, name: str) -> tuple[RemoteImageFetcher, StandIn]:
    """A fetcher for which ``name`` is the public address, and its transport
    (it records each request)."""
    transport = StandIn(origin)
    fetch = RemoteImageFetcher(
        resolver=resolver({name: [PUBLIC]}),  # type: ignore[arg-type]
        transport=transport,
    )
    return fetch, transport


async def refused(fetch: RemoteImageFetcher, url: str, code: str) -> str:
    with pytest.raises(RemoteImageError) as info:
        await fetch(url)
    assert info.value.code == code, info.value.message
    return info.value.message


class TestPublicAddress:
    @pytest.mark.parametrize(
        "address",
        [
            "127.0.0.1",
            "127.8.9.10",
            "10.0.0.1",
            "172.16.5.4",
            "192.168.1.1",
            "169.254.169.254",  # cloud metadata
            "169.254.1.1",
            "100.64.0.1",  # shared (CGNAT)
            "100.100.100.200",  # Alibaba metadata
            "0.0.0.0",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "192.0.2.1",
            "198.18.0.1",
            "::",
            "::1",
            "fe80::1",
            "fc00::1",
            "fd00:ec2::254",  # AWS metadata over IPv6
            "fec0::1",  # site-local
            "ff02::1",
            "::ffff:127.0.0.1",  # IPv4-mapped
            "::ffff:169.254.169.254",
            "::ffff:10.0.0.1",
            "::127.0.0.1",  # IPv4-compatible
            "2002:7f00:1::",  # 6to4 of 127.0.0.1
            "2002:a00:1::",  # 6to4 of 10.0.0.1
            "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
            "2001:db8::1",
        ],
    )
    def test_refused(self, address: str) -> None:
        assert not is_public_address(address)
        assert not is_public_address(ipaddress.ip_address(address))

    @pytest.mark.parametrize(
        "address", [PUBLIC, "8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8"]
    )
    def test_public(self, address: str) -> None:
        assert is_public_address(address)


INTERNAL = [
    "http://127.0.0.1:{port}/cat.png",
    "http://localhost:{port}/cat.png",
    "http://[::1]:{port}/cat.png",
    "http://[::ffff:127.0.0.1]:{port}/cat.png",
    "http://0.0.0.0:{port}/cat.png",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::ffff:a9fe:a9fe]/latest/",
    "http://10.0.0.1/cat.png",
    "https://192.168.0.1/cat.png",
]


class TestRefusals:
    """Every refusal happens before a connection: the origin sees nothing."""

    async def test_internal_addresses(self, origin: Origin) -> None:
        fetch = RemoteImageFetcher(timeout=2.0)  # the system resolver
        for url in INTERNAL:
            message = await refused(
                fetch, url.format(port=origin.port), "image_url_refused"
            )
            assert "public" in message
        assert origin.hits == []

    async def test_metadata_is_named(self, origin: Origin) -> None:
        fetch = fetcher(origin)
        for url in ("http://169.254.169.254/latest/", "http://[fd00:ec2::254]/"):
            message = await refused(fetch, url, "image_url_refused")
            assert "metadata" in message

    async def test_schemes_and_credentials(self, origin: Origin) -> None:
        fetch = fetcher(origin)
        for url in (
            "ftp://public.test/cat.png",
            "gopher://public.test/",
            "file:///etc/passwd",
            "http://u:p@public.test/",
            "http:///cat.png",
            "not a url at all",
        ):
            await refused(fetch, url, "image_url_refused")
        assert origin.hits == []

    async def test_a_name_that_resolves_inside(self, origin: Origin) -> None:
        fetch = fetcher(
            origin,
            loop_test=["127.0.0.1"],
            private_test=["10.1.2.3"],
            mapped_test=["::ffff:127.0.0.1"],
            metadata_test=["169.254.169.254"],
            mixed_test=[PUBLIC, "192.168.1.20"],  # every address must be public
        )
        for name in ("loop", "private", "mapped", "metadata", "mixed"):
            url = f"http://{name}.test:{origin.port}/cat.png"
            message = await refused(fetch, url, "image_url_refused")
            assert f"{name}.test" in message
        assert origin.hits == []

    async def test_redirect_hops_are_vetted(self, origin: Origin) -> None:
        fetch = fetcher(
            origin, private_test=["10.1.2.3"], localhost=["127.0.0.1", "::1"]
        )
        expected = []
        for target in [*INTERNAL, "http://private.test/cat.png", "file:///etc/passwd"]:
            to = urllib.parse.quote(target.format(port=origin.port), safe="")
            await refused(
                fetch, f"http://public.test/redirect?to={to}", "image_url_refused"
            )
            expected.append(f"/redirect?to={to}")
        assert origin.paths == expected  # the first hop only, every time


class TestFetching:
    async def test_public_image_through_the_stand_in(self, origin: Origin) -> None:
        fetch = fetcher(origin)
        assert await fetch("http://public.test/cat.png") == PNG
        ((path, headers),) = origin.hits
        assert path == "/cat.png"
        assert headers["host"] == "public.test"

    async def test_connects_to_the_vetted_address(self, origin: Origin) -> None:
        # DNS rebinding: a second answer would be loopback; there is none.
        answers = [[PUBLIC], ["127.0.0.1"]]

        async def rebinding(host: str, port: int) -> Sequence[str]:
            return answers.pop(0)

        transport = StandIn(origin)
        fetch = RemoteImageFetcher(resolver=rebinding, transport=transport)
        assert await fetch("http://rebind.test/cat.png") == PNG
        assert answers == [["127.0.0.1"]]  # resolved once
        assert transport.hosts == [PUBLIC]

    async def test_https_keeps_the_name_for_tls(self, origin: Origin) -> None:
        fetch, transport = watched(origin, "public.test")
        assert await fetch("https://public.test/cat.png") == PNG
        (request,) = transport.requests
        assert transport.hosts == [PUBLIC]
        assert request.extensions["sni_hostname"] == "public.test"
        assert request.headers["host"] == "public.test"

    async def test_redirect_to_a_public_host_is_followed(self, origin: Origin) -> None:
        fetch = fetcher(origin)
        to = urllib.parse.quote("http://public.test/cat.png", safe="")
        assert await fetch(f"http://public.test/redirect?to={to}") == PNG
        assert origin.paths == [f"/redirect?to={to}", "/cat.png"]

    async def test_too_many_redirects(self, origin: Origin) -> None:
        fetch = fetcher(origin)
        url = "http://public.test/cat.png"
        for _ in range(fetch.max_redirects + 1):
            url = "http://public.test/redirect?to=" + urllib.parse.quote(url, safe="")
        message = await refused(fetch, url, "image_fetch_failed")
        assert "redirected more than" in message

    async def test_byte_cap(self, origin: Origin) -> None:
        for path in ("/huge-declared", "/endless"):
            message = await refused(
                fetcher(origin), f"http://public.test{path}", "image_too_large"
            )
            assert "100000 bytes" in message

    async def test_a_compressed_body_is_refused_unread(self, origin: Origin) -> None:
        # Asked for identity; a compressed answer is never expanded (it
        # would pass the byte cap inside one chunk: here 20 MB for a 100 KB
        # cap, and a few KiB more of gzip layers make it gigabytes).
        message = await refused(
            fetcher(origin), "http://public.test/gzip-bomb", "image_fetch_failed"
        )
        assert "compressed body (gzip)" in message

    async def test_an_internationalised_host_name(self, origin: Origin) -> None:
        # Resolved, addressed and named in its ASCII (IDNA) form.
        fetch, transport = watched(origin, "xn--bcher-kva.test")
        assert await fetch("http://bücher.test/cat.png") == PNG
        (request,) = transport.requests
        assert request.headers["host"] == "xn--bcher-kva.test"
        assert transport.hosts == [PUBLIC]

    async def test_http_errors(self, origin: Origin) -> None:
        fetch = fetcher(origin)
        message = await refused(
            fetch, "http://public.test/missing", "image_fetch_failed"
        )
        assert "404" in message
        await refused(fetch, "http://nowhere.test/x.png", "image_fetch_failed")

    async def test_timeout(self, origin: Origin) -> None:
        fetch = fetcher(origin)
        fetch.timeout = 0.3
        with anyio.fail_after(30):  # the origin never answers: a hang fails
            message = await refused(
                fetch, "http://public.test/slow", "image_fetch_failed"
            )
        assert "0.3 s" in message


def with_image(url: str) -> dict[str, object]:
    body = vision_body(2)
    body["messages"][0]["content"][1]["image_url"]["url"] = url
    return body


class TestServer:
    async def test_refused_by_default_with_how_to_enable(
        self, serve: Serve, origin: Origin
    ) -> None:
        async with serve() as served:
            url = f"http://127.0.0.1:{origin.port}/cat.png"
            error = assert_error(
                await served.chat(with_image(url)), 400, PARAM, "remote_images_disabled"
            )
            assert "--allow-remote-images" in error["message"]
        assert origin.hits == []

    async def test_enabled_refuses_loopback(self, serve: Serve, origin: Origin) -> None:
        async with serve(allow_remote_images=True) as served:
            assert served.app.state.config.allow_remote_images
            for host in ("127.0.0.1", "localhost"):
                url = f"http://{host}:{origin.port}/cat.png"
                assert_error(
                    await served.chat(with_image(url)), 400, PARAM, "image_url_refused"
                )
        assert origin.hits == []

    async def test_public_image_is_served(self, serve: Serve, origin: Origin) -> None:
        async with serve(image_fetcher=fetcher(origin)) as served:
            response = await served.chat(with_image("http://public.test/cat.png"))
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 2
            response = await served.chat(with_image("http://public.test/missing"))
            assert_error(response, 400, PARAM, "image_fetch_failed")
        assert origin.paths == ["/cat.png", "/missing"]
