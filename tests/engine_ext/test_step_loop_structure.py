"""The step loop's structure, read from its source: a sequence's progress has one writer (the scheduler, updating
it from what a step queued and what reading it gave), one place builds a Flight, and no function of the executor,
the step's plan or the loop around it runs past 50 lines."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "engine_ext"
# Sequence fields that say how far a sequence has got, and the one module that writes them
PROGRESS = {"num_computed", "flight", "flight_row", "pending", "status", "num_cached_blocks"}
OWNER = "scheduler.py"
STEP_LOOP = ["executor.py", "flight.py", "llm_engine.py", "scheduler.py", "speculation/cycle.py",
             "speculation/plan.py", "speculation/verify.py"]


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def assigned_attributes(tree: ast.AST):
    """(line, attribute name, the expression it is set on) of every attribute assignment: plain, augmented,
    annotated, unpacked into a tuple or list, or through setattr with a literal name."""
    def targets(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Starred):
            yield from targets(t.value)
        elif isinstance(t, ast.Attribute):
            yield t.lineno, t.attr, ast.unparse(t.value)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                yield from targets(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            yield from targets(node.target)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            yield node.lineno, node.args[1].value, ast.unparse(node.args[0])


def test_assignments_are_found_in_every_form():
    src = ("a.flight = 1\nb.x, c.pending = 1, 2\nd.num_computed += 1\nsetattr(e, 'flight_row', 0)\n"
           "self.status: int = 0\n")
    found = {(attr, on) for _, attr, on in assigned_attributes(ast.parse(src))}
    assert found == {("flight", "a"), ("x", "b"), ("pending", "c"), ("num_computed", "d"), ("flight_row", "e"),
                     ("status", "self")}


def test_only_the_scheduler_writes_a_sequences_progress():
    """num_computed, flight, flight_row, pending, status and num_cached_blocks are set by the scheduler alone: the
    executor only says what it queued (a Flight), the engine only appends tokens."""
    writes = []
    for path in modules():
        if path.relative_to(PACKAGE).as_posix() == OWNER:
            continue
        for line, attr, on in assigned_attributes(ast.parse(path.read_text())):
            if attr in PROGRESS and on != "self":
                writes.append(f"{path.relative_to(PACKAGE)}:{line}: {on}.{attr}")
    assert not writes, "progress written outside the scheduler:\n" + "\n".join(writes)


def test_the_scheduler_writes_them():
    """(The test above finds the scheduler's writes: it is not vacuous.)"""
    tree = ast.parse((PACKAGE / OWNER).read_text())
    written = {attr for _, attr, on in assigned_attributes(tree) if on != "self"}
    assert PROGRESS <= written


def test_one_place_builds_a_flight():
    builders = []
    for path in modules():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                         and n.func.id == "Flight"]
                builders += [f"{path.relative_to(PACKAGE)}:{fn.name}"] * len(calls)
    assert builders == ["executor.py:_flight"]


@pytest.mark.parametrize("name", STEP_LOOP)
def test_no_step_loop_function_over_50_lines(name):
    tree = ast.parse((PACKAGE / name).read_text())
    long = [f"{fn.name}: {fn.end_lineno - fn.lineno + 1} lines" for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno + 1 > 50]
    assert not long, f"{name}: " + ", ".join(long)
