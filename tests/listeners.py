"""The TCP sockets some processes listen on, read from /proc (Linux; no psutil needed)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # the process is gone
        pass
    return inodes


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # IPv6 in /proc: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    addr = ipaddress.IPv6Address(words)
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket (v4 and v6) the processes hold."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == "0A" and inode in owner:  # 0A: LISTEN
                addr, port = local.rsplit(":", 1)
                out.append((owner[inode], _address(addr), int(port, 16)))
    return out


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
