"""The TCP sockets listening in this network namespace (Linux /proc/net/tcp and tcp6), with the process holding each."""

from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    process: str  # "pid command line", or "?" where the owner is not ours to see

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def listening_sockets() -> list[Listener]:
    owners = socket_owners()
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != TCP_LISTEN:
                continue
            hex_address, hex_port = fields[1].split(":")
            found.append(Listener(kernel_address(hex_address), int(hex_port, 16), owners.get(fields[9], "?")))
    return found


def kernel_address(hex_address: str) -> str:
    """The kernel prints an address as 32-bit words, each in host byte order; an IPv4-mapped one as IPv4."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(struct.pack("=I", int.from_bytes(raw[i:i + 4], "big")) for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def socket_owners() -> dict[str, str]:
    """Socket inode -> "pid command line" of a process holding it (only processes we may look into)."""
    owners = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    owners[target[len("socket:["):-1]] = f"{pid} {command[:80].strip()}"
        except OSError:  # gone, or not ours
            continue
    return owners
