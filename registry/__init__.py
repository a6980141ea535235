"""The central registry: which sites exist, what they serve, and how much room they have.

`registry.store` is the plain SQL store (SQLite or PostgreSQL), `registry.service` the HTTP
service in front of it (agents, routers, operators), and `registry.client` the small client that
agents, routers and the command line use to reach that service.
"""
