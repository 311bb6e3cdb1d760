"""Where the control plane may send a request whose URL a user chose (webhooks; any later feature
that calls out to a user's URL goes through here too).

A user's URL must not turn the control plane into a way into its own network (server-side request
forgery, OWASP API7:2023): a POST to Redis, PostgreSQL, a replica's port or a cloud metadata
service, with the answer shown back. So a URL is refused when its host is, or resolves to, an
address that is not public (loopback, private, shared, link-local, unspecified, multicast,
reserved, …; an IPv4 address inside an IPv6 one counts as that IPv4 address), or is one of the
control plane's own host names. The operators may let some internal networks through
(`allowed`, from settings).

- `check_url` when a URL is saved: IP literals (in any spelling a browser or curl accepts:
  2130706433, 0x7f.1 and 017700000001 are 127.0.0.1) and names that resolve are checked; a
  name that does not resolve yet is accepted, and checked when it is used.
- `stream` for each request: the host is resolved once, every address it resolves to is
  checked, and the connection goes to the address that was checked, with the name in the Host
  header and in TLS's SNI (and the certificate checked against it). No second lookup happens, so
  a name cannot resolve to a public address for the check and to an internal one for the
  connection (DNS rebinding). Redirects are not followed and no proxy from the environment is
  used: either would send the request somewhere that was not checked.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings
from django.http.request import validate_host

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) → the addresses a connection to it could go to.
Resolver = Callable[[str, int], list[str]]

SCHEMES = {"http": 80, "https": 443}

# Shared address space (RFC 6598, carrier-grade NAT): internal, although not "private".
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")
# Well-known NAT64 prefix: a gateway forwards 64:ff9b::a.b.c.d to the IPv4 address a.b.c.d.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# What each kind of internal address is called in a refusal, checked in this order (ipaddress
# counts loopback, link-local and reserved addresses as private too; the narrower name says more).
_KINDS = (
    ("is_unspecified", "an unspecified address"),
    ("is_loopback", "a loopback address"),
    ("is_link_local", "a link-local address"),
    ("is_multicast", "a multicast address"),
    ("is_site_local", "a site-local address"),
    ("is_reserved", "a reserved address"),
    ("is_private", "a private address"),
)
# A host that ends in a number is an IPv4 address however it is spelled (the URL standard's
# "ends in a number" rule, which browsers and curl follow): each of its up to four parts is
# decimal, octal (a leading 0) or hexadecimal (0x), and the last part fills the remaining bytes.
_NUMBER = r"(?:0[xX][0-9a-fA-F]*|[0-9]+)"
_ENDS_IN_NUMBER = re.compile(rf"(?:^|\.){_NUMBER}\.?$")
_NUMERIC_HOST = re.compile(rf"{_NUMBER}(?:\.{_NUMBER}){{0,3}}\.?")


class Refused(ValueError):
    """The URL may not be requested. Its text is the reason, written to follow the field's name
    ("url names 127.0.0.1, a loopback address")."""


class Unresolved(OSError):
    """The URL's host name does not resolve (now): a request may succeed later."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where a request to a checked URL goes: the URL with its host replaced by the checked
    address, and the name the receiver must see in the Host header and in TLS's SNI."""

    url: httpx.URL  # the host is the checked address
    address: Address
    host_header: str  # the URL's own host[:port]
    sni_hostname: str | None  # https to a name: the name the certificate must be for


def resolve_host(host: str, port: int) -> list[str]:
    """The system resolver (getaddrinfo): every address a TCP connection to `host` could go to.
    Tests replace this module attribute with a resolver of their own."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise Unresolved(f"{host} does not resolve: {exc}") from None
    return [str(info[4][0]) for info in infos]


def parse(url: str) -> tuple[httpx.URL, str, int]:
    """The URL (http or https, with a host), its host (lower case, without brackets) and its port."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in SCHEMES:
        raise Refused(f"must be an http:// or https:// URL; got scheme {scheme or '(none)'!r}")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise Refused(f"is not a valid URL: {exc}") from None
    if not parsed.host:
        raise Refused("must name a host")
    return parsed, parsed.host, parsed.port or SCHEMES[scheme]


def literal(host: str) -> Address | None:
    """The address `host` spells, in any spelling a browser or curl reads as one; None for a
    name. Raises Refused for a host that reads as a number but is no address ("1.2.3.4.5")."""
    try:
        return ipaddress.ip_address(host.replace("%25", "%"))  # an IPv6 zone is %25-escaped in URLs
    except ValueError:
        pass
    if not _ENDS_IN_NUMBER.search(host):
        return None
    # inet_aton reads exactly the URL standard's IPv4 forms (1 to 4 parts, decimal, octal, hex).
    if _NUMERIC_HOST.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host.removesuffix(".")))
        except OSError:
            pass
    raise Refused(f"has the host {host!r}, which reads as a number but is not an IPv4 address")


def address_problem(address: Address, allowed: Iterable[Network] = ()) -> str | None:
    """Why a request may not go to `address` ("a loopback address"), or None when it may."""
    allowed = list(allowed)
    if any(address in network for network in allowed):
        return None
    if isinstance(address, ipaddress.IPv6Address):
        # An IPv4 address carried inside an IPv6 one reaches that IPv4 address.
        inner = (
            address.ipv4_mapped
            or address.sixtofour
            or (ipaddress.IPv4Address(address.packed[-4:]) if address in _NAT64 else None)
        )
        if inner is not None:
            problem = address_problem(inner, allowed)
            return f"which is {inner}, {problem}" if problem else None
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return "a shared (carrier-grade NAT) address"
    for attribute, kind in _KINDS:
        if getattr(address, attribute, False):
            return kind
    if not address.is_global:
        return "not a public address"
    return None


def own_host(host: str) -> bool:
    """Whether `host` (a name) is one of the control plane's own: ALLOWED_HOSTS (a "*" aside)
    or the host of FATHOM_PUBLIC_URL."""
    public = httpx.URL(settings.PUBLIC_URL).host
    patterns = [pattern for pattern in settings.ALLOWED_HOSTS if pattern != "*"] + [public]
    return validate_host(host.removesuffix("."), patterns)


def check_url(url: str, *, allowed: Iterable[Network] = (), resolver: Resolver | None = None) -> str:
    """`url` if it may be saved; raises Refused naming why not. A name that does not resolve
    (yet) passes: `stream` checks it again, resolved, at each request."""
    try:
        pin(url, allowed=allowed, resolver=resolver)
    except Unresolved:
        pass
    return url


def pin(url: str, *, allowed: Iterable[Network] = (), resolver: Resolver | None = None) -> Target:
    """Resolves the URL's host once and checks every address it resolves to; the Target says
    where to connect. Raises Refused (the policy says no) or Unresolved (no address, now)."""
    parsed, host, port = parse(url)
    allowed = list(allowed)
    address = literal(host)
    if address is not None:
        addresses = [address]
    else:
        if own_host(host):
            raise Refused(f"names {host}, the control plane's own host")
        found = (resolver or resolve_host)(host, port)
        if not found:
            raise Unresolved(f"{host} resolves to no address")
        addresses = [ipaddress.ip_address(a) for a in found]
    for each in addresses:
        problem = address_problem(each, allowed)
        if problem is not None:
            said = f"names {each}" if address is not None else f"has the host {host}, which resolves to {each}"
            raise Refused(f"{said}, {problem}: only public addresses may be reached")
    checked = addresses[0]
    return Target(
        # httpx brackets an IPv6 host itself; a zone (fe80::1%eth0) stays with the address.
        url=parsed.copy_with(host=str(checked)),
        address=checked,
        host_header=parsed.netloc.decode("ascii"),
        sni_hostname=host if parsed.scheme == "https" and address is None else None,
    )


@contextmanager
def stream(
    method: str,
    url: str,
    *,
    allowed: Iterable[Network] = (),
    resolver: Resolver | None = None,
    headers: dict[str, str] | None = None,
    timeout: float,
    **kwargs: Any,
) -> Iterator[httpx.Response]:
    """Sends one request to `url` after `pin` checked it, connected to the checked address; the
    response is streamed (read what you need of it). Raises Refused, Unresolved or
    httpx.HTTPError."""
    target = pin(url, allowed=allowed, resolver=resolver)
    extensions = {"sni_hostname": target.sni_hostname} if target.sni_hostname else {}
    # trust_env=False: an HTTP(S)_PROXY from the environment would connect (and resolve) instead.
    with httpx.Client(trust_env=False, follow_redirects=False, timeout=timeout) as client:
        request = client.build_request(
            method, target.url, headers={**(headers or {}), "Host": target.host_header}, extensions=extensions, **kwargs
        )
        response = client.send(request, stream=True)
        try:
            yield response
        finally:
            response.close()


def read_capped(response: httpx.Response, chars: int) -> str:
    """At most `chars` characters of the response's body, reading no more of it than they take:
    a receiver cannot make the control plane hold a large answer."""
    limit = chars * 4  # UTF-8 spends at most 4 bytes a character
    read = bytearray()
    for chunk in response.iter_bytes():
        read += chunk
        if len(read) >= limit:
            break
    try:
        text = bytes(read[:limit]).decode(response.charset_encoding or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        text = bytes(read[:limit]).decode("utf-8", errors="replace")
    return text[:chars]
