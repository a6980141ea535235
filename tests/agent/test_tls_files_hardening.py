"""TLS files an operator gets wrong (not PEM, a key of another certificate, expired) are one line at
start naming the setting and the file, for the agent, the router and the registry alike."""

from __future__ import annotations

import datetime
import logging

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from deploy.cli import build_parser
from node_agent.config import ConfigError, load_config
from registry.cli import run_serve
from router.config import config_from_dict
from tests.agent.test_config import site_toml, write


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, local_tls):
    """Files that look right by name: junk, another certificate's key, an expired certificate."""
    from deploy.tls import LocalCA

    directory = tmp_path_factory.mktemp("bad-tls")
    (directory / "junk.pem").write_text("not a certificate\n")
    _, other_key = LocalCA().issue("other", ["127.0.0.1"])
    (directory / "other-key.pem").write_bytes(other_key)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired")])
    now = datetime.datetime.now(datetime.timezone.utc)
    expired = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
               .serial_number(1).not_valid_before(now - datetime.timedelta(days=10))
               .not_valid_after(now - datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (directory / "expired.pem").write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    (directory / "expired-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return {name: str(directory / f"{name}.pem") for name in ("junk", "other-key", "expired", "expired-key")}


def cases(local_tls, bad: dict) -> list[tuple[str, str, str, str]]:
    """(cert, key, ca, words expected in the error) for each mistake."""
    return [
        (bad["junk"], local_tls.key, local_tls.ca, "tls_cert: '{junk}' holds no PEM certificate"),
        (local_tls.cert, bad["other-key"], local_tls.ca,
         "tls_key: the key in '{other-key}' does not match the certificate in '{cert}'"),
        (local_tls.cert, bad["junk"], local_tls.ca, "tls_key: '{junk}' holds no unencrypted PEM private key"),
        (bad["expired"], bad["expired-key"], local_tls.ca, "tls_cert: the certificate in '{expired}' expired on"),
        (local_tls.cert, local_tls.key, bad["junk"], "tls_ca: '{junk}' is not a readable PEM CA bundle"),
    ]


def expected(words: str, local_tls, bad: dict) -> str:
    return words.format(cert=local_tls.cert, **bad)


@pytest.mark.parametrize("index", range(5))
def test_agent_refuses_bad_tls_files_at_start(tmp_path, tiny_model_dir, local_tls, bad_files, index):
    cert, key, ca, words = cases(local_tls, bad_files)[index]
    extra = f'tls_cert = "{cert}"\ntls_key = "{key}"\ntls_ca = "{ca}"\ntls_client_ca = "{local_tls.ca}"'
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, site_toml(tiny_model_dir, extra)), environ={})
    assert expected(words, local_tls, bad_files) in str(error.value)


def test_agent_refuses_a_client_ca_that_is_not_pem(tmp_path, tiny_model_dir, local_tls, bad_files):
    extra = f'tls_cert = "{local_tls.cert}"\ntls_key = "{local_tls.key}"\ntls_client_ca = "{bad_files["junk"]}"'
    with pytest.raises(ConfigError, match="tls_client_ca: .* is not a readable PEM CA bundle"):
        load_config(write(tmp_path, site_toml(tiny_model_dir, extra)), environ={})


def test_agent_accepts_good_tls_files(tmp_path, tiny_model_dir, local_tls):
    extra = f'tls_cert = "{local_tls.cert}"\ntls_key = "{local_tls.key}"\ntls_ca = "{local_tls.ca}"'
    assert load_config(write(tmp_path, site_toml(tiny_model_dir, extra)), environ={}).tls_cert == local_tls.cert


@pytest.mark.parametrize("index", range(5))
def test_router_refuses_bad_tls_files_at_start(local_tls, bad_files, index):
    cert, key, ca, words = cases(local_tls, bad_files)[index]
    with pytest.raises(ConfigError) as error:
        config_from_dict({"tls_cert": cert, "tls_key": key, "tls_ca": ca, "agent_tls": True})
    assert expected(words, local_tls, bad_files) in str(error.value)


def test_router_refuses_a_client_key_of_another_certificate(local_tls, bad_files):
    with pytest.raises(ConfigError, match="agent_client_key: the key in .* does not match"):
        config_from_dict({"agent_tls": True, "agent_client_cert": local_tls.cert,
                          "agent_client_key": bad_files["other-key"]})


@pytest.mark.parametrize("index", range(4))
def test_registry_refuses_bad_tls_files_at_start(tmp_path, local_tls, bad_files, caplog, index):
    cert, key, _, words = cases(local_tls, bad_files)[index]
    args = build_parser().parse_args(["registry", "serve", "--db", f"sqlite:///{tmp_path}/r.db", "--admin-token", "a",
                                      "--router-token", "r", "--tls-cert", cert, "--tls-key", key])
    with caplog.at_level(logging.ERROR, logger="registry.cli"):
        assert run_serve(args) == 2
    assert expected(words, local_tls, bad_files).replace("tls_", "--tls-") in caplog.text
    assert not (tmp_path / "r.db").exists()
