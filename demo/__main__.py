"""`python -m demo build` -> last line of stdout is {"model": DIR, "adapters": {NAME: DIR}}.

  build                       build into the cache (LORASERVE_CACHE or ~/.cache/loraserve) unless already there
  build --out DIR             build into DIR in this process (what the cache runs in a child process)
  build --quick [--seed N]    the seconds-long recipe (tests)
  report                      print the bench/RESULTS.md table for the cached default build
  samples                     greedy completions of the base and each adapter (transformers + peft)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .recipe import DEFAULT_RECIPE, quick_recipe, recipe_from_dict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or find) the demo model and adapters")
    b.add_argument("--out", type=Path, help="build into this directory instead of the cache")
    b.add_argument("--cache-dir", type=Path, help="cache directory (default: $LORASERVE_CACHE or ~/.cache/loraserve)")
    b.add_argument("--quick", action="store_true", help="tiny, seconds-long recipe")
    b.add_argument("--seed", type=int, help="override the recipe seed")
    b.add_argument("--recipe-json", type=Path, help=argparse.SUPPRESS)
    r = sub.add_parser("report", help="markdown table of held-out loss and agreement")
    r.add_argument("--cache-dir", type=Path)
    s = sub.add_parser("samples", help="greedy completions, base vs each adapter")
    s.add_argument("--cache-dir", type=Path)
    args = parser.parse_args(argv)

    if args.cmd == "samples":
        from .cache import ensure_demo
        from .samples import greedy_samples, samples_markdown
        print(samples_markdown(greedy_samples(ensure_demo(args.cache_dir))))
        return 0

    if args.cmd == "report":
        from .cache import ensure_demo
        from .evaluate import results_table
        paths = ensure_demo(args.cache_dir)
        metrics = json.loads((Path(paths["model"]).parent / "metrics.json").read_text())
        print(results_table(metrics, "python -m demo build && python -m demo report"))
        return 0

    if args.recipe_json:
        recipe = recipe_from_dict(json.loads(args.recipe_json.read_text()))
    else:
        recipe = quick_recipe() if args.quick else DEFAULT_RECIPE
    if args.seed is not None:
        import dataclasses
        recipe = dataclasses.replace(recipe, seed=args.seed)
    if args.out:
        from .build import build_demo
        paths = build_demo(args.out.resolve(), recipe, log=lambda line: print(line, file=sys.stderr, flush=True))
    else:
        from .cache import ensure_demo
        paths = ensure_demo(args.cache_dir, recipe)
    print(json.dumps(paths), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
