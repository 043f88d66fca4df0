"""Embedded demo models and their LoRA adapters, made ready by the repo itself (no model hub).

    from demo import ensure_smollm2, ensure_demo
    paths = ensure_smollm2()   # the default: SmolLM2-135M-Instruct from a PyPI wheel, converted into the cache
                               # on first use, and the adapters committed under demo/smollm2/adapters/
    paths = ensure_demo()      # the toy fallback: a 3.4M-parameter Llama trained on Python's stdlib at first use
    # both: {"model": dir, "adapters": {name: dir}}

Importing this package pulls in no torch; the demo never imports the engine (engine_ext), and the engine never
imports the demo: tests, benchmarks and the Serve app's bootstrap bring the two together.
"""
from .cache import DemoBuildError, default_cache_dir, ensure_demo, ensure_smollm2, verify_demo
from .recipe import DEFAULT_RECIPE, Recipe, quick_recipe

__all__ = ["ensure_smollm2", "ensure_demo", "verify_demo", "default_cache_dir", "DemoBuildError", "DEFAULT_RECIPE",
           "Recipe", "quick_recipe"]
