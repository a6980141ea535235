"""The router: the public OpenAI-compatible endpoint that places each request on edge sites.

`router.server.Router` runs one in-process (tests, the one-machine launcher); `edgefire router`
(router/cli.py) runs one from a TOML file. Placement is pure (router/placement.py); everything that
talks to the network lives at the edges (snapshot_feed.py, api_keys.py, app.py; agents are called through
`node_agent.client.AgentPool`, the one agent client).
"""
