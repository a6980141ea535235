"""The central registry: which sites exist, what they serve, and how much room they have.

`registry.store` is the plain SQL store (SQLite or PostgreSQL), `registry.service` the HTTP
service in front of it (agents, routers, operators), and `registry.client` the small client that
agents, routers and the command line use to reach that service.

Shared with agents and routers as well: `registry.wire`, the heartbeat wire contract (fields,
types, bounds); `registry.http_head`, the request-head limits both HTTP services run under; and
`registry.log_limit`, rate-limited log lines for what a remote party can repeat.
"""
