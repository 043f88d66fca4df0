"""Registry errors. Each carries the HTTP status and a stable machine-readable code so the REST layer
and the serving layer map them without string matching."""

from __future__ import annotations

__all__ = [
    "RegistryError",
    "AdapterNotFound",
    "AdapterDisabled",
    "BaseModelNotFound",
    "RegistryValidationError",
    "SourceNotAllowed",
    "LifecycleConflict",
    "PermissionDenied",
    "RegistryUnavailable",
]


class RegistryError(Exception):
    """Base class; `status` is the HTTP status the control plane answers with."""

    status: int = 400
    code: str = "registry_error"
    audited: bool = False  # the refusal is in the audit log already (Registry.audit_refusal)

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class AdapterNotFound(RegistryError, LookupError):
    status = 404
    code = "adapter_not_found"


class AdapterDisabled(RegistryError):
    # 403 rather than 404: the adapter exists and the caller may see it, it is switched off on purpose.
    status = 403
    code = "adapter_disabled"


class BaseModelNotFound(RegistryError, LookupError):
    status = 404
    code = "base_model_not_found"


class RegistryValidationError(RegistryError, ValueError):
    """Registration refused. `version` is the `failed` version kept as the trace (None when the name
    itself was invalid, so no version could be recorded under it)."""

    status = 422
    code = "validation_failed"

    def __init__(self, message: str, *, code: str = "validation_failed", version: int | None = None):
        super().__init__(message, code=code)
        self.version = version


class SourceNotAllowed(RegistryValidationError):
    """The source URI points outside the allowed roots/buckets or uses a forbidden scheme."""

    status = 400


class LifecycleConflict(RegistryError):
    status = 409
    code = "conflict"


class PermissionDenied(RegistryError, PermissionError):
    status = 403
    code = "forbidden"


class RegistryUnavailable(RegistryError):
    """A store the registry needs cannot be reached (Redis, S3): the request is not at fault, a retry after
    `retry_after_s` may succeed. `dependency` is "metadata" (the metadata store) or "blobs" (the blob store)."""

    status = 503
    code = "registry_unavailable"
    retry_after_s = 2

    def __init__(self, dependency: str, cause: BaseException):
        super().__init__(f"the registry's {'metadata store' if dependency == 'metadata' else 'blob store'} is "
                         f"unreachable ({type(cause).__name__}); retry in a few seconds")
        self.dependency = dependency
