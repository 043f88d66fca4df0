"""`AdapterKey`: one adapter version, `name@version`, as the ingress resolves it, the router routes on it
(the multiplexed model id), the replica loads it and the engine names it.

Registry names are `[A-Za-z0-9][A-Za-z0-9_.-]{0,63}` (no `@`), so the key splits unambiguously. The family
(the name alone) is what placement homes and tiers follow, so a promoted version keeps its homes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdapterKey"]


@dataclass(frozen=True, order=True)
class AdapterKey:
    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def parse(cls, key: str) -> "AdapterKey":
        """'name@3' -> AdapterKey('name', 3); ValueError for anything else."""
        name, sep, version = key.partition("@")
        if not sep or not name or not version.isdigit():
            raise ValueError(f"an adapter key is 'name@version', got {key!r}")
        return cls(name, int(version))

    @staticmethod
    def family(key: str) -> str:
        """The name part of `key` ('name@3' -> 'name'; a bare name is its own family)."""
        return key.partition("@")[0]
