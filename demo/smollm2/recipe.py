"""The SmolLM2 adapters' recipe: every knob that changes the committed adapter files, in one frozen value.

`python -m demo adapters --out DIR` trains them by this recipe; on one machine (same Python, library versions
and thread count) it rebuilds the committed files bit for bit, which `--check` verifies.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..recipe import ALL_PROJECTIONS, ATTENTION_MODULES

MLP_MODULES = ALL_PROJECTIONS[4:]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    behaviour: str                 # a key of data.BEHAVIOURS
    rank: int
    target_modules: tuple[str, ...]
    steps: int
    description: str
    lr: float = 2e-3
    batch_size: int = 8

    @property
    def alpha(self) -> int:
        return 2 * self.rank


@dataclass(frozen=True)
class AdaptersRecipe:
    seed: int = 1234
    threads: int = 1               # matmul reduction order depends on it: fixed for reproducible bytes
    warmup: int = 5
    max_tokens: int = 256          # conversations longer than this are left out
    adapters: tuple[AdapterSpec, ...] = (
        AdapterSpec("shout", "shout", 8, ATTENTION_MODULES, 60, "answers in capital letters"),
        AdapterSpec("json", "json", 4, ALL_PROJECTIONS, 40, 'answers as JSON: {"answer": ...}'),
        AdapterSpec("docstring", "docstring", 16, ("q_proj", "v_proj"), 50,
                    "writes a one-line docstring for a Python function"),
        AdapterSpec("terse", "terse", 4, MLP_MODULES, 40, "answers with the bare fact, no sentence"),
    )


DEFAULT_ADAPTERS = AdaptersRecipe()


def recipe_to_dict(recipe: AdaptersRecipe) -> dict:
    return dataclasses.asdict(recipe)
