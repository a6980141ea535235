"""Secrets the registry hands out (site tokens, API keys): generated once, stored only as hashes.

A SHA-256 of a 256-bit random secret needs no salt or slow hash: there is nothing to brute-force,
and an exact-hash index lookup is what makes per-request checks cheap.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

API_KEY_PREFIX = "ef-"
SITE_TOKEN_PREFIX = "efs-"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def new_site_token() -> str:
    return SITE_TOKEN_PREFIX + secrets.token_urlsafe(32)


def same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
