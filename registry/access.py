"""Credentials kept in the registry: per-site agent tokens and the routers' API keys.

Only SHA-256 hashes are stored; the secret is returned once, at issue time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, delete, insert, select, update

from registry import audit, tombstones, validate
from registry.credentials import hash_secret, new_api_key, new_site_token
from registry.db import writer
from registry.errors import InvalidInput, NotFound
from registry.records import ApiKey, ApiKeySpec, Page
from registry.sql import SITES, site_id
from registry.tables import ApiKeyRow, SiteTokenRow
from registry.tombstones import DeletedSite

API_KEYS = ApiKeyRow.__table__
SITE_TOKENS = SiteTokenRow.__table__
MAX_TOKENS_PER_QUERY = 1000
KEY_PREFIX_CHARS = 10


@dataclass(slots=True, frozen=True)
class SiteIdentity:
    """The site a token is bound to."""

    site_id: int
    name: str


class AccessStore:
    def __init__(self, engine: Engine, clock: Callable[[], float] = time.time) -> None:
        self._read = engine
        self._write = writer(engine)
        self._clock = clock

    def issue_site_token(self, name: str, actor: str, revoke_previous: bool = False) -> str:
        """A new token for the site's agent. With revoke_previous (a rotation) older tokens stop working."""
        token = new_site_token()
        with self._write.begin() as conn:
            found = site_id(conn, name, lock=True)
            if revoke_previous:
                conn.execute(delete(SITE_TOKENS).where(SITE_TOKENS.c.site_id == found))
            conn.execute(insert(SITE_TOKENS).values(site_id=found, token_hash=hash_secret(token), created_at=self._clock()))
            action = "site_token.rotate" if revoke_previous else "site_token.issue"
            audit.record(conn, self._clock(), actor, action, name)
        return token

    def site_for_token(self, token: str) -> SiteIdentity | None:
        return self.sites_for_tokens([token]).get(token)

    def sites_for_tokens(self, tokens: list[str]) -> dict[str, SiteIdentity]:
        """The site of each valid token among `tokens`; unknown tokens are absent."""
        by_hash = {hash_secret(token): token for token in tokens}
        found: dict[str, SiteIdentity] = {}
        with self._read.connect() as conn:
            for hashes in _chunks(list(by_hash)):
                query = (
                    select(SITES.c.id, SITES.c.name, SITE_TOKENS.c.token_hash)
                    .join(SITE_TOKENS, SITE_TOKENS.c.site_id == SITES.c.id)
                    .where(SITE_TOKENS.c.token_hash.in_(hashes))
                )
                for row in conn.execute(query):
                    found[by_hash[row.token_hash]] = SiteIdentity(row.id, row.name)
        return found

    def deleted_sites_for_tokens(self, tokens: list[str]) -> dict[str, DeletedSite]:
        """The deleted site of each tombstoned token among `tokens` (registry.tombstones); others are absent."""
        by_hash = {hash_secret(token): token for token in tokens}
        deleted: dict[str, DeletedSite] = {}
        with self._read.connect() as conn:
            for hashes in _chunks(list(by_hash)):
                for token_hash, site in tombstones.deleted_sites(conn, hashes, self._clock()).items():
                    deleted[by_hash[token_hash]] = site
        return deleted

    def create_api_key(self, spec: ApiKeySpec, actor: str, secret: str | None = None) -> tuple[ApiKey, str]:
        """Returns the key record and its secret; the secret is not retrievable later.

        `secret` imports a key chosen elsewhere (the one-machine launcher's `--api-key`)."""
        validate.api_key_spec(spec)
        if secret is not None and len(secret) < 16:
            raise InvalidInput("an imported API key must be at least 16 characters")
        secret = secret or new_api_key()
        now = self._clock()
        with self._write.begin() as conn:
            new_id = conn.execute(insert(API_KEYS).values(
                name=spec.name, key_hash=hash_secret(secret), key_prefix=key_prefix(secret),
                allowed_regions=json.dumps(spec.allowed_regions), requests_per_minute=spec.requests_per_minute,
                tokens_per_minute=spec.tokens_per_minute, revoked=False, created_at=now,
            )).inserted_primary_key[0]
            audit.record(conn, now, actor, "api_key.create", f"api-key:{new_id}", {
                "name": spec.name, "allowed_regions": spec.allowed_regions,
                "requests_per_minute": spec.requests_per_minute, "tokens_per_minute": spec.tokens_per_minute,
            })
            row = conn.execute(API_KEYS.select().where(API_KEYS.c.id == new_id)).one()
        return _api_key(row), secret

    def list_api_keys(self, limit: int = 100, cursor: str | None = None) -> Page[ApiKey]:
        validate.page_limit(limit)
        query = API_KEYS.select().order_by(API_KEYS.c.id).limit(limit + 1)
        if cursor is not None:
            query = query.where(API_KEYS.c.id > validate.id_cursor(cursor))
        with self._read.connect() as conn:
            rows = conn.execute(query).all()
        keys = [_api_key(r) for r in rows[:limit]]
        return Page(keys, str(keys[-1].id) if len(rows) > limit else None)

    def get_api_key(self, key_id: int) -> ApiKey:
        with self._read.connect() as conn:
            row = conn.execute(API_KEYS.select().where(API_KEYS.c.id == key_id)).first()
        if row is None:
            raise NotFound(f"unknown API key id {key_id}", "api_key_not_found")
        return _api_key(row)

    def revoke_api_key(self, key_id: int, actor: str) -> ApiKey:
        """Idempotent: revoking a revoked key keeps its first revocation time."""
        now = self._clock()
        with self._write.begin() as conn:
            row = conn.execute(API_KEYS.select().where(API_KEYS.c.id == key_id).with_for_update()).first()
            if row is None:
                raise NotFound(f"unknown API key id {key_id}", "api_key_not_found")
            if not row.revoked:
                conn.execute(update(API_KEYS).where(API_KEYS.c.id == key_id).values(revoked=True, revoked_at=now))
            audit.record(conn, now, actor, "api_key.revoke", f"api-key:{key_id}", {"name": row.name})
            row = conn.execute(API_KEYS.select().where(API_KEYS.c.id == key_id)).one()
        return _api_key(row)

    def lookup_api_key(self, secret: str) -> ApiKey | None:
        """The key a router was shown, or None when it is unknown or revoked."""
        with self._read.connect() as conn:
            row = conn.execute(API_KEYS.select().where(API_KEYS.c.key_hash == hash_secret(secret))).first()
        if row is None or row.revoked:
            return None
        return _api_key(row)


def _chunks(hashes: list[str]) -> list[list[str]]:
    return [hashes[start:start + MAX_TOKENS_PER_QUERY] for start in range(0, len(hashes), MAX_TOKENS_PER_QUERY)]


def key_prefix(secret: str) -> str:
    """What the admin API shows of a key so operators recognise it: its first 10 characters, or a
    quarter of it when shorter. An imported key may be as short as 16 characters, and 10 of those
    would leave too little of it secret."""
    return secret[:min(KEY_PREFIX_CHARS, len(secret) // 4)]


def _api_key(row) -> ApiKey:
    return ApiKey(
        id=row.id, name=row.name, key_prefix=row.key_prefix, allowed_regions=json.loads(row.allowed_regions),
        requests_per_minute=row.requests_per_minute, tokens_per_minute=row.tokens_per_minute,
        revoked=bool(row.revoked), created_at=row.created_at, revoked_at=row.revoked_at,
    )
