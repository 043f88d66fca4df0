"""Training text that exists on every machine: Python's own standard library.

Each *domain* is a (train, heldout) pair of document lists. Files are read in sorted order and
split by index, so the same Python installation always yields the same text.
"""
from __future__ import annotations

import ast
import inspect
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from .recipe import CorpusRecipe, ROLE_TOKENS

# Directories that are data, generated tables or vendored code rather than representative source.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data", "idlelib",
              "lib2to3", "turtledemo", "ensurepip", "test", "tests", "idle_test", "config-3"}
_TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class Domain:
    train: tuple[str, ...]
    heldout: tuple[str, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _rel_parts(path: Path, root: Path) -> tuple[str, ...]:
    return path.relative_to(root).parts


def source_files(root: Path) -> list[Path]:
    """Library modules (no tests, no vendored/data packages), sorted for a stable order."""
    files = []
    for p in root.rglob("*.py"):
        parts = _rel_parts(p, root)
        if set(parts[:-1]) & _SKIP_DIRS or parts[-1].startswith("test_") or parts[0].startswith("config-"):
            continue
        files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def test_files(root: Path) -> list[Path]:
    """Unit-test modules: Lib/test when the distribution ships it (Debian splits it out), else any test dir."""
    files = [p for p in root.rglob("test_*.py")
             if set(_rel_parts(p, root)[:-1]) & _TEST_DIRS and "site-packages" not in _rel_parts(p, root)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def split_docs(docs: list[str], budget: int, every: int) -> Domain:
    """Held-out = every `every`-th document; both halves are capped so their sum is about `budget` chars."""
    train, heldout, used = [], [], 0
    for i, doc in enumerate(docs):
        if used >= budget:
            break
        (heldout if i % every == 0 else train).append(doc)
        used += len(doc)
    return Domain(tuple(train), tuple(heldout))


def docstrings(tree: ast.Module) -> list[tuple[str, str, str]]:
    """(qualified name, header line, cleaned docstring) for the module and every class/function, in order.

    The header is the `def name(args):` / `class Name:` line the docstring belongs to ("" for the module).
    """
    out = []

    def header(node: ast.AST) -> str:
        if isinstance(node, ast.ClassDef):
            return f"class {node.name}:"
        prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        return f"{prefix} {node.name}({ast.unparse(node.args)}):"

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    out.append((name, header(child), inspect.cleandoc(doc)))
                visit(child, name + ".")

    mod_doc = ast.get_docstring(tree)
    if mod_doc:
        out.append(("", "", inspect.cleandoc(mod_doc)))
    visit(tree, "")
    return out


def documented(header: str, doc: str) -> str:
    """`def f(x):` + its docstring, indented, and no body: the docs adapter learns to write docstrings."""
    body = "\n".join(("    " + line) if line else "" for line in f'"""{doc}\n"""'.split("\n"))
    return f"{header}\n{body}\n" if header else f'"""{doc}\n"""\n'


def module_name(path: Path, root: Path) -> str:
    parts = list(_rel_parts(path, root))
    parts[-1] = parts[-1][:-3]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _summary(doc: str) -> str:
    return doc.strip().split("\n\n")[0].replace("\n", " ").strip()


def changelog_entries(api: list[tuple[str, str, str]]) -> list[str]:
    """NEWS-style release notes generated from (module, name, docstring); numbers come from a CRC, not chance."""
    verbs = ("Fix", "Add", "Improve", "Deprecate", "Document")
    entries = []
    for mod, name, doc in api:
        h = zlib.crc32(f"{mod}.{name}".encode())
        role = "class" if name[:1].isupper() else "func"
        entries.append(f"- gh-{10000 + h % 90000}: {verbs[h % len(verbs)]} :{role}:`{mod}.{name}`. "
                       f"{_summary(doc)}")
    # 24 entries per release section, newest first, as in Misc/NEWS.
    docs = []
    for i in range(0, len(entries), 24):
        n = len(entries) // 24 - i // 24
        header = f"What's New in Python 3.{n % 14}.{n % 9} final\n" + "=" * 32 + "\n\nLibrary\n-------\n\n"
        docs.append(header + "\n\n".join(entries[i:i + 24]) + "\n")
    return docs


def chat_examples(api: list[tuple[str, str, str]]) -> list[str]:
    """Chat-formatted Q&A ('What does `mod.name` do?' -> first docstring paragraph) in the chat template's shape."""
    user, assistant = ROLE_TOKENS[1], ROLE_TOKENS[2]
    return [f"{user}\nWhat does `{mod}.{name}` do?\n{assistant}\n{_summary(doc)}\n" for mod, name, doc in api]


def quote_lines(text: str) -> str:
    return "".join("> " + line for line in text.splitlines(keepends=True))


def strip_docstrings(tree: ast.Module, cap: int) -> str:
    """Code only: docstrings dropped (they are the docs domain) and comments/formatting normalised by unparse,
    cut to `cap` characters. Modifies `tree`.

    Pure code has far less entropy than code + prose, which is what lets a few CPU-minutes of training produce
    something that reads like Python.
    """
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    # Unparse only the top-level statements that reach `cap` (ast.unparse is slow pure Python; files run to 100k+).
    # A statement adds at least its own text plus one newline inside the module, so `used` never overshoots and
    # the result equals ast.unparse(tree)[:cap] byte for byte.
    used, keep = 0, len(tree.body)
    for i, stmt in enumerate(tree.body):
        used += len(ast.unparse(stmt)) + (1 if i else 0)
        if used >= cap:
            keep = i + 1
            break
    return ast.unparse(ast.Module(body=tree.body[:keep], type_ignores=[]))[:cap]


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _shuffled(files: list[Path], root: Path) -> list[Path]:
    """A fixed pseudo-random order (CRC of the path), so a capped corpus samples all packages, not just a-c."""
    return sorted(files, key=lambda p: (zlib.crc32(p.relative_to(root).as_posix().encode()), p.name))


def _lazy_trees(files: list[Path]):
    """Parse on demand: the test suite is large and only its first files fit the budget."""
    return (_parse(read_text(p)) for p in files)


def _code_docs(trees, budget: int, cap: int) -> list[str]:
    docs, used = [], 0
    for tree in trees:
        if used >= budget:
            break
        if tree is not None:
            docs.append(strip_docstrings(tree, cap))
            used += len(docs[-1])
    return docs


def build_domains(root: Path, recipe: CorpusRecipe) -> dict[str, Domain]:
    """All domains: base (code + chat), docs, tests, changelog, quoted, upper, dquote."""
    cap, every, budget = recipe.max_chars_per_file, recipe.heldout_every, recipe.domain_chars
    files = _shuffled(source_files(root), root)
    trees = [_parse(read_text(p)) for p in files]   # parsed once: docstrings first, then code without them
    # Public top-level API with docstrings: feeds docs, changelog and chat text.
    api, doc_docs, doc_used = [], [], 0
    for p, tree in zip(files, trees):
        mod, ds = module_name(p, root), (docstrings(tree) if tree is not None else [])
        if ds and doc_used < budget * 1.2:
            doc_docs.append("\n".join(documented(h, d) for _, h, d in ds)[:cap])
            doc_used += len(doc_docs[-1])
        if any(part.startswith("_") for part in mod.split(".")):
            continue   # private modules (_pydecimal, _collections_abc) would teach the chat to cite internals
        api.extend((mod, name, d) for name, _, d in ds if name and "." not in name and not name.startswith("_"))

    chat_budget = int(recipe.base_chars * recipe.chat_fraction)
    chat = split_docs(chat_examples(api), chat_budget, every)
    code = _code_docs(trees, recipe.base_chars - chat_budget, cap)
    base_code = split_docs(code, recipe.base_chars - chat_budget, every)
    base = Domain(_interleave(base_code.train, chat.train), base_code.heldout + chat.heldout)
    tests = _code_docs(_lazy_trees(_shuffled(test_files(root), root)), budget * 1.2, cap)
    return {
        "base": base,
        "docs": split_docs(doc_docs, budget, every),
        "tests": split_docs(tests or doc_docs, budget, every),
        "changelog": split_docs(changelog_entries(api), budget, every),
        "quoted": split_docs([quote_lines(c) for c in code], budget, every),
        "upper": split_docs([c.upper() for c in code], budget, every),
        "dquote": split_docs([c.replace("'", '"') for c in code], budget, every),
    }


def _interleave(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    """Spread the b documents evenly through a (so chat text is not one block at the end)."""
    if not b:
        return a
    step = max(1, len(a) // len(b))
    out, bi = [], 0
    for i, doc in enumerate(a):
        out.append(doc)
        if i % step == step - 1 and bi < len(b):
            out.append(b[bi])
            bi += 1
    return tuple(out) + b[bi:]


def tokenizer_texts(domains: dict[str, Domain], budget: int) -> list[str]:
    """Training text for the BPE merges: mostly base code, plus a share of every domain so each has its own tokens."""
    share = {"base": 0.5, "docs": 0.1, "tests": 0.1, "changelog": 0.1, "upper": 0.2}
    texts = []
    for name, frac in share.items():
        used = 0
        for doc in domains[name].train:
            if used >= budget * frac:
                break
            texts.append(doc)
            used += len(doc)
    return texts
