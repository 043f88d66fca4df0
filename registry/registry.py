"""The Registry facade: registration with validation, lifecycle transitions, resolution for the serving
layer, and materializing adapter files locally. Stores, blob store and source fetcher are injected."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from registry import lifecycle, rollout
from registry.base_files import describe_files, select_base_files
from registry.base_model import BaseModelSpec, load_config, spec_from_config
from registry.blob_store import BlobStore, LocalBlobStore
from registry.catalog import ServingCatalog
from registry.materialize import materialize_files
from registry.errors import (AdapterNotFound, BaseModelNotFound, LifecycleConflict, PermissionDenied, RegistryError,
                             RegistryUnavailable, RegistryValidationError)
from registry.metadata_store import Event, MetadataStore, Mutation
from registry.records import NAME_PATTERN, AdapterRecord, AdapterState, AdapterStatus, AuditEntry, Visibility
from registry.resolver import resolve_version
from registry.settings import RegistrySettings
from registry.sources import SourceFetcher, SourceLimits
from registry.uploads import UploadArea
from registry.validation import validate_adapter

__all__ = ["Registry"]

# Labels and descriptions are bounded: they are stored with every version and shown in every listing.
MAX_LABELS, MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_DESCRIPTION = 32, 64, 256, 4000


def _label_problem(labels: object, description: object) -> str | None:
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        return "labels must map strings to strings"
    if len(labels) > MAX_LABELS:
        return f"too many labels: {len(labels)} > {MAX_LABELS}"
    for key, value in labels.items():
        if not key or len(key) > MAX_LABEL_KEY or len(value) > MAX_LABEL_VALUE:
            return (f"label {key[:40]!r}: keys are 1-{MAX_LABEL_KEY} characters and values at most "
                    f"{MAX_LABEL_VALUE}")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION:
        return f"the description must be a string of at most {MAX_DESCRIPTION} characters"
    return None


class Registry:
    def __init__(self, metadata: MetadataStore, blobs: BlobStore, settings: RegistrySettings,
                 fetcher: SourceFetcher, clock: Callable[[], float] = time.time):
        self.metadata = metadata
        self.blobs = blobs
        self.settings = settings
        self._fetcher = fetcher
        self._clock = clock
        self._catalog: ServingCatalog | None = None
        self._catalog_lock = threading.Lock()
        self.uploads = UploadArea(settings.upload_dir, settings.max_files, settings.max_file_bytes,
                                  settings.upload_ttl_s, settings.max_upload_area_bytes)

    @classmethod
    def from_settings(cls, settings: RegistrySettings | None = None) -> "Registry":
        settings = settings or RegistrySettings()
        if settings.redis_url:
            from registry.redis_store import RedisMetadataStore
            metadata: MetadataStore = RedisMetadataStore(settings.redis_url, settings.redis_prefix,
                                                         audit_retention=settings.audit_retention,
                                                         timeout_s=settings.store_timeout_s)
        else:
            from registry.sqlite_store import SQLiteMetadataStore
            metadata = SQLiteMetadataStore(settings.registry_db, settings.poll_interval_s, settings.audit_retention)
        s3_factory = None
        if settings.s3_bucket or settings.allowed_s3_prefixes:
            from registry.s3_blob_store import make_s3_client
            s3_factory = lambda: make_s3_client(settings.s3_endpoint_url, settings.store_timeout_s)  # noqa: E731
        if settings.s3_bucket:
            from registry.s3_blob_store import S3BlobStore
            blobs: BlobStore = S3BlobStore(s3_factory(), settings.s3_bucket, settings.s3_prefix)
        else:
            blobs = LocalBlobStore(settings.blob_dir)
        limits = SourceLimits(settings.max_files, settings.max_file_bytes, settings.max_total_bytes)
        fetcher = SourceFetcher([*settings.allowed_local_roots, settings.upload_dir], settings.allowed_s3_prefixes,
                                limits, s3_factory)
        return cls(metadata, blobs, settings, fetcher)

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
        self.metadata.close()

    # -- base models ---------------------------------------------------------------------------------------
    def register_base_model(self, name: str, model_dir_or_config: str | os.PathLike | dict[str, Any], *,
                            actor: str = "system", aliases: list[str] | None = None,
                            upload: bool = False) -> BaseModelSpec:
        """Record the base model's spec (from its config). With `upload`, also store its files (a model
        directory: config, tokenizer, safetensors weights) in the blob store, so replicas can fetch the model
        with `materialize_base` instead of needing it on a local volume."""
        return self._audited(actor, "register_base_model", str(name), lambda: self._register_base_model(
            name, model_dir_or_config, actor, aliases, upload))

    def _register_base_model(self, name: str, model_dir_or_config: str | os.PathLike | dict[str, Any], actor: str,
                             aliases: list[str] | None, upload: bool) -> BaseModelSpec:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise RegistryValidationError(f"invalid base model name {name!r}", code="invalid_name")
        cfg, found_aliases = load_config(model_dir_or_config)
        files = None
        if upload:
            if isinstance(model_dir_or_config, dict):
                raise RegistryValidationError("upload needs a model directory, not a config", code="missing_file")
            paths = select_base_files(Path(model_dir_or_config), self.settings.max_header_bytes)
            files = describe_files(paths)
            for fname, entry in files.items():  # before the record, like a registration; gc spares fresh blobs
                self.blobs.put(entry.sha256, paths[fname])
        spec = spec_from_config(name, cfg, [*found_aliases, *(aliases or [])], files, self.blobs.location)
        now = self._clock()

        def mutate(before: BaseModelSpec | None) -> Mutation:
            return Mutation(base_model=spec, audit=AuditEntry(
                seq=0, ts=now, actor=actor, action="register_base_model", name=name,
                before=before.model_dump() if before else None, after=spec.model_dump()))

        self.metadata.update_base_model(name, mutate)
        return spec

    def get_base_model(self, name: str) -> BaseModelSpec:
        spec = self.metadata.get_base_model(name)
        if spec is None:
            raise BaseModelNotFound(f"unknown base model {name!r}")
        return spec

    def list_base_models(self) -> list[BaseModelSpec]:
        return self.metadata.list_base_models()

    # -- registration --------------------------------------------------------------------------------------
    def register(self, name: str, source_uri: str, sha256: dict[str, str], base_model: str, *,
                 tenant: str | None = None, visibility: str | Visibility = Visibility.public, actor: str = "system",
                 labels: dict[str, str] | None = None, description: str = "", activate: bool = False) -> AdapterRecord:
        """Fetch and validate the files, store them, then record the version in one commit.

        Nothing is recorded before every check has passed, so a refusal leaves no adapter, no version and no
        version number behind: only a `register_rejected` audit entry saying who tried what and why. An upload
        (`source_uri` in the upload area) is ended by the registration that succeeds, not by a refused one."""
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            shown = repr(name)[:80]
            self._reject(shown, actor, source_uri, RegistryValidationError(
                f"invalid adapter name {shown}: use 1-64 of [A-Za-z0-9_.-], starting with a letter or digit",
                code="invalid_name"))
        problem = _label_problem(labels or {}, description)
        if problem is not None:
            self._reject(name, actor, source_uri, RegistryValidationError(problem, code="invalid_labels"))
        visibility = Visibility(visibility)
        if visibility == Visibility.tenant and not tenant:
            self._reject(name, actor, source_uri, RegistryValidationError(
                "visibility 'tenant' needs an owner tenant", code="invalid_request"))
        existing = self.metadata.get_serving_state(name)
        if existing is not None and existing.owner_tenant != tenant:
            self._reject(name, actor, source_uri, PermissionDenied(f"adapter {name!r} belongs to another tenant"))
        with tempfile.TemporaryDirectory(prefix="registry-stage-") as staging:
            return self._register_staged(name, source_uri, sha256, base_model, Path(staging), tenant=tenant,
                                         visibility=visibility, actor=actor, labels=labels, description=description,
                                         activate=activate)

    def _register_staged(self, name: str, source_uri: str, sha256: dict[str, str], base_model: str, staging: Path, *,
                         tenant: str | None, visibility: Visibility, actor: str, labels: dict[str, str] | None,
                         description: str, activate: bool) -> AdapterRecord:
        """`register` with the source's files fetched into `staging`, which outlives the commit."""
        try:
            validated, location, files = self._validate_and_store(base_model, source_uri, sha256, staging)
        except RegistryValidationError as e:
            self._reject(name, actor, source_uri, e)
        except RegistryError:
            raise
        except Exception as e:  # storage outage etc.: a server-side fault, reported as such
            err = RegistryError(f"registration of {name} failed: {type(e).__name__}: {e}", code="storage_error")
            err.status = 503
            self._reject(name, actor, source_uri, err, cause=e)
        now = self._clock()
        made: dict[str, AdapterRecord] = {}

        def mutate(before: AdapterState | None) -> Mutation:
            live = before if before is not None and before.versions else None
            if live is not None and live.owner_tenant != tenant:
                raise PermissionDenied(f"adapter {name!r} belongs to another tenant")
            state = live or AdapterState(name=name, owner_tenant=tenant,
                                         last_version=before.last_version if before else 0)
            rec = AdapterRecord(
                name=name, version=state.next_version(), base_model=str(base_model), owner_tenant=tenant,
                visibility=visibility, status=AdapterStatus.ready, source_uri=str(source_uri), created_at=now,
                updated_at=now, labels=labels or {}, description=description, rank=validated.rank,
                alpha=validated.alpha, target_modules=validated.target_modules, dtype=validated.dtype,
                files=validated.files, blob_location=location)
            made["rec"] = rec
            after = lifecycle.add_version(state, rec)
            return Mutation(state=after, audit=AuditEntry(
                seq=0, ts=now, actor=actor, action="register", name=name, version=rec.version,
                details={"source_uri": str(source_uri), "base_model": str(base_model), "files": sorted(rec.files)},
                before=live.head() if live else None, after=after.head()))

        self.metadata.update(name, mutate)
        self._keep_blobs(validated.files, files)
        self.uploads.discard_source(source_uri)  # an upload it registered: its files are in the blob store now
        done = made["rec"]
        if activate:
            self.promote(name, done.version, actor=actor)
            return self.get(name).versions[done.version]
        return done

    def _reject(self, name: str, actor: str, source_uri: object, err: RegistryError, cause: Exception | None = None):
        """Refuse a registration: audit the refusal (no adapter state is touched) and raise `err`. An upload it named
        stays, for the corrected registration to reuse (until its session's time to live)."""
        self.audit_refusal(actor, "register", name, err, {"source_uri": str(source_uri)[:300]})
        raise err from cause

    def audit_refusal(self, actor: str, action: str, name: str, err: RegistryError,
                      details: dict[str, Any] | None = None) -> None:
        """Record a refused `action` as `{action}_rejected` (who, why) and mark `err` as recorded. A store out of
        reach can record nothing: its refusal (a 503) is not audited."""
        if err.audited or isinstance(err, RegistryUnavailable):
            return
        self.metadata.append_audit(AuditEntry(seq=0, ts=self._clock(), actor=actor, action=f"{action}_rejected",
                                              name=name[:200], details={"code": err.code, "reason": err.message[:2000],
                                                                        **(details or {})}))
        err.audited = True

    def _keep_blobs(self, entries: dict, files: dict[str, Path]) -> None:
        """Put again any blob of a just committed version that a concurrent delete freed between its put and the
        commit (the delete saw no record using it yet)."""
        for fname, entry in entries.items():
            if not self.blobs.exists(entry.sha256):
                self.blobs.put(entry.sha256, files[fname])

    def _validate_and_store(self, base_model: str, source_uri: str, sha256: dict[str, str], staging: Path):
        spec = self.metadata.get_base_model(base_model) if isinstance(base_model, str) else None
        if spec is None:
            raise RegistryValidationError(f"unknown base model {base_model!r}", code="unknown_base_model")
        if not isinstance(sha256, dict) or not all(isinstance(k, str) for k in sha256):
            raise RegistryValidationError("sha256 must map file names to hex digests", code="invalid_sha256")
        files = self._fetcher.fetch(source_uri, staging)
        validated = validate_adapter(files, sha256, spec, self.settings.max_lora_rank, self.settings.max_header_bytes)
        # Only now, with every check passed, do the bytes reach the blob store. A blob whose record never
        # commits is left to collect_garbage.
        for fname, entry in validated.files.items():
            self.blobs.put(entry.sha256, files[fname])
        return validated, self.blobs.location, files

    # -- deletion and garbage collection ----------------------------------------------------------------------
    def delete_version(self, name: str, version: int, *, force: bool = False, actor: str = "system") -> dict:
        """Drop one version's record (the active one only with force), then its blobs no record still uses.
        Deleting the last version deletes the adapter."""
        now = self._clock()

        def mutate(before: AdapterState | None) -> Mutation:
            if before is None or not before.versions:
                raise AdapterNotFound(f"adapter {name!r} not found")
            after = lifecycle.delete_version(before, version, force)
            audit = AuditEntry(seq=0, ts=now, actor=actor, action="delete_version", name=name, version=version,
                               details={"version": version, "force": force}, before=before.head(), after=after.head())
            return Mutation(state=after, audit=audit, delete_adapter=not after.versions)

        return self._delete(name, mutate, [version], actor, "delete_version")

    def delete_adapter(self, name: str, *, force: bool = False, actor: str = "system") -> dict:
        """Drop the adapter, every version and their blobs no other record uses. An adapter with an active
        version is only deleted with force. Its version numbers are never issued again under this name."""
        now = self._clock()
        deleted: list[int] = []

        def mutate(before: AdapterState | None) -> Mutation:
            if before is None or not before.versions:
                raise AdapterNotFound(f"adapter {name!r} not found")
            if before.active_version is not None and not force:
                raise LifecycleConflict(f"cannot delete {name}: v{before.active_version} is active; disable and "
                                        f"pass force=true, or delete the other versions one by one")
            deleted[:] = sorted(before.versions)
            return Mutation(delete_adapter=True, audit=AuditEntry(
                seq=0, ts=now, actor=actor, action="delete_adapter", name=name,
                details={"versions": deleted, "force": force}, before=before.head(), after=None))

        return self._delete(name, mutate, deleted, actor, "delete_adapter")

    def _delete(self, name: str, mutate: Callable[[AdapterState | None], Mutation], versions: list[int], actor: str,
                action: str) -> dict:
        """Commit the deletion, then free at once what only the deleted versions used: their blobs (no grace: a
        registration of the same file in flight puts it again after it commits, `_keep_blobs`) and this host's
        materialized copies (each replica drops its own when the change feed tells it)."""
        files: dict[int, set[str]] = {}
        kept: set[int] = set()

        def capture(before: AdapterState | None) -> Mutation:
            mutation = mutate(before)
            held = before.versions if before else {}
            files.clear()
            files.update({v: {f.sha256 for f in r.files.values()} for v, r in held.items()})
            kept.clear()
            kept.update(v for v in held if v not in versions)
            return mutation

        self._audited(actor, action, name, lambda: self.metadata.update(name, capture))
        candidates = set().union(*(files.get(v, set()) for v in versions))
        return {"name": name, "deleted_versions": sorted(versions),
                "deleted_blobs": self.collect_garbage(candidates, grace_s=0),
                "dropped_copies": self.drop_materialized(name, keep=kept)}

    def collect_garbage(self, candidates: set[str] | None = None, grace_s: float | None = None) -> list[str]:
        """Delete blobs no version record references (all blobs, or only `candidates`) and not written within
        `grace_s`: a registration puts its blobs before committing its record, and re-putting an existing blob
        refreshes its time, so the grace covers a registration in flight. A delete frees its own blobs at once;
        this is for what a crash left (a registration that never committed). -> the digests deleted."""
        grace = self.settings.blob_gc_grace_s if grace_s is None else grace_s
        pool = set(self.blobs.list()) if candidates is None else set(candidates)
        if not pool:
            return []
        cutoff = self._clock() - grace  # taken before the references are read: a blob put after it stays
        referenced = {f.sha256 for rec in self.metadata.iter_records() for f in rec.files.values()}
        referenced |= {f.sha256 for spec in self.metadata.list_base_models() for f in spec.files.values()}
        gone = []
        for digest in sorted(pool - referenced):
            written = self.blobs.modified_at(digest)
            if written is not None and written <= cutoff:
                self.blobs.delete(digest)
                gone.append(digest)
        return gone

    def drop_materialized(self, name: str, keep: set[int] | frozenset[int] = frozenset()) -> list[str]:
        """Remove this host's materialized copies of `name`'s versions not in `keep` (`materialize` writes them
        under materialize_dir/NAME/vN). -> the directories removed."""
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            return []
        root = Path(self.settings.materialize_dir) / name
        gone = []
        for d in sorted(root.iterdir()) if root.is_dir() else ():
            number = d.name.lstrip(".").removeprefix("v").split("-", 1)[0]  # vN, or .vN-XXXX being written
            if number.isdigit() and int(number) not in keep:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(str(d))
        try:
            root.rmdir()  # only when nothing is left
        except OSError:
            pass
        return gone

    # -- lifecycle -----------------------------------------------------------------------------------------
    def _transition(self, name: str, action: str, details: dict[str, Any], actor: str) -> AdapterState:
        now = self._clock()

        def mutate(before: AdapterState | None) -> Mutation:
            if before is None or not before.versions:
                raise AdapterNotFound(f"adapter {name!r} not found")
            after = lifecycle.apply(before, action, details)
            touched = {v: (r.model_copy(update={"updated_at": now}) if before.versions.get(v) != r else r)
                       for v, r in after.versions.items()}
            after = after.model_copy(update={"versions": touched})
            return Mutation(state=after, audit=AuditEntry(
                seq=0, ts=now, actor=actor, action=action, name=name, version=details.get("version"),
                details=details, before=before.head(), after=after.head()))

        state, _ = self._audited(actor, action, name, lambda: self.metadata.update(name, mutate))
        return state

    def _audited(self, actor: str, action: str, name: str, commit: Callable[[], Any]) -> Any:
        """commit(), its refusal (a RegistryError) audited before it is raised."""
        try:
            return commit()
        except RegistryError as e:
            self.audit_refusal(actor, action, name, e)
            raise

    def promote(self, name: str, version: int, *, actor: str = "system") -> AdapterState:
        return self._transition(name, "promote", {"version": int(version)}, actor)

    def canary(self, name: str, version: int, weight: float, *, actor: str = "system") -> AdapterState:
        return self._transition(name, "canary", {"version": int(version), "weight": float(weight)}, actor)

    def rollback(self, name: str, *, actor: str = "system") -> AdapterState:
        return self._transition(name, "rollback", {}, actor)

    def disable(self, name: str, *, actor: str = "system") -> AdapterState:
        return self._transition(name, "disable", {}, actor)

    def enable(self, name: str, *, actor: str = "system") -> AdapterState:
        return self._transition(name, "enable", {}, actor)

    def retire(self, name: str, version: int, *, actor: str = "system") -> AdapterState:
        return self._transition(name, "retire", {"version": int(version)}, actor)

    # -- automatic rollouts (registry.rollout; the controller is registry.canary_runner) --------------------
    def set_golden(self, name: str, version: int, prompts: list, *, actor: str = "system") -> AdapterState:
        """Register the golden prompts of one version (replacing its earlier ones; [] removes them)."""
        given = [p.model_dump(mode="json") if hasattr(p, "model_dump") else p for p in prompts]
        self._audited(actor, "set_golden", name, lambda: rollout.parse_golden(given))
        return self._transition(name, "set_golden", {"version": int(version), "prompts": given}, actor)

    def start_rollout(self, name: str, version: int, policy: Any = None, *, actor: str = "system",
                      check_golden: Callable[[AdapterRecord, list], list[dict]] | None = None) -> AdapterState:
        """Start rolling `version` out against the active version, pending its golden prompts.

        Refused with nothing changed: a rollout or a hand-set canary already on the adapter (409), a policy no
        version could pass (422), golden prompts the stable version itself fails (422: they would fail every
        canary), and golden prompts with no data plane to run them on (`check_golden` None: 409).
        `check_golden(record, prompts)` -> one {prompt, passed, why} per prompt, run on `record`'s version."""
        version = int(version)
        policy = self._audited(actor, "rollout_start", name, lambda: rollout.parse_policy(
            policy.model_dump(mode="json") if hasattr(policy, "model_dump") else policy))
        now = self._clock()
        details = {"id": uuid.uuid4().hex[:12], "version": version, "policy": policy.model_dump(mode="json"),
                   "started_at": now, "actor": actor}

        def precheck() -> list:
            state = self.get(name)
            rollout.start(state, details)  # the same rules the commit applies, before the slow golden check
            golden = state.versions[version].golden
            if golden and check_golden is None:
                raise LifecycleConflict(f"{name} v{version} has golden prompts and this control plane has no data "
                                        f"plane to run them on; start the rollout through the served app",
                                        code="golden_unavailable")
            if not golden:
                return []
            results = check_golden(state.versions[state.active_version], golden)
            failed = [r for r in results if not r["passed"]]
            if failed:
                raise RegistryValidationError(
                    f"golden prompts of {name} v{version} fail on the stable version v{state.active_version} "
                    f"itself, so they would fail any canary: " + "; ".join(f"{r['prompt']!r}: {r['why']}"
                                                                           for r in failed),
                    code="golden_fails_on_stable")
            return results

        details["stable_golden"] = self._audited(actor, "rollout_start", name, precheck)
        return self._transition(name, "rollout_start", details, actor)

    def abort_rollout(self, name: str, *, actor: str = "system", reason: str = "aborted by an operator") -> AdapterState:
        return self._transition(name, "rollout_abort", {"ended_at": self._clock(), "reason": reason}, actor)

    def advance_rollout(self, name: str, action: str, details: dict[str, Any], *,
                        actor: str = "canary-controller") -> AdapterState:
        """One decision of the rollout controller (rollout_step, rollout_promote, rollout_rollback), applied only
        if the rollout is still where the decision saw it (`id`, `from_step`)."""
        if action not in ("rollout_step", "rollout_promote", "rollout_rollback"):
            raise ValueError(f"not a controller decision: {action}")
        return self._transition(name, action, details, actor)

    # -- reads ---------------------------------------------------------------------------------------------
    def get(self, name: str) -> AdapterState:
        state = self.metadata.get_state(name)
        if state is None:
            raise AdapterNotFound(f"adapter {name!r} not found")
        return state

    def resolve(self, name: str, tenant: str | None, request_id: str | None = None) -> AdapterRecord:
        return resolve_version(self.serving_state(name), name, tenant, request_id)

    def serving_state(self, name: str) -> AdapterState | None:
        """The adapter's head with its active and canary versions only (what `resolve` picks from)."""
        return self.metadata.get_serving_state(name)

    def ping(self) -> None:
        """Raise RegistryUnavailable unless the metadata store and the blob store can be reached."""
        self.metadata.revision()
        self.blobs.ping()

    def catalog(self) -> ServingCatalog:
        with self._catalog_lock:
            if self._catalog is None:
                self._catalog = ServingCatalog(self.metadata)
            return self._catalog

    def list_adapters(self, tenant: str | None = None) -> tuple[AdapterRecord, ...]:
        """Active versions of enabled adapters the tenant may see (what the serving layer can offer), by name.
        From the in-memory catalog: the same tuple object until something changes."""
        return self.catalog().view(tenant)

    def list_page(self, after: str | None = None, limit: int = 100) -> list[AdapterState]:
        """Adapters with names > `after`, in name order, each with only its active and canary versions."""
        return self.metadata.page(after, limit)

    def list_states(self) -> list[AdapterState]:
        return self.metadata.list_states()

    def audit(self, name: str | None = None, after_seq: int = 0, limit: int = 100, *, before_seq: int | None = None,
              newest_first: bool = False) -> list[AuditEntry]:
        return self.metadata.audit(name, after_seq, limit, before_seq=before_seq, newest_first=newest_first)

    def revision(self) -> int:
        return self.metadata.revision()

    def subscribe(self, callback: Callable[[Event], None], *, consumer: str | None = None,
                  after: int | None = None) -> Callable[[], None]:
        return self.metadata.subscribe(callback, consumer=consumer, after=after)

    # -- files ---------------------------------------------------------------------------------------------
    def materialize(self, rec: AdapterRecord) -> Path:
        """-> local directory with the version's files, each re-hashed against the record after download."""
        if rec.status in (AdapterStatus.failed, AdapterStatus.staged, AdapterStatus.retired) or not rec.files:
            raise LifecycleConflict(f"{rec.name} v{rec.version} is {rec.status.value}; it has no servable files")
        dest = Path(self.settings.materialize_dir) / rec.name / f"v{rec.version}"
        return materialize_files(self.blobs, rec.files, dest, f"{rec.name} v{rec.version}")

    def materialize_base(self, name: str) -> Path:
        """-> local directory holding the base model's stored files (a Hugging Face model dir), re-hashed."""
        spec = self.get_base_model(name)
        if not spec.files:
            raise RegistryError(f"base model {name!r} has no files in the blob store; register it with its files "
                                f"(lora-registry base-model {name} DIR --upload)", code="no_base_files")
        manifest = json.dumps({n: f.sha256 for n, f in sorted(spec.files.items())}).encode()
        # Under a name no adapter can have (adapter names start with a letter or digit); one dir per file set.
        dest = Path(self.settings.materialize_dir) / "_base" / name / hashlib.sha256(manifest).hexdigest()[:16]
        return materialize_files(self.blobs, spec.files, dest, f"base model {name}")
