"""A local certificate authority for `edgefire up --tls` (and tests): a CA and certificates it signs.

    ca = LocalCA()
    cert_pem, key_pem = ca.issue("router", ["127.0.0.1", "localhost"])

Keys are ECDSA P-256 (fast to make and to handshake). Every issued certificate names its hosts as
subject alternative names (IP addresses as IP SANs) and may serve and call (server and client
auth), so a site's one certificate also identifies it to peers that demand client certificates.
The CA's key lives only in memory: restarting `edgefire up` makes a new CA.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30


MAX_COMMON_NAME = 64  # X.509's upper bound on a common name


def _common_name(name: str) -> str:
    """name, or where longer than X.509 allows (a CA named after a deep state directory) its head and a
    digest of the whole, so two long names still differ."""
    if len(name) <= MAX_COMMON_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{name[:MAX_COMMON_NAME - len(digest) - 4]}... {digest}"


class LocalCA:
    def __init__(self, name: str = "edgefire local CA") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _common_name(name))])
        now = _now()
        self.certificate = (
            _builder(self._name, self._key.public_key(), now)
            .issuer_name(self._name)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256()))

    @property
    def cert_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, hosts: list[str]) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) for `name`, valid for `hosts` (names or IP addresses)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        certificate = (
            _builder(subject, key.public_key(), _now())
            .issuer_name(self._name)
            .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in dict.fromkeys(hosts)]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                           critical=False)
            .sign(self._key, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def local_hosts(host: str) -> list[str]:
    """The names a client on this machine may use for a process listening on `host`."""
    hosts = ["127.0.0.1", "localhost", "::1"]
    return hosts if host in ("0.0.0.0", "::", "") else [host, *hosts]


def _builder(subject: x509.Name, public_key, now: datetime.datetime) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
