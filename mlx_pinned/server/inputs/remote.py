"""Remote images and videos, fetched without letting a client reach internal
addresses (``--allow-remote-images``; the SSRF rules: docs/security.md).
Runs on the event loop (asyncio or trio).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence

import anyio
import httpx

__all__ = [
    "METADATA_ADDRESSES",
    "RemoteImageError",
    "RemoteImageFetcher",
    "Resolver",
    "is_public_address",
]

#: Resolves ``(host, port)`` to IP address strings.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Cloud instance-metadata endpoints, refused by name in the error message.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")
)
_NAT64 = (
    ipaddress.ip_network("64:ff9b::/96"),
    ipaddress.ip_network("64:ff9b:1::/48"),
)
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class RemoteImageError(Exception):
    """A remote image that was refused (``code`` ``image_url_refused``) or
    could not be fetched (``image_fetch_failed``)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def is_public_address(address: str | IPAddress) -> bool:
    """Whether a fetch may connect to ``address``: a global address, not a
    cloud metadata one, and no IPv6 address that embeds a refused IPv4 one
    (IPv4-mapped, 6to4, Teredo, NAT64)."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ip.ipv4_mapped or ip
    if ip in METADATA_ADDRESSES or not ip.is_global:
        return False
    if (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    ):
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.is_site_local:
            return False
        embedded: list[ipaddress.IPv4Address] = []
        if ip.sixtofour is not None:
            embedded.append(ip.sixtofour)
        if ip.teredo is not None:
            embedded.extend(ip.teredo)
        if any(ip in net for net in _NAT64):
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        return all(is_public_address(v4) for v4 in embedded)
    return True


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for ``host`` (any event loop)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class RemoteImageFetcher:
    """Fetches a URL's body, or raises :class:`RemoteImageError`.

    Each hop's host is resolved once and every address must be public; the
    request goes to the vetted address itself (the ``Host`` header and TLS
    server name keep the name), so DNS rebinding cannot swap one in.
    Redirects are followed by hand, each hop vetted; environment proxies are
    never used. Cancelling the caller abandons the fetch.

    Args:
        timeout: Seconds for the whole fetch, every hop and the body included.
        resolver: Resolves ``(host, port)`` to addresses (default: the
            system's); tests inject one to make a name resolve anywhere.
        transport: The httpx transport (default: a fresh one per fetch);
            tests inject one to stand in for the public internet.
    """

    def __init__(
        self,
        *,
        max_bytes: int = 10 * 1024 * 1024,
        timeout: float = 10.0,
        max_redirects: int = 3,
        resolver: Resolver | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_redirects = max_redirects
        self.resolver: Resolver = resolver or system_resolver
        self.transport = transport

    async def __call__(self, url: str) -> bytes:
        try:
            with anyio.fail_after(self.timeout):
                return await self._fetch(url)
        except TimeoutError:
            raise RemoteImageError(
                f"fetching the image took longer than {self.timeout:g} s; send it "
                "inline as a base64 data: URI.",
                "image_fetch_failed",
            ) from None

    async def _fetch(self, url: str) -> bytes:
        transport = None if self.transport is None else _Borrowed(self.transport)
        target = _parse(url)
        async with httpx.AsyncClient(
            transport=transport,
            verify=_ssl_context(),
            trust_env=False,  # a proxy would connect where we did not vet
            follow_redirects=False,
            timeout=self.timeout,
        ) as client:
            for _ in range(self.max_redirects + 1):
                response = await self._get(client, target)
                try:
                    location = response.headers.get("location")
                    if response.status_code not in _REDIRECTS or location is None:
                        return await self._body(response)
                finally:
                    await response.aclose()
                try:
                    target = target.join(location)
                except (httpx.InvalidURL, ValueError):
                    raise RemoteImageError(
                        "the image URL redirected to an invalid URL.",
                        "image_fetch_failed",
                    ) from None
                _check_url(target)
        raise RemoteImageError(
            f"the image URL redirected more than {self.max_redirects} times.",
            "image_fetch_failed",
        )

    async def _get(self, client: httpx.AsyncClient, url: httpx.URL) -> httpx.Response:
        # The ASCII (IDNA) form: resolvers, the Host header and TLS want it
        # (url.host is the Unicode form of an internationalised name).
        host = url.raw_host.decode("ascii")
        port = url.port or (443 if url.scheme == "https" else 80)
        addresses = await self._vetted(host, port)
        headers = {
            "Host": url.netloc.decode("ascii"),
            "Accept": "image/*",
            # Compressed bodies expand past the byte cap in one chunk.
            "Accept-Encoding": "identity",
        }
        extensions = {"sni_hostname": host} if url.scheme == "https" else {}
        last: Exception | None = None
        for address in addresses:  # in the resolver's order, as a browser would
            request = client.build_request(
                "GET", url.copy_with(host=address), headers=headers
            )
            request.extensions.update(extensions)
            try:
                return await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                last = exc
            except httpx.HTTPError as exc:
                raise _failed(url, exc) from None
        assert last is not None
        raise _failed(url, last) from None

    async def _vetted(self, host: str, port: int) -> list[str]:
        try:
            literal: IPAddress | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            addresses = [str(literal)]
        else:
            try:
                addresses = [str(a) for a in await self.resolver(host, port)]
            except OSError:
                addresses = []
            if not addresses:
                raise RemoteImageError(
                    f"the image host {host!r} could not be resolved.",
                    "image_fetch_failed",
                )
        for address in addresses:
            try:
                ip = ipaddress.ip_address(address)
            except ValueError:
                ip = None
            if ip is None or not is_public_address(ip):
                what = (
                    "a cloud metadata address"
                    if ip in METADATA_ADDRESSES
                    else "not a public address"
                )
                named = "" if literal is not None else f" (resolved from {host!r})"
                raise RemoteImageError(
                    f"the image URL points to {address}{named}, which is {what}; "
                    "this server only fetches images from public addresses.",
                    "image_url_refused",
                )
        return addresses

    async def _body(self, response: httpx.Response) -> bytes:
        if response.status_code != 200:
            raise RemoteImageError(
                f"the image URL answered HTTP {response.status_code}.",
                "image_fetch_failed",
            )
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise RemoteImageError(
                f"the image URL answered with a compressed body ({encoding}); "
                "only uncompressed images are fetched.",
                "image_fetch_failed",
            )
        length = response.headers.get("content-length", "")
        size = int(length) if length.isdigit() else 0
        chunks: list[bytes] = []
        if size <= self.max_bytes:
            size = 0
            try:
                # Identity only (checked above): aiter_bytes decodes nothing.
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        # Closing the connection ends every generator under
                        # aiter_bytes; breaking out would leave them to the
                        # garbage collector (trio warns about each one).
                        await response.aclose()
                    else:
                        chunks.append(chunk)
            except httpx.HTTPError as exc:
                if size <= self.max_bytes:
                    raise _failed(response.url, exc) from None
        if size > self.max_bytes:
            raise RemoteImageError(
                f"the image is larger than {self.max_bytes} bytes.", "image_too_large"
            )
        return b"".join(chunks)


class _Borrowed(httpx.AsyncBaseTransport):
    """A transport the fetcher uses but does not close."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._transport = transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._transport.handle_async_request(request)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Loading the CA certificates is slow: once a process.
    return ssl.create_default_context()


def _parse(url: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise RemoteImageError(
            "the image URL is not a valid URL.", "image_url_refused"
        ) from None
    _check_url(parsed)
    return parsed


def _check_url(url: httpx.URL) -> None:
    if url.scheme not in ("http", "https"):
        raise RemoteImageError(
            "only http and https image URLs are fetched, not "
            f"{url.scheme or '(none)'!r}.",
            "image_url_refused",
        )
    if not url.host:
        raise RemoteImageError("the image URL has no host.", "image_url_refused")
    if url.userinfo:
        raise RemoteImageError(
            "image URLs with a user name or password are not fetched.",
            "image_url_refused",
        )


def _failed(url: httpx.URL, exc: Exception) -> RemoteImageError:
    return RemoteImageError(
        f"the image could not be fetched from {url.host!r} ({type(exc).__name__}).",
        "image_fetch_failed",
    )
