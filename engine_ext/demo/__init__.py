"""Embedded demo: a small Llama trained on Python's stdlib, plus LoRA adapters, built by the repo itself.

    from engine_ext.demo import ensure_demo
    paths = ensure_demo()   # {"model": dir, "adapters": {name: dir}}; builds into the cache on first use

Importing this package pulls in no torch and nothing from the engine modules of engine_ext.
"""
from .cache import DemoBuildError, default_cache_dir, ensure_demo, verify_demo
from .recipe import DEFAULT_RECIPE, Recipe, quick_recipe

__all__ = ["ensure_demo", "verify_demo", "default_cache_dir", "DemoBuildError", "DEFAULT_RECIPE", "Recipe",
           "quick_recipe"]
