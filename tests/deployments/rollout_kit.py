"""The control plane's rollout routes as the rollout tests call them: one adapter's status, start, a wait for a
condition on its status, and its audit log, each against an app's base URL."""

from __future__ import annotations

import json
import time
from typing import Callable, NamedTuple

import httpx


class RolloutCalls(NamedTuple):
    status: Callable[[str], dict]
    start: Callable[..., dict]
    wait: Callable[..., dict]
    audit: Callable[[str], list[dict]]


def rollout_calls(name: str, auth: dict, policy: dict, start_timeout_s: float = 120,
                  wait_timeout_s: float = 180) -> RolloutCalls:
    """The four calls for adapter `name` with the admin headers `auth`; `start` merges its keywords into `policy`."""
    route = f"/admin/v1/adapters/{name}/rollout"

    def status(base: str) -> dict:
        r = httpx.get(base + route, headers=auth, timeout=30)
        r.raise_for_status()
        return r.json()

    def start(base: str, version: int, **overrides) -> dict:
        r = httpx.post(base + route, headers=auth, timeout=start_timeout_s,
                       json={"version": version, "policy": {**policy, **overrides}})
        assert r.status_code == 201, r.text
        return r.json()

    def wait(base: str, done: Callable[[dict], bool], timeout_s: float = wait_timeout_s) -> dict:
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            last = status(base)
            if done(last):
                return last
            time.sleep(0.3)
        raise AssertionError(f"rollout did not get there in {timeout_s} s: {json.dumps(last)[:3000]}")

    def audit(base: str) -> list[dict]:
        r = httpx.get(f"{base}/admin/v1/audit", headers=auth,
                      params={"name": name, "order": "oldest", "limit": 1000})
        r.raise_for_status()
        return r.json()

    return RolloutCalls(status, start, wait, audit)
