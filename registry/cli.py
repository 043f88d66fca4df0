"""Operator CLI `lora-registry` of the adapter registry: push adapter directories (upload with a progress
bar, resumable, then register), write an example adapter, list, show, promote, canary (by hand, or an automatic
rollout judged on measurements: `canary start|status|abort`, with `golden` prompts), rollback, disable,
enable, retire, delete, collect garbage, report the upload area, read the audit log and register base models.

Talks to the control plane over HTTP when --url/LORA_REGISTRY_URL is set (the server root, e.g.
http://host:8000, or the control plane's own root; token from --token or LORA_REGISTRY_TOKEN), else opens the
registry directly from the environment settings (REGISTRY_DB, REDIS_URL, ...).
Over HTTP, push streams each file to the control plane's upload area (PUT /v1/uploads/{id}/{file}, the id derived
from the files' hashes, so a retried or interrupted push resumes where it stopped), then registers it. Directly,
push copies the files into a staging area the registry accepts sources from (the first ALLOWED_S3_PREFIXES entry,
else the first ALLOWED_LOCAL_ROOTS entry, or --staging). Either way the files go through the same validation as
any registration.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from registry.errors import RegistryError
from registry.settings import RegistrySettings

__all__ = ["main", "build_parser"]


class CliError(Exception):
    pass


# -- backends: same methods, one over HTTP, one on a local Registry -------------------------------------------
class HttpBackend:
    RETRIES = 4

    def __init__(self, url: str, token: str | None):
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._c = httpx.Client(base_url=self._control_plane_root(url.rstrip("/")), headers=headers, timeout=600)

    @staticmethod
    def _control_plane_root(url: str) -> str:
        """The server root (the Serve app mounts the control plane at /admin) or the control plane's own root."""
        import httpx

        for base in (url, url + "/admin"):
            try:
                r = httpx.get(base + "/healthz", timeout=30)
                if r.status_code == 200 and "revision" in r.json():
                    return base
            except (httpx.HTTPError, ValueError):
                continue
        raise CliError(f"no control plane at {url} (tried {url}/healthz and {url}/admin/healthz)")

    def _call(self, method: str, path: str, **kw) -> Any:
        return _checked(self._c.request(method, path, **kw))

    def upload(self, directory: Path, sha: dict[str, str], name: str) -> str:
        """Stream the files to the control plane's upload area -> the source URI to register. Transport errors,
        5xx and a file cut off are retried from where the server's copy ends (its `partial` bytes); files
        already uploaded (same hash) are skipped, so a re-run of an interrupted push resumes."""
        import httpx

        upload_id = hashlib.sha256(json.dumps(sorted(sha.items())).encode()).hexdigest()[:32]
        status = self._call("GET", f"/v1/uploads/{upload_id}")
        sizes = {f: (directory / f).stat().st_size for f in sha}
        with tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc=f"push {name}", file=sys.stderr) as bar:
            done = 0  # bytes of the files before this one
            for f in sorted(sha):
                for attempt in range(self.RETRIES):
                    if status["files"].get(f) == sha[f]:
                        r = None
                        break
                    offset = status.get("partial", {}).get(f, {}).get(sha[f][:16], 0)
                    if offset:
                        tqdm.write(f"push {name}: resuming {f} at byte {offset} of {sizes[f]}", file=sys.stderr)
                    bar.update(done + offset - bar.n)
                    try:
                        r = self._c.put(f"/v1/uploads/{upload_id}/{f}", content=_chunks(directory / f, bar, offset),
                                        headers={"X-Content-SHA256": sha[f], "X-Upload-Offset": str(offset),
                                                 "Content-Length": str(sizes[f] - offset)})
                    except httpx.TransportError as e:
                        r, why = None, str(e)
                    else:
                        why = f"HTTP {r.status_code}"
                    if r is not None and r.status_code < 500 and r.status_code != 409:
                        break
                    if attempt == self.RETRIES - 1:
                        raise CliError(f"upload of {f} failed after {self.RETRIES} attempts: {why}")
                    time.sleep(0.5 * 2**attempt)
                    status = self._call("GET", f"/v1/uploads/{upload_id}")  # where the server's copy ends now
                if r is not None:
                    status = _checked(r)
                done += sizes[f]
                bar.update(done - bar.n)
        return status["source_uri"]

    def base_model_spec(self, name: str) -> dict:
        found = [m for m in self._call("GET", "/v1/base-models") if m["name"] == name]
        if not found:
            raise CliError(f"no base model {name!r} on the server")
        return found[0]

    def register(self, body: dict) -> Any:
        return self._call("POST", "/v1/adapters", json=body)

    def list(self, cursor: str | None, limit: int) -> Any:
        return self._call("GET", "/v1/adapters", params={"limit": limit} | ({"cursor": cursor} if cursor else {}))

    def show(self, name: str) -> Any:
        return self._call("GET", f"/v1/adapters/{name}")

    def action(self, name: str, verb: str, body: dict | None = None) -> Any:
        return self._call("POST", f"/v1/adapters/{name}/{verb}", json=body)

    def retire(self, name: str, version: int) -> Any:
        return self._call("POST", f"/v1/adapters/{name}/versions/{version}/retire")

    def golden(self, name: str, version: int, prompts: list) -> Any:
        return self._call("PUT", f"/v1/adapters/{name}/versions/{version}/golden", json={"prompts": prompts})

    def rollout(self, name: str, verb: str, body: dict | None = None) -> Any:
        if verb == "status":
            return self._call("GET", f"/v1/adapters/{name}/rollout")
        return self._call("POST", f"/v1/adapters/{name}/rollout" + ("" if verb == "start" else f"/{verb}"), json=body)

    def delete(self, name: str, version: int | None, force: bool) -> Any:
        path = f"/v1/adapters/{name}" + (f"/versions/{version}" if version is not None else "")
        return self._call("DELETE", path, params={"force": str(force).lower()})

    def gc(self) -> Any:
        return self._call("POST", "/v1/gc")

    def uploads(self) -> Any:
        return self._call("GET", "/v1/uploads")

    def audit(self, name: str | None, after: int, limit: int, order: str) -> Any:
        params = {"after_seq": after, "limit": limit, "order": order} | ({"name": name} if name else {})
        return self._call("GET", "/v1/audit", params=params)

    def base_model(self, name: str, config: dict) -> Any:
        return self._call("POST", "/v1/base-models", json={"name": name, "config": config})


def _checked(r) -> Any:
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            msg = f"{err['code']}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            msg = r.text
        raise CliError(f"HTTP {r.status_code} {msg}")
    return r.json()


def _chunks(path: Path, bar: tqdm, offset: int = 0):
    with path.open("rb") as f:
        f.seek(offset)
        while chunk := f.read(1 << 20):
            bar.update(len(chunk))
            yield chunk


class LocalBackend:
    def __init__(self, settings: RegistrySettings, actor: str):
        from registry.registry import Registry

        self._reg = Registry.from_settings(settings)
        self._actor = actor

    def register(self, body: dict) -> Any:
        return self._reg.register(actor=self._actor, **body).model_dump(mode="json")

    def list(self, cursor: str | None, limit: int) -> Any:
        from registry.api import AdapterPage, _summary

        page = self._reg.list_page(cursor, limit)
        return AdapterPage(items=[_summary(s) for s in page],
                           next_cursor=page[-1].name if len(page) == limit else None).model_dump(mode="json")

    def show(self, name: str) -> Any:
        return self._reg.get(name).model_dump(mode="json")

    def action(self, name: str, verb: str, body: dict | None = None) -> Any:
        fn: Callable[..., Any] = {"promote": self._reg.promote, "canary": self._reg.canary,
                                  "rollback": self._reg.rollback, "disable": self._reg.disable,
                                  "enable": self._reg.enable}[verb]
        return fn(name, **(body or {}), actor=self._actor).model_dump(mode="json")

    def retire(self, name: str, version: int) -> Any:
        return self._reg.retire(name, version, actor=self._actor).model_dump(mode="json")

    def golden(self, name: str, version: int, prompts: list) -> Any:
        return self._reg.set_golden(name, version, prompts, actor=self._actor).versions[version].model_dump(mode="json")

    def rollout(self, name: str, verb: str, body: dict | None = None) -> Any:
        """Direct mode has no data plane: no golden prompts can be run (a version with some is refused) and the
        status has no live window."""
        from registry.api import RolloutStatus

        if verb == "start":
            state = self._reg.start_rollout(name, body["version"], body.get("policy"), actor=self._actor)
        elif verb == "abort":
            state = self._reg.abort_rollout(name, actor=self._actor)
        else:
            state = self._reg.get(name)
        return RolloutStatus(name=state.name, active_version=state.active_version, canary_version=state.canary_version,
                             canary_weight=state.canary_weight, rollout=state.rollout).model_dump(mode="json")

    def delete(self, name: str, version: int | None, force: bool) -> Any:
        if version is None:
            return self._reg.delete_adapter(name, force=force, actor=self._actor)
        return self._reg.delete_version(name, version, force=force, actor=self._actor)

    def gc(self) -> Any:
        return {"deleted_blobs": self._reg.collect_garbage()}

    def uploads(self) -> Any:
        return self._reg.uploads.usage().model_dump(mode="json")

    def audit(self, name: str | None, after: int, limit: int, order: str) -> Any:
        entries = self._reg.audit(name, after, limit, newest_first=order == "newest")
        return [e.model_dump(mode="json") for e in entries]

    def base_model(self, name: str, config: dict) -> Any:
        return self._reg.register_base_model(name, config, actor=self._actor).model_dump(mode="json")

    def base_model_spec(self, name: str) -> dict:
        return self._reg.get_base_model(name).model_dump(mode="json")

    def upload_base_model(self, name: str, model_dir: Path) -> Any:
        return self._reg.register_base_model(name, model_dir, actor=self._actor, upload=True).model_dump(mode="json")


# -- push: hash, upload to staging with a progress bar, register ---------------------------------------------
def _hash_files(directory: Path) -> dict[str, str]:
    out = {}
    for p in sorted(directory.iterdir()):
        if p.is_file():
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    if not out:
        raise CliError(f"{directory} has no files")
    return out


def _upload(directory: Path, files: list[str], staging: str, name: str, settings: RegistrySettings) -> str:
    """Copy the files to `{staging}/{name}-{random}/` -> the source URI to register."""
    total = sum((directory / f).stat().st_size for f in files)
    leaf = f"{name}-{uuid.uuid4().hex[:12]}"
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"push {name}", file=sys.stderr) as bar:
        if staging.startswith("s3://"):
            from registry.s3_blob_store import make_s3_client
            from registry.sources import parse_s3_uri

            bucket, prefix = parse_s3_uri(staging.rstrip("/") + "/" + leaf)
            s3 = make_s3_client(settings.s3_endpoint_url)
            for f in files:
                s3.upload_file(str(directory / f), bucket, f"{prefix}/{f}", Callback=bar.update)
            return f"s3://{bucket}/{prefix}"
        dest = Path(staging) / leaf
        dest.mkdir(parents=True)
        for f in files:
            with (directory / f).open("rb") as src, (dest / f).open("wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
        return str(dest)


def _push(args, backend, settings: RegistrySettings) -> Any:
    directory = Path(args.directory)
    if not directory.is_dir():
        raise CliError(f"{directory} is not a directory")
    sha = _hash_files(directory)
    if isinstance(backend, HttpBackend):
        uri = backend.upload(directory, sha, args.name)
    else:
        staging = args.staging or (settings.allowed_s3_prefixes[0] if settings.allowed_s3_prefixes
                                   else str(settings.allowed_local_roots[0]) if settings.allowed_local_roots else None)
        if staging is None:
            raise CliError("no staging area: set ALLOWED_S3_PREFIXES or ALLOWED_LOCAL_ROOTS, or pass --staging")
        uri = _upload(directory, sorted(sha), staging, args.name, settings)
    labels = dict(kv.split("=", 1) for kv in args.label)
    body = {"name": args.name, "source_uri": uri, "sha256": sha, "base_model": args.base_model,
            "tenant": args.tenant, "visibility": args.visibility, "labels": labels,
            "description": args.description, "activate": args.activate}
    return backend.register(body)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lora-registry", description=" ".join(__doc__.split("\n\n")[0].split()),
                                epilog="Every command prints JSON. `lora-registry COMMAND --help` tells more.")
    p.add_argument("--url", default=os.environ.get("LORA_REGISTRY_URL"),
                   help="server root, e.g. http://127.0.0.1:8000 (env LORA_REGISTRY_URL; else the registry is opened "
                        "directly from its environment settings)")
    p.add_argument("--token", default=os.environ.get("LORA_REGISTRY_TOKEN"),
                   help="bearer token for --url (env LORA_REGISTRY_TOKEN)")
    p.add_argument("--actor", default=os.environ.get("USER", "operator"), help="audit 'who' in direct mode")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    push = sub.add_parser("push", help="upload an adapter directory (progress bar, resumable) and register it")
    push.add_argument("directory", help="a PEFT output: adapter_config.json and adapter_model.safetensors")
    push.add_argument("--name", required=True, help="adapter name: 1-64 of [A-Za-z0-9_.-]")
    push.add_argument("--base-model", required=True, help="a registered base model")
    push.add_argument("--tenant", help="owner tenant")
    push.add_argument("--visibility", choices=["public", "tenant"], default="public",
                      help="tenant: only the owner tenant's API keys see it")
    push.add_argument("--label", action="append", default=[], help="key=value, repeatable (at most 32)")
    push.add_argument("--description", default="", help="at most 4000 characters")
    push.add_argument("--activate", action="store_true", help="promote right after validation")
    push.add_argument("--staging", help="direct mode: staging root (local dir under an allowed root, or s3://...)")
    sp = sub.add_parser("init-example", help="write a small valid example adapter for a registered base model")
    sp.add_argument("directory", help="where to write it (created; must be empty)")
    sp.add_argument("--base-model", required=True, help="the registered base model it is for")
    sp.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    sp.add_argument("--seed", type=int, default=0, help="seed of its random factors: another seed, other weights")
    sp.add_argument("--targets", default="q_proj,v_proj",
                    help="comma-separated modules (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    sp = sub.add_parser("list", help="one page of adapters, by name")
    sp.add_argument("--cursor", help="next_cursor of the previous page")
    sp.add_argument("--limit", type=int, default=100)
    sp = sub.add_parser("show", help="an adapter's head and every version")
    sp.add_argument("name")
    sp = sub.add_parser("promote", help="make a version the active one")
    sp.add_argument("name")
    sp.add_argument("version", type=int)
    sp = sub.add_parser("canary", help="serve a version to a share of requests beside the active one (NAME VERSION "
                        "WEIGHT), or roll it out automatically (start NAME VERSION, status NAME, abort NAME)",
                        description="canary NAME VERSION WEIGHT: a canary set by hand. canary start NAME VERSION: an "
                        "automatic rollout (traffic steps, each judged against the active version, then promotion "
                        "or rollback). canary status NAME: its steps, windows and comparison. canary abort NAME.")
    sp.add_argument("words", nargs="+", metavar="ARG", help="NAME VERSION WEIGHT | start NAME VERSION | status NAME "
                    "| abort NAME")
    sp.add_argument("--steps", help="start: canary weights, comma-separated, rising (default 0.05,0.25,0.5)")
    sp.add_argument("--window-requests", type=int, help="start: canary requests per step's window (default 100)")
    sp.add_argument("--window-s", type=float, help="start: seconds per step's window at least (default 60)")
    sp.add_argument("--min-stable-requests", type=int, help="start: stable requests per window (default 10)")
    sp.add_argument("--step-timeout-s", type=float, help="start: a window not filled by then rolls back")
    sp.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                    help="start: a threshold (registry.canary_policy.Thresholds), repeatable, e.g. ttft_p99_ratio=3 "
                         "or require_draft_acceptance=true")
    sp.add_argument("--policy", help="start: a JSON file with the whole policy (the flags above override it)")
    sp = sub.add_parser("golden", help="register a version's golden prompts from a JSON file (a list of {prompt or "
                        "messages, max_tokens, and one of exact, regex, json_schema}); [] removes them")
    sp.add_argument("name")
    sp.add_argument("version", type=int)
    sp.add_argument("file", help="JSON file, or - for stdin")
    sp = sub.add_parser("rollback", help="back to the previous active version (ends a canary)")
    sp.add_argument("name")
    sp = sub.add_parser("disable", help="refuse every request for the adapter (403 model_disabled)")
    sp.add_argument("name")
    sp = sub.add_parser("enable", help="serve a disabled adapter again")
    sp.add_argument("name")
    sp = sub.add_parser("retire", help="withdraw a version for good (not the active one)")
    sp.add_argument("name")
    sp.add_argument("version", type=int)
    sp = sub.add_parser("delete", help="delete an adapter (or one --version) and its unshared blobs")
    sp.add_argument("name")
    sp.add_argument("--version", type=int)
    sp.add_argument("--force", action="store_true", help="even the active version")
    sub.add_parser("gc", help="delete blobs no version references (older than BLOB_GC_GRACE_S): what a crash left")
    sub.add_parser("uploads", help="the upload area: bytes held against its bound, and each session")
    sp = sub.add_parser("audit", help="the audit log: every change and every refusal, newest first")
    sp.add_argument("--name", help="one adapter's entries")
    sp.add_argument("--after", type=int, default=0, help="entries after this revision")
    sp.add_argument("--limit", type=int, default=100)
    sp.add_argument("--order", choices=["newest", "oldest"], default="newest")
    sp = sub.add_parser("base-model", help="register a base model from its directory (config.json)")
    sp.add_argument("name")
    sp.add_argument("model_dir", help="a Hugging Face model directory")
    sp.add_argument("--upload", action="store_true",
                    help="direct mode: also store the model's files (config, tokenizer, safetensors) in the blob "
                         "store, where replicas fetch it from (serve with model: registry://NAME)")
    return p


def _dispatch(args, backend, settings: RegistrySettings) -> Any:
    match args.command:
        case "push":
            return _push(args, backend, settings)
        case "init-example":
            from registry.example_adapter import write_example_adapter

            targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
            try:
                files = write_example_adapter(Path(args.directory), backend.base_model_spec(args.base_model),
                                              args.rank, args.seed, targets)
            except ValueError as e:
                raise CliError(str(e)) from None
            return {"directory": str(Path(args.directory).resolve()), "files": files}
        case "list":
            return backend.list(args.cursor, args.limit)
        case "delete":
            return backend.delete(args.name, args.version, args.force)
        case "gc":
            return backend.gc()
        case "uploads":
            return backend.uploads()
        case "show":
            return backend.show(args.name)
        case "promote":
            return backend.action(args.name, "promote", {"version": args.version})
        case "canary":
            return _canary(args, backend)
        case "golden":
            text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
            try:
                prompts = json.loads(text)
            except ValueError as e:
                raise CliError(f"{args.file}: not JSON: {e}") from None
            return backend.golden(args.name, args.version, prompts)
        case "rollback" | "disable" | "enable":
            return backend.action(args.name, args.command)
        case "retire":
            return backend.retire(args.name, args.version)
        case "audit":
            return backend.audit(args.name, args.after, args.limit, args.order)
        case "base-model":
            if args.upload:
                if isinstance(backend, HttpBackend):
                    raise CliError("--upload writes to the blob store directly: run it without --url, with the "
                                   "cluster's registry settings (REDIS_URL, S3_BUCKET, ...) in the environment")
                return backend.upload_base_model(args.name, Path(args.model_dir))
            config = json.loads((Path(args.model_dir) / "config.json").read_text())
            return backend.base_model(args.name, config)
    raise CliError(f"unknown command {args.command}")


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise CliError(f"{text!r} is not a number") from None


def _canary(args, backend) -> Any:
    words = args.words
    if words[0] in ("status", "abort") and len(words) == 2:
        verb = words[0]
    elif words[0] == "start" and len(words) == 3 and not _is_weight(words[2]):
        verb = "start"
    else:
        verb = None  # NAME VERSION WEIGHT: a canary set by hand
    if verb is None:
        if len(words) != 3:
            raise CliError("usage: canary NAME VERSION WEIGHT | canary start NAME VERSION | canary status NAME | "
                           "canary abort NAME")
        return backend.action(words[0], "canary", {"version": _version(words[1]), "weight": float(_number(words[2]))})
    if verb != "start":
        return backend.rollout(words[1], verb)
    policy: dict[str, Any] = json.loads(Path(args.policy).read_text()) if args.policy else {}
    if args.steps:
        policy["steps"] = [_number(w) for w in args.steps.split(",") if w.strip()]
    for flag in ("window_requests", "window_s", "min_stable_requests", "step_timeout_s"):
        if getattr(args, flag) is not None:
            policy[flag] = getattr(args, flag)
    for item in args.threshold:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--threshold takes NAME=VALUE, got {item!r}")
        policy.setdefault("thresholds", {})[key] = _flag(value) if value in ("true", "false") else _number(value)
    return backend.rollout(words[1], "start", {"version": _version(words[2]), "policy": policy})


def _flag(text: str) -> bool:
    return text == "true"


def _version(text: str) -> int:
    if not text.isdigit():
        raise CliError(f"a version is a whole number, got {text!r}")
    return int(text)


def _is_weight(text: str) -> bool:
    """`canary start 2 0.5` is a hand-set canary of an adapter named "start"; `canary start NAME 2` a rollout."""
    try:
        return "." in text and 0 < float(text) < 1
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = RegistrySettings()
    try:
        backend = HttpBackend(args.url, args.token) if args.url else LocalBackend(settings, args.actor)
        result = _dispatch(args, backend, settings)
    except (CliError, RegistryError, OSError) as e:
        print(f"lora-registry: error: {e}", file=sys.stderr)
        return 1
    return _print(json.dumps(result, indent=2, sort_keys=True))


def _print(text: str) -> int:
    """`text` on stdout -> 0; a reader that went away (`lora-registry list | head`) ends it quietly, as for `cat`."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python flushes stdout again at exit and would report the broken pipe there: point it at /dev/null first
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command a closed pipe stopped
    return 0


if __name__ == "__main__":
    sys.exit(main())
