"""Addresses and ports for the ranks' rendezvous and the executor's queues.

Mirrors vllm/utils/network_utils.py (get_ip, get_loopback_ip,
get_distributed_init_method, get_tcp_uri, get_open_port).
"""
from __future__ import annotations

import ipaddress
import socket


def get_loopback_ip() -> str:
    """Where the ranks of one host meet (vLLM tries 127.0.0.1, then ::1)."""
    return "127.0.0.1"


def get_ip(peer: str | None = None) -> str:
    """This host's address as `peer` sees it (the interface that routes to it).

    NOTE: a UDP "connect" sends nothing; it only asks the kernel which local
    address a packet to `peer` would leave from. With peer 127.0.0.1 (two
    "nodes" on one machine) that is 127.0.0.1; across hosts it is the address
    on the network they share. vLLM asks for the route to 8.8.8.8 (or
    VLLM_HOST_IP); the master's address is the one that matters here.
    """
    peer = peer or "8.8.8.8"
    family = socket.AF_INET6 if _is_ipv6(peer) else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 80))
            return s.getsockname()[0]
        except OSError:
            return get_loopback_ip()


def get_tcp_uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if _is_ipv6(ip) else f"tcp://{ip}:{port}"


def get_distributed_init_method(ip: str, port: int) -> str:
    """torch.distributed's init_method: rank 0 serves its TCPStore at ip:port."""
    return get_tcp_uri(ip, port)


def get_open_port() -> int:
    """A TCP port free right now (the OS picks it).

    NOTE: freed again before the caller binds it, so another process could
    take it in between; vLLM accepts the same small race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _is_ipv6(address: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address)
    except ValueError:
        return False
