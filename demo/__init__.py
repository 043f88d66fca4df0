"""Embedded demo: a small Llama trained on Python's stdlib, plus LoRA adapters, built by the repo itself.

    from demo import ensure_demo
    paths = ensure_demo()   # {"model": dir, "adapters": {name: dir}}; builds into the cache on first use

Importing this package pulls in no torch; the demo never imports the engine (engine_ext), and the engine never
imports the demo: tests, benchmarks and the Serve app's bootstrap bring the two together.
"""
from .cache import DemoBuildError, default_cache_dir, ensure_demo, verify_demo
from .recipe import DEFAULT_RECIPE, Recipe, quick_recipe

__all__ = ["ensure_demo", "verify_demo", "default_cache_dir", "DemoBuildError", "DEFAULT_RECIPE", "Recipe",
           "quick_recipe"]
