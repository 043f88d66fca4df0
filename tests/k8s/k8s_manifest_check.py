"""Validate KubeRay manifests against the CRD schemas and their serveConfigV2 against Serve.

Usage: python tests/k8s/k8s_manifest_check.py [k8s_dir] [schema_dir]   (exit 1 on errors)

CRD `openAPIV3Schema`s leave `additionalProperties` open (the API server prunes unknown
fields instead), so every object schema that lists `properties` is closed here, unless it
carries `x-kubernetes-preserve-unknown-fields`: a misspelt field is an error, not a no-op.
Ray's `ServeDeploySchema` ignores unknown keys too, so it is closed the same way through
its JSON schema before the pydantic validation proper.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any, Iterable

import jsonschema
import yaml

CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# The KubeRay CRDs vendored beside this file (schemas/SOURCE.txt: origin, commit, license, hashes), unless
# K8S_SCHEMA_DIR names other ones.
DEFAULT_SCHEMA_DIR = Path(os.environ.get("K8S_SCHEMA_DIR") or Path(__file__).resolve().parent / "schemas")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` where objects with `properties` reject other keys."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_objects(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _int_or_string(schema: Any) -> Any:
    """`x-kubernetes-int-or-string` means integer or string; say so in plain JSON schema."""
    if isinstance(schema, list):
        return [_int_or_string(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _int_or_string(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string"):
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    return out


@functools.lru_cache(maxsize=8)
def load_crd_schema(schema_dir: Path, kind: str, version: str = "v1") -> dict:
    # The CRD files are ~1 MB of YAML: parse with libyaml when available, once per process.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((schema_dir / CRD_FILES[kind]).read_text(), Loader=loader)
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _int_or_string(close_objects(ver["schema"]["openAPIV3Schema"]))
    # apiVersion/kind/metadata are checked by the API server, not the CRD; pin them here.
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [f"ray.io/{version}"]}
    schema["properties"]["kind"] = {"type": "string", "enum": [kind]}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    return schema


@functools.lru_cache(maxsize=8)
def _crd_validator(schema_dir: Path, kind: str) -> jsonschema.protocols.Validator:
    return jsonschema.Draft202012Validator(load_crd_schema(schema_dir, kind))


def _errors(validator: jsonschema.protocols.Validator, doc: Any, where: str) -> list[str]:
    return [
        f"{where}: {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


@functools.lru_cache(maxsize=1)
def _serve_validator() -> jsonschema.protocols.Validator:
    from ray.serve.schema import ServeDeploySchema

    return jsonschema.Draft202012Validator(close_objects(ServeDeploySchema.model_json_schema()))


def serve_config_errors(serve_config: Any, where: str) -> list[str]:
    """Errors of a serveConfigV2 document against Ray Serve's `ServeDeploySchema`."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    errors = _errors(_serve_validator(), serve_config, where + " serveConfigV2")
    try:
        ServeDeploySchema.model_validate(serve_config)
    except ValidationError as e:
        errors += [f"{where} serveConfigV2: {err['loc']}: {err['msg']}" for err in e.errors()]
    errors += app_args_errors(serve_config, where)
    return errors


def app_args_errors(serve_config: Any, where: str) -> list[str]:
    """Errors of each `deployments.app` application's `args` against our own config model."""
    from pydantic import ValidationError

    from deployments.config import AppConfig

    errors = []
    for app in (serve_config or {}).get("applications", []) if isinstance(serve_config, dict) else []:
        if isinstance(app, dict) and app.get("import_path") in ("deployments.app", "deployments:app"):
            try:
                AppConfig.model_validate(app.get("args") or {})
            except ValidationError as e:
                errors += [f"{where} args: {err['loc']}: {err['msg']}" for err in e.errors()]
    return errors


def manifest_errors(docs: Iterable[tuple[str, Any]], schema_dir: Path) -> tuple[list[str], int]:
    """(errors, number of RayService/RayCluster documents checked)."""
    validators = {kind: _crd_validator(schema_dir, kind) for kind in CRD_FILES}
    errors, checked = [], 0
    for where, doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") not in CRD_FILES:
            continue
        checked += 1
        errors += _errors(validators[doc["kind"]], doc, where)
        if doc["kind"] == "RayService":
            raw = (doc.get("spec") or {}).get("serveConfigV2")
            try:
                serve_config = yaml.safe_load(raw) if isinstance(raw, str) else None
            except yaml.YAMLError as e:
                errors.append(f"{where}: serveConfigV2 is not YAML: {e}")
                continue
            if not isinstance(serve_config, dict):
                errors.append(f"{where}: serveConfigV2 must be a YAML mapping")
                continue
            errors += serve_config_errors(serve_config, where)
    return errors, checked


def load_docs(k8s_dir: Path) -> list[tuple[str, Any]]:
    docs = []
    for path in sorted(k8s_dir.rglob("*.y*ml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            docs.append((f"{path.name}#{i}", doc))
    return docs


def main(argv: list[str]) -> int:
    k8s_dir = Path(argv[1]) if len(argv) > 1 else Path("k8s")
    schema_dir = Path(argv[2]) if len(argv) > 2 else DEFAULT_SCHEMA_DIR
    errors, checked = manifest_errors(load_docs(k8s_dir), schema_dir)
    for e in errors:
        print(e)
    print(f"checked {checked} RayService/RayCluster manifests: {len(errors)} errors")
    return 1 if errors or not checked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))


__all__ = ["DEFAULT_SCHEMA_DIR", "main", "close_objects", "load_crd_schema", "manifest_errors", "load_docs",
           "serve_config_errors"]
