"""Test hosts on one machine: network namespaces joined by a bridge, each with its own address,
for multi-host tests and benchmarks (needs root and iproute2). Everything made is removed on
exit, also when the body fails; only addresses of the namespaces made here are ever used."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# NOTE: a /24 out of 10.213.0.0/16 picked from the pid, so concurrent runs do not collide; the
# bridge takes .1 (the test process's own address on the bridge), hosts .2 and up.
_BASE_NETWORK = ipaddress.ip_network("10.213.0.0/16")
# `ip netns exec NS cmd` bind-mounts /etc/netns/NS/hosts over /etc/hosts for cmd: each test host
# resolves names from a file of its own (glibc reads it again at every lookup).
_NETNS_ETC = Path("/etc/netns")


class NetnsUnavailable(RuntimeError):
    """This machine refuses network namespaces (not root, or no iproute2)."""


@dataclass
class TestHost:
    __test__ = False  # not a pytest test class

    name: str  # the namespace
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def set_names(self, names: dict[str, list[str]]) -> None:
        """What names resolve to inside this host (its /etc/hosts): name -> addresses, every one
        an A record. Rewritten in place, so processes already running see the change at their
        next lookup; set it once before starting them (the mount is made at start)."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{address} {name}" for name, addresses in names.items() for address in addresses]
        directory = _NETNS_ETC / self.name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n")  # NOTE: same inode: the bind mount follows


@dataclass
class TestNetwork:
    """`with TestNetwork(["proxy", "prefill0", ...]) as net:` makes one namespace per name;
    net.hosts[name].address is its address, net.gateway the root namespace's."""

    __test__ = False  # not a pytest test class

    names: list[str]
    tag: str = field(default_factory=lambda: f"pd{os.getpid() % 100000}")
    hosts: dict[str, TestHost] = field(default_factory=dict)
    gateway: str = ""

    def __enter__(self) -> TestNetwork:
        _check_available()
        subnet = list(_BASE_NETWORK.subnets(new_prefix=24))[os.getpid() % 256]
        addresses = [str(a) for a in subnet.hosts()]
        self.gateway = addresses[0]
        try:
            self._make_bridge(addresses[0], subnet.prefixlen)
            for i, name in enumerate(self.names):
                self.hosts[name] = self._make_host(i, addresses[i + 1], subnet.prefixlen)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *_exc) -> None:
        for i in range(len(self.names)):
            _ip("netns", "del", f"{self.tag}-h{i}", check=False)
            shutil.rmtree(_NETNS_ETC / f"{self.tag}-h{i}", ignore_errors=True)
            _ip("link", "del", f"{self.tag}v{i}", check=False)  # gone with its namespace, normally
        _ip("link", "del", f"{self.tag}br", check=False)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def _make_bridge(self, address: str, prefixlen: int) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{address}/{prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _make_host(self, index: int, address: str, prefixlen: int) -> TestHost:
        namespace, outside, inside = f"{self.tag}-h{index}", f"{self.tag}v{index}", f"{self.tag}p{index}"
        _ip("netns", "add", namespace)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        for args in (("addr", "add", f"{address}/{prefixlen}", "dev", inside), ("link", "set", inside, "up"),
                     ("link", "set", "lo", "up"), ("route", "add", "default", "via", self.gateway)):
            _ip("-n", namespace, *args)
        return TestHost(namespace, address)


def _check_available() -> None:
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")


def _ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
