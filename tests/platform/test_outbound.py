"""The outbound address policy (controlplane/outbound.py) as a pure function of the URL, the
allowed networks and a resolver the test controls: nothing here opens a socket or asks DNS."""

from __future__ import annotations

import ipaddress

import pytest

from controlplane import outbound

PUBLIC = "93.184.215.14"  # an address on the public internet; never connected to here


def unresolvable(host: str, port: int) -> list[str]:
    raise outbound.Unresolved(f"{host} does not resolve")


def resolves_to(*addresses: str) -> outbound.Resolver:
    def resolver(host: str, port: int) -> list[str]:
        return list(addresses)

    return resolver


# Every spelling of an internal address, with the kind of address the refusal names.
REFUSED_LITERALS = [
    ("http://127.0.0.1:6379/", "127.0.0.1, a loopback address"),
    ("http://127.8.9.10/", "a loopback address"),
    ("http://[::1]:5432/", "::1, a loopback address"),
    ("http://10.0.0.5/", "10.0.0.5, a private address"),
    ("http://172.16.3.4/", "a private address"),
    ("http://172.31.255.255/", "a private address"),
    ("http://192.168.0.1/", "a private address"),
    ("http://100.64.0.1/", "a shared (carrier-grade NAT) address"),
    ("http://[fd00::1]/", "a private address"),
    ("http://[fc00::abcd]/", "a private address"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254, a link-local address"),
    ("http://[fe80::1]/", "a link-local address"),
    ("http://[fe80::1%25eth0]/", "a link-local address"),
    ("http://0.0.0.0/", "an unspecified address"),
    ("http://0/", "0.0.0.0, an unspecified address"),
    ("http://[::]/", "an unspecified address"),
    ("http://224.0.0.1/", "a multicast address"),
    ("http://[ff02::1]/", "a multicast address"),
    ("http://240.0.0.1/", "a reserved address"),
    ("http://[fec0::1]/", "a site-local address"),
    ("http://198.18.0.1/", "a private address"),  # benchmarking, not routed
    # Integer, hexadecimal and octal spellings, read the way browsers and curl read them.
    ("http://2130706433/", "127.0.0.1, a loopback address"),
    ("http://0x7f000001/", "127.0.0.1, a loopback address"),
    ("http://0x7f.1/", "127.0.0.1, a loopback address"),
    ("http://0x7F.0.0.1/", "127.0.0.1, a loopback address"),
    ("http://017700000001/", "127.0.0.1, a loopback address"),
    ("http://127.1/", "127.0.0.1, a loopback address"),
    ("http://127.0.1/", "127.0.0.1, a loopback address"),
    ("http://0xa000005/", "10.0.0.5, a private address"),
    ("http://0xa9.0xfe.0xa9.0xfe/", "169.254.169.254, a link-local address"),
    ("http://2852039166/", "169.254.169.254, a link-local address"),
    ("http://127.0.0.1./", "127.0.0.1, a loopback address"),
    # An IPv4 address inside an IPv6 one: mapped, 6to4, NAT64.
    ("http://[::ffff:127.0.0.1]/", "which is 127.0.0.1, a loopback address"),
    ("http://[::ffff:7f00:1]/", "which is 127.0.0.1, a loopback address"),
    ("http://[::ffff:10.0.0.5]:8080/", "which is 10.0.0.5, a private address"),
    ("http://[::ffff:169.254.169.254]/", "which is 169.254.169.254, a link-local address"),
    ("http://[2002:7f00:1::]/", "which is 127.0.0.1, a loopback address"),
    ("http://[64:ff9b::a00:5]/", "which is 10.0.0.5, a private address"),
    ("https://127.0.0.1/", "a loopback address"),
    ("http://user:password@127.0.0.1/", "a loopback address"),
]


@pytest.mark.parametrize(("url", "reason"), REFUSED_LITERALS)
def test_it_refuses_every_spelling_of_an_internal_address(url, reason):
    def no_lookup(host: str, port: int) -> list[str]:
        raise AssertionError(f"an IP literal was looked up: {host}")

    with pytest.raises(outbound.Refused, match="only public addresses") as refused:
        outbound.check_url(url, resolver=no_lookup)
    assert reason in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://1.2.3.4.5/",
        "http://256.1.1.1/",
        "http://0x100000000/",
        "http://4294967296/",
        "http://foo.123/",
        "http://example.0x7f/",
        "http://0177.0.0.1/",  # httpx refuses a dotted quad with a leading zero outright
    ],
)
def test_it_refuses_a_host_that_reads_as_a_number_but_is_no_address(url):
    with pytest.raises(outbound.Refused):
        outbound.check_url(url, resolver=unresolvable)


@pytest.mark.parametrize(
    "url", ["ftp://example.com/", "file:///etc/passwd", "gopher://127.0.0.1:6379/_", "example.com/hook", "http:///x"]
)
def test_it_refuses_what_is_not_an_http_url_with_a_host(url):
    with pytest.raises(outbound.Refused):
        outbound.check_url(url, resolver=unresolvable)


@pytest.mark.parametrize(
    "url", [f"http://{PUBLIC}/", f"https://{PUBLIC}:8443/hook", "http://[2606:4700:4700::1111]/", "http://1572395790/"]
)
def test_it_accepts_a_public_address(url):
    assert outbound.check_url(url, resolver=unresolvable) == url


@pytest.mark.parametrize("url", ["http://localhost:8000/", "http://LOCALHOST./", "http://testserver/api/"])
def test_it_refuses_the_control_planes_own_host_names_even_allowed(url):
    with pytest.raises(outbound.Refused, match="the control plane's own host"):
        outbound.check_url(url, allowed=[ipaddress.ip_network("0.0.0.0/0")], resolver=resolves_to(PUBLIC))


def test_it_refuses_the_public_url_host(settings):
    settings.PUBLIC_URL = "https://fathom.example.org"
    with pytest.raises(outbound.Refused, match="own host"):
        outbound.check_url("https://FATHOM.example.org/api/", resolver=resolves_to(PUBLIC))


def test_a_name_is_refused_when_any_address_it_resolves_to_is_internal():
    with pytest.raises(outbound.Refused) as refused:
        outbound.check_url("https://hooks.example/x", resolver=resolves_to(PUBLIC, "10.1.2.3"))
    assert str(refused.value).startswith("has the host hooks.example, which resolves to 10.1.2.3, a private address")
    with pytest.raises(outbound.Refused, match="which is 127.0.0.1"):
        outbound.check_url("https://hooks.example/x", resolver=resolves_to("::ffff:127.0.0.1"))


def test_a_name_that_does_not_resolve_yet_is_accepted_and_pinned_later():
    assert outbound.check_url("https://later.example/x", resolver=unresolvable) == "https://later.example/x"
    with pytest.raises(outbound.Unresolved):
        outbound.pin("https://later.example/x", resolver=unresolvable)


def test_a_pinned_target_connects_to_the_checked_address_with_the_name_in_host_and_sni():
    looked_up = []

    def resolver(host: str, port: int) -> list[str]:
        looked_up.append((host, port))
        return [PUBLIC]

    target = outbound.pin("https://user:pw@Hooks.Example:8443/in?x=1", resolver=resolver)
    assert looked_up == [("hooks.example", 8443)]
    assert target.address == ipaddress.ip_address(PUBLIC)
    assert str(target.url) == f"https://user:pw@{PUBLIC}:8443/in?x=1"
    assert (target.host_header, target.sni_hostname) == ("hooks.example:8443", "hooks.example")
    # Plain http has no SNI; an IP literal needs neither a lookup nor SNI.
    assert outbound.pin("http://hooks.example/", resolver=resolver).sni_hostname is None
    literal = outbound.pin("https://[2606:4700:4700::1111]/", resolver=unresolvable)
    assert (str(literal.url), literal.sni_hostname) == ("https://[2606:4700:4700::1111]/", None)


def test_allowed_networks_let_internal_addresses_through_and_nothing_else():
    allowed = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("fd12::/16")]
    for url in ("http://127.0.0.1:9000/", "http://2130706433/", "http://[::ffff:127.0.0.1]/", "http://[fd12::5]/"):
        assert outbound.check_url(url, allowed=allowed, resolver=unresolvable) == url
    assert outbound.pin("http://receiver.internal/", allowed=allowed, resolver=resolves_to("127.0.0.2")).address == (
        ipaddress.ip_address("127.0.0.2")
    )
    for url in ("http://10.0.0.5/", "http://[::1]/", "http://169.254.169.254/", "http://[fd13::5]/"):
        with pytest.raises(outbound.Refused):
            outbound.check_url(url, allowed=allowed, resolver=unresolvable)


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
        ("::ffff:8.8.8.8", None),
        ("127.0.0.1", "a loopback address"),
        ("100.127.255.255", "a shared (carrier-grade NAT) address"),
        ("100.128.0.1", None),
        ("172.15.255.255", None),
        ("172.32.0.1", None),
        ("192.0.2.1", "a private address"),  # documentation
        ("255.255.255.255", "a reserved address"),
        ("::127.0.0.1", "a reserved address"),  # IPv4-compatible, deprecated
    ],
)
def test_address_problem_names_the_kind(address, problem):
    assert outbound.address_problem(ipaddress.ip_address(address)) == problem
