"""Errors the agent raises on purpose, beside the engine's; service.py maps each to a gRPC status."""


class AgentError(Exception):
    """Base class of the agent's own refusals."""


class UnknownModelError(AgentError):
    """The request names a model this agent does not host."""


class OverloadedError(AgentError):
    """The KV pool or the queue is over its limit; the caller should try another site."""


class DrainingError(AgentError):
    """The agent is draining and takes no new work."""


class WrongRoleError(AgentError):
    """The site's role does not include this step (e.g. Prefill on a decode-only site)."""


class ListenError(AgentError):
    """An address the configuration names cannot be listened on (another process holds the port, or
    the host is not this machine's)."""


class ModelLoadError(AgentError):
    """A model the configuration names cannot be served: its checkpoint is refused, or it does not fit."""


class LeaseReleasedError(AgentError):
    """A Prefill whose lease id its caller released already: the caller has given up on it."""
