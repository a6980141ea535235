"""The local CA that `edgefire up --tls` makes, named after its state directory."""

from __future__ import annotations

from cryptography.x509.oid import NameOID

from deploy.tls import LocalCA


def _common_name(ca: LocalCA) -> str:
    return ca.certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def test_a_ca_named_after_a_deep_state_directory_is_made_and_names_stay_distinct():
    deep = "/srv/edgefire/" + "nested-directory/" * 8
    first, second = LocalCA(f"edgefire local CA ({deep}a)"), LocalCA(f"edgefire local CA ({deep}b)")
    assert len(_common_name(first)) <= 64 and _common_name(first).startswith("edgefire local CA (/srv/edgefire/")
    assert _common_name(first) != _common_name(second)
    assert _common_name(LocalCA("edgefire local CA (/tmp/x)")) == "edgefire local CA (/tmp/x)"
