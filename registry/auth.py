"""Bearer-token authentication and roles for the control plane.

Roles: `admin` may do everything; `publisher` registers and manages only adapters of its own tenant.
Tokens come from the app factory (or env REGISTRY_TOKENS as JSON, REGISTRY_ADMIN_TOKEN for one admin).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from typing import Literal

from fastapi import Request
from pydantic import BaseModel

from registry.errors import RegistryError

__all__ = ["Principal", "AuthError", "TokenAuth", "tokens_from_env"]


class Principal(BaseModel):
    name: str  # recorded as the audit log's "who"
    role: Literal["admin", "publisher"]
    tenant: str | None = None


class AuthError(RegistryError):
    status = 401
    code = "unauthorized"
    challenge = "Bearer"  # the WWW-Authenticate scheme the client is asked for


def tokens_from_env() -> dict[str, dict]:
    tokens = json.loads(os.environ.get("REGISTRY_TOKENS") or "{}")
    if admin := os.environ.get("REGISTRY_ADMIN_TOKEN"):
        tokens[admin] = {"role": "admin", "name": "admin"}
    return tokens


class TokenAuth:
    """FastAPI dependency: `Authorization: Bearer <token>` -> Principal, else 401."""

    def __init__(self, tokens: dict[str, dict]):
        self._principals: list[tuple[bytes, Principal]] = []
        for token, spec in tokens.items():
            role = spec.get("role")
            if role == "publisher" and not spec.get("tenant"):
                raise ValueError("a publisher token needs a tenant")
            default_name = f"{role}:{spec.get('tenant') or '*'}:{hashlib.sha256(token.encode()).hexdigest()[:8]}"
            self._principals.append((token.encode(), Principal(name=spec.get("name") or default_name, role=role,
                                                                 tenant=spec.get("tenant"))))

    def __call__(self, request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise AuthError("missing bearer token: send 'Authorization: Bearer TOKEN'")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError(f"expected a bearer token ('Authorization: Bearer TOKEN'), got {scheme[:20]!r} "
                            f"credentials")
        return self._principal(token.strip().encode())

    def browser(self, request: Request) -> Principal:
        """For pages a browser opens (the docs): the token as a Bearer header or as the password of HTTP Basic
        auth, which the browser asks its user for and then sends with every request to the same place."""
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        try:
            if scheme.lower() == "basic":
                return self._principal(base64.b64decode(value.strip(), validate=True).partition(b":")[2])
            return self(request)
        except (AuthError, ValueError):
            err = AuthError("the admin token is needed: give it as the password (any user name)")
            err.challenge = 'Basic realm="loraserve control plane"'
            raise err from None

    def _principal(self, given: bytes) -> Principal:
        found = None
        for known, principal in self._principals:  # compare against every token: no early-exit timing signal
            if hmac.compare_digest(known, given):
                found = principal
        if found is None:
            raise AuthError("invalid bearer token")
        return found
