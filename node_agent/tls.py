"""TLS for every hop, from PEM files: gRPC credentials and `ssl` contexts, server and client side.

One place turns the configs' file paths into what each transport takes: gRPC (router → agent,
agent → agent), the KV data port (raw sockets wrapped by `ssl`), and HTTPS clients of the registry
(httpx takes an `ssl.SSLContext`). A CA bundle verifies the other side; a certificate and key
identify this side; a client CA on a server demands client certificates (mutual TLS).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """For calling TLS agents: `ca` verifies them (None: the system roots); cert/key answer mutual TLS."""
    return grpc.ssl_channel_credentials(_read(ca), _read(key), _read(cert))


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """An agent's gRPC port; with `client_ca`, a caller without a certificate signed by it is refused."""
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=_read(client_ca),
                                       require_client_auth=client_ca is not None)


def client_context(ca: str | None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """For sockets and HTTPS: verifies the server's name and chain against `ca` (None: system roots)."""
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca:
        context.load_verify_locations(cafile=client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
