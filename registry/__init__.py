"""Adapter registry and control plane: versions, validation, canary and rollback on SQLite/Redis + local/S3."""

from registry.base_model import BaseModelSpec
from registry.errors import (AdapterDisabled, AdapterNotFound, BaseModelNotFound, LifecycleConflict, PermissionDenied,
                             RegistryError, RegistryUnavailable, RegistryValidationError,
                             SourceNotAllowed)
from registry.records import AdapterRecord, AdapterState, AdapterStatus, AuditEntry, Visibility
from registry.registry import Registry
from registry.settings import RegistrySettings

__all__ = [
    "Registry",
    "RegistrySettings",
    "AdapterRecord",
    "AdapterState",
    "AdapterStatus",
    "AuditEntry",
    "BaseModelSpec",
    "Visibility",
    "RegistryError",
    "RegistryUnavailable",
    "RegistryValidationError",
    "SourceNotAllowed",
    "AdapterNotFound",
    "AdapterDisabled",
    "BaseModelNotFound",
    "LifecycleConflict",
    "PermissionDenied",
]
