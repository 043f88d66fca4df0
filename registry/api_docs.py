"""An API's reference page from its OpenAPI schema: every route with its summary, parameters and body
fields, as one self-contained HTML page (no script, nothing loaded from elsewhere)."""

from __future__ import annotations

import html
from typing import Any

__all__ = ["api_docs_page"]


def _type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " | ".join(_type(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list[{_type(schema.get('items', {}))}]"
    return str(schema.get("type", "any"))


def _fields(schema: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td><code>{html.escape(n)}</code></td><td>{html.escape(_type(f))}</td>"
                   f"<td>{html.escape(f.get('description', ''))}</td></tr>"
                   for n, f in schema.get("properties", {}).items())
    return f"<table>{rows}</table>" if rows else ""


def api_docs_page(spec: dict[str, Any]) -> str:
    schemas = spec.get("components", {}).get("schemas", {})
    parts = [f"<h1>{html.escape(spec.get('info', {}).get('title', 'API'))}</h1>"]
    for path, methods in sorted(spec.get("paths", {}).items()):
        for method, op in methods.items():
            parts.append(f"<h2><code>{method.upper()} {html.escape(path)}</code></h2>")
            if op.get("description") or op.get("summary"):
                parts.append(f"<p>{html.escape(op.get('description') or op.get('summary'))}</p>")
            params = [p for p in op.get("parameters", []) if p.get("in") != "header" or p["name"] != "authorization"]
            if params:
                parts.append(_fields({"properties": {f"{p['name']} ({p['in']})": p.get("schema", {}) | (
                    {"description": p["description"]} if p.get("description") else {}) for p in params}}))
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body:
                name = _type(body)
                parts.append(f"<p>Body: <code>{html.escape(name)}</code></p>{_fields(schemas.get(name, body))}")
    style = "body{font-family:sans-serif;max-width:60em;margin:auto}td{padding:0 1em 0 0;vertical-align:top}"
    return f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head><body>" \
           f"{''.join(parts)}</body></html>"
