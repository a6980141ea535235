"""What the registry store raises when a request cannot be carried out.

Each error names the field or thing to fix; the HTTP layer maps the class to a status code.
"""

from __future__ import annotations


class RegistryStoreError(Exception):
    code = "registry_error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidInput(RegistryStoreError):
    code = "invalid_field"


class NotFound(RegistryStoreError):
    code = "not_found"


class Conflict(RegistryStoreError):
    code = "conflict"
