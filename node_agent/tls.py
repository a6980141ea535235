"""TLS for every hop, from PEM files: gRPC credentials and `ssl` contexts, server and client side.

One place turns the configs' file paths into what each transport takes: gRPC (router → agent,
agent → agent), the KV data port (raw sockets wrapped by `ssl`), and HTTPS clients of the registry
(httpx takes an `ssl.SSLContext`). A CA bundle verifies the other side; a certificate and key
identify this side; a client CA on a server demands client certificates (mutual TLS).

`check_bundle` and `check_identity` read the files once at start, so a file that is not PEM, a key
that is not its certificate's, or an expired certificate is one line naming the setting, not a
traceback from deep in a transport (or, for gRPC, a handshake that fails only when a peer calls).
"""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

import grpc
from cryptography import x509


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


def check_bundle(setting: str, path: str) -> None:
    """Raise ValueError naming `setting` unless `path` is a readable PEM bundle of CA certificates."""
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{setting}: {path!r} is not a readable PEM CA bundle ({_reason(exc)})") from None


def check_identity(cert_setting: str, cert: str, key_setting: str, key: str) -> None:
    """Raise ValueError naming the setting at fault unless `cert` is a PEM certificate (chain), now
    valid, and `key` its unencrypted PEM private key."""
    try:
        leaf = x509.load_pem_x509_certificates(Path(cert).read_bytes())[0]
    except OSError as exc:
        raise ValueError(f"{cert_setting}: {cert!r} is not readable ({_reason(exc)})") from None
    except ValueError:
        raise ValueError(f"{cert_setting}: {cert!r} holds no PEM certificate") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    if leaf.not_valid_after_utc < now:
        raise ValueError(f"{cert_setting}: the certificate in {cert!r} expired on "
                         f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; issue a new one")
    if leaf.not_valid_before_utc > now:
        raise ValueError(f"{cert_setting}: the certificate in {cert!r} is not valid before "
                         f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (check this machine's clock)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password="")  # "": an encrypted key fails here instead of prompting
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"{key_setting}: the key in {key!r} does not match the certificate in {cert!r} "
                             f"({cert_setting})") from None
        raise ValueError(f"{key_setting}: {key!r} holds no unencrypted PEM private key") from None
    except OSError as exc:
        raise ValueError(f"{key_setting}: {key!r} is not readable ({_reason(exc)})") from None


def _reason(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or "not PEM"
    return exc.strerror or str(exc)
