"""The per-site daemon: hosts engines, serves the agent gRPC API, moves KV between agents, heartbeats."""
