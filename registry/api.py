"""Control-plane REST API (FastAPI). `create_app(registry, tokens)` is mountable in Ray Serve; standalone:
`uvicorn --factory registry.api:create_app` (settings and tokens from the environment)."""


from typing import Annotated

from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from registry.auth import Principal, TokenAuth, tokens_from_env
from registry.base_model import BaseModelSpec
from registry.errors import AdapterNotFound, PermissionDenied, RegistryError
from registry.records import AdapterRecord, AdapterState, AuditEntry, Visibility
from registry.registry import Registry

__all__ = ["create_app"]


class RegisterRequest(BaseModel):
    name: str = Field(description="adapter name; 1-64 of [A-Za-z0-9_.-]")
    source_uri: str = Field(description="s3://bucket/prefix/dir under an allowed prefix, or an absolute local "
                                        "directory under an allowed root")
    sha256: dict[str, str] = Field(description="file name -> hex sha256, one per file in the source")
    base_model: str
    tenant: str | None = Field(default=None, description="owner tenant (publishers: their own, implied)")
    visibility: Visibility = Visibility.public
    labels: dict[str, str] = Field(default_factory=dict)
    description: str = Field(default="", max_length=4000)
    activate: bool = Field(default=False, description="promote right after validation")


MAX_INT = 2**62  # keeps ids inside SQLite INTEGER and Redis stream-id range


class PromoteRequest(BaseModel):
    version: int = Field(ge=1, le=MAX_INT)


class CanaryRequest(BaseModel):
    version: int = Field(ge=1, le=MAX_INT)
    weight: float = Field(gt=0.0, lt=1.0, description="share of requests served by the canary version")


class BaseModelRequest(BaseModel):
    name: str
    config: dict = Field(description="the model's config.json contents")
    aliases: list[str] = Field(default_factory=list)


class AdapterSummary(BaseModel):
    name: str
    owner_tenant: str | None
    active_version: int | None
    canary_version: int | None
    canary_weight: float
    disabled: bool
    latest_version: int | None
    active: AdapterRecord | None


class ErrorBody(BaseModel):
    message: str
    type: str
    code: str


class ErrorResponse(BaseModel):
    error: ErrorBody


def _error(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status,
                        headers=headers)


def _summary(state: AdapterState) -> AdapterSummary:
    return AdapterSummary(name=state.name, owner_tenant=state.owner_tenant, active_version=state.active_version,
                          canary_version=state.canary_version, canary_weight=state.canary_weight,
                          disabled=state.disabled, latest_version=max(state.versions, default=None),
                          active=state.versions.get(state.active_version) if state.active_version else None)


def _can_see(p: Principal, state: AdapterState) -> bool:
    if p.role == "admin" or state.owner_tenant == p.tenant:
        return True
    active = state.versions.get(state.active_version) if state.active_version else None
    return active is not None and active.visible_to(p.tenant)


def _require_admin(p: Principal) -> None:
    if p.role != "admin":
        raise PermissionDenied(f"{p.name} (role {p.role}) may not do this; admin only")


def create_app(registry: Registry | None = None, tokens: dict[str, dict] | None = None) -> FastAPI:
    registry = registry or Registry.from_settings()
    auth = TokenAuth(tokens_from_env() if tokens is None else tokens)
    Caller = Annotated[Principal, Depends(auth)]
    Name = Annotated[str, Path(description="adapter name")]
    errors = {k: {"model": ErrorResponse} for k in (400, 401, 403, 404, 409, 422)}
    app = FastAPI(title="LoRA adapter registry", version="1", responses=errors)

    @app.exception_handler(RegistryError)
    async def _registry_error(request: Request, exc: RegistryError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.message, exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _error(422, msg or "invalid request", "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "http_error")

    def owned_state(p: Principal, name: str) -> AdapterState:
        """The adapter a mutation targets; publishers only act on their tenant's adapters."""
        state = registry.get(name)
        if p.role == "admin" or state.owner_tenant == p.tenant:
            return state
        if _can_see(p, state):
            raise PermissionDenied(f"adapter {name!r} belongs to another tenant")
        raise AdapterNotFound(f"adapter {name!r} not found")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "revision": registry.revision()}

    @app.post("/v1/adapters", status_code=201, response_model=AdapterRecord)
    def register(body: RegisterRequest, p: Caller):
        tenant = body.tenant
        if p.role == "admin" and tenant is None:
            # an admin adding a version to an existing adapter acts on behalf of its owner
            existing = registry.metadata.get_state(body.name) if isinstance(body.name, str) else None
            tenant = existing.owner_tenant if existing else None
        if p.role == "publisher":
            if tenant not in (None, p.tenant):
                raise PermissionDenied(f"publisher of tenant {p.tenant!r} cannot register for tenant {tenant!r}")
            tenant = p.tenant
        return registry.register(body.name, body.source_uri, body.sha256, body.base_model, tenant=tenant,
                                 visibility=body.visibility, actor=p.name, labels=body.labels,
                                 description=body.description, activate=body.activate)

    @app.get("/v1/adapters", response_model=list[AdapterSummary])
    def list_adapters(p: Caller):
        return [_summary(s) for s in registry.list_states() if _can_see(p, s)]

    @app.get("/v1/adapters/{name}", response_model=AdapterState)
    def show(name: Name, p: Caller):
        state = registry.get(name)
        if not _can_see(p, state):
            raise AdapterNotFound(f"adapter {name!r} not found")
        return state

    @app.get("/v1/adapters/{name}/versions", response_model=list[AdapterRecord])
    def versions(name: Name, p: Caller):
        return [r for _, r in sorted(show(name, p).versions.items())]

    @app.post("/v1/adapters/{name}/promote", response_model=AdapterState)
    def promote(name: Name, body: PromoteRequest, p: Caller):
        owned_state(p, name)
        return registry.promote(name, body.version, actor=p.name)

    @app.post("/v1/adapters/{name}/canary", response_model=AdapterState)
    def canary(name: Name, body: CanaryRequest, p: Caller):
        owned_state(p, name)
        return registry.canary(name, body.version, body.weight, actor=p.name)

    @app.post("/v1/adapters/{name}/rollback", response_model=AdapterState)
    def rollback(name: Name, p: Caller):
        owned_state(p, name)
        return registry.rollback(name, actor=p.name)

    @app.post("/v1/adapters/{name}/disable", response_model=AdapterState)
    def disable(name: Name, p: Caller):
        owned_state(p, name)
        return registry.disable(name, actor=p.name)

    @app.post("/v1/adapters/{name}/enable", response_model=AdapterState)
    def enable(name: Name, p: Caller):
        owned_state(p, name)
        return registry.enable(name, actor=p.name)

    @app.delete("/v1/adapters/{name}/versions/{version}", response_model=AdapterState)
    def retire(name: Name, version: Annotated[int, Path(ge=1, le=MAX_INT)], p: Caller):
        owned_state(p, name)
        return registry.retire(name, version, actor=p.name)

    @app.post("/v1/base-models", status_code=201, response_model=BaseModelSpec)
    def register_base_model(body: BaseModelRequest, p: Caller):
        _require_admin(p)
        return registry.register_base_model(body.name, body.config, actor=p.name, aliases=body.aliases)

    @app.get("/v1/base-models", response_model=list[BaseModelSpec])
    def list_base_models(p: Caller):
        return registry.list_base_models()

    @app.get("/v1/audit", response_model=list[AuditEntry])
    def audit(p: Caller, name: str | None = None, after_seq: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100):
        _require_admin(p)
        return registry.audit(name, after_seq, limit)

    return app
