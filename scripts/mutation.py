"""Mutation testing of the modules in scripts/mutation.toml: cosmic-ray's operators, applied in place on disk.

``python scripts/mutation.py freeze`` writes the mutant list (docs/mutation/mutants.json); ``run --out FILE`` checks
that the code still gives that list, then for each mutant writes it into the file, runs the module's tests in a
pytest forked from this process (the third-party imports done once: ``warm``), and records killed, survived or
timeout in FILE (JSON, written after every mutant; ``--resume`` skips those done). In place, not a copy (mutmut 3):
a process a test starts imports the mutant too. ``table FILE [BEFORE]`` prints the per-module table.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from cosmic_ray.ast import ast_nodes, get_ast
from cosmic_ray.mutating import mutate_code
from cosmic_ray.plugins import get_operator

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "scripts" / "mutation.toml"
MUTANTS = ROOT / "docs" / "mutation" / "mutants.json"
PYTEST = ["-q", "-x", "-rf", "-p", "no:cacheprovider", "-n", "0", "-W", "ignore::DeprecationWarning"]
_restore: dict[Path, str] = {}  # files mutated now, and their text: put back on any exit
_child = 0  # the pytest running now: its process group is stopped on any exit


def _scopes(tree: ast.Module, functions: list[str]) -> list[tuple[int, int]]:
    """The (first, last) lines of the named functions (qualified: ``Class.method``); the whole file for ``*``."""
    if functions == ["*"]:
        return [(1, 10**9)]
    found: dict[str, tuple[int, int]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                found[name] = (child.lineno, child.end_lineno)
                visit(child, name + ".")

    visit(tree, "")
    missing = [f for f in functions if f not in found]
    if missing:
        raise SystemExit(f"mutation.toml: no function {', '.join(missing)} in the module")
    return [found[f] for f in functions]


def _annotations(tree: ast.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) positions of every annotation: never evaluated under ``from __future__ import annotations``."""
    spans = []
    for node in ast.walk(tree):
        notes = []
        if isinstance(node, ast.arg):
            notes.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            notes.append(node.annotation)
        spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in notes if n is not None]
    return spans


def enumerate_mutants(config: dict) -> list[dict]:
    """Every mutant the frozen configuration gives on the code as it is, in a fixed order."""
    mutants = []
    for module in config["module"]:
        source = (ROOT / module["path"]).read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        scopes, notes = _scopes(tree, module["functions"]), _annotations(tree)
        listed = {e["line"] for e in config["exclude"] if e["path"] == module["path"]}
        for name in config["operators"]:
            operator = get_operator(name)()
            positions = [p for node in ast_nodes(get_ast(source)) for p in operator.mutation_positions(node)]
            for occurrence, (start, _end) in enumerate(positions):
                text = lines[start[0] - 1]
                if not any(a <= start[0] <= b for a, b in scopes) or any(a <= start < b for a, b in notes):
                    continue
                if text.strip() in listed:
                    continue
                if "pragma: no mutate" in text:
                    raise SystemExit(f"{module['path']}:{start[0]}: pragma: no mutate not listed in mutation.toml")
                mutated = mutate_code(source, operator, occurrence).splitlines()[start[0] - 1]
                mutants.append(
                    {
                        "id": f"{module['path']}:{name.removeprefix('core/')}:{occurrence}",
                        "module": module["name"],
                        "path": module["path"],
                        "operator": name,
                        "occurrence": occurrence,
                        "line": start[0],
                        "col": start[1],
                        "before": text.strip(),
                        "after": mutated.strip(),
                    }
                )
    return mutants


def _put_back(*_: object) -> None:
    for path, text in _restore.items():
        path.write_text(text)
    _restore.clear()


def _signal_exit(signum: int, _: object) -> None:
    if _child:
        try:
            os.killpg(_child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _put_back()
    sys.exit(128 + signum)


def _pytest(args: list[str], measure: tuple[Path, Path] | None) -> int:
    """pytest on ``args`` in this process; with ``measure`` (the module, a data file), the lines of the module each
    test runs, as coverage contexts named by the test's node id (context "": import time)."""
    import pytest

    if measure is None:
        return pytest.main(PYTEST + args)
    import coverage

    cov = coverage.Coverage(data_file=str(measure[1]), include=[str(measure[0])])

    class Contexts:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> object:
            cov.switch_context(item.nodeid)
            yield
            cov.switch_context("")

    cov.start()
    try:
        return pytest.main(PYTEST + args, plugins=[Contexts()])
    finally:
        cov.stop()
        cov.save()


def _run_tests(
    args: list[str], log: Path, timeout: float, measure: tuple[Path, Path] | None = None
) -> tuple[str, float, list[str]]:
    """Fork, run pytest on ``args`` in the child (output to ``log``); killed, survived or timeout, the seconds, the
    failed tests."""
    global _child
    start = time.monotonic()
    pid = _child = os.fork()
    if pid == 0:  # the child: its own process group, so that a timeout stops whatever its tests started
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        try:
            code = _pytest(args, measure)
        except BaseException:  # noqa: BLE001 - a mutant that breaks pytest itself is a failure of the tests
            code = 3
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > timeout:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            _child = 0
            return "timeout", time.monotonic() - start, []
        time.sleep(0.2)
    seconds, _child = time.monotonic() - start, 0
    code = os.waitstatus_to_exitcode(status)
    failed = [
        line.split(" ", 1)[1].split(" - ")[0] for line in log.read_text().splitlines() if line.startswith("FAILED ")
    ]
    return ("survived" if code == 0 else "killed"), seconds, failed[:3] or [f"exit status {code}"]


def _child_env() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant's bytecode never cached
    sys.dont_write_bytecode = True


def run(
    config: dict, out: Path, resume: bool, only: list[str], survivors_of: Path | None = None, new_list: bool = False
) -> None:
    """Run the mutants of the modules ``only`` (all: empty) into ``out``; with ``survivors_of`` (an earlier run's
    file), only those it did not kill: a killed mutant stays killed while no test is removed or weakened. The
    modules' mutants must be the frozen list's; with ``new_list``, the code's own, kept in ``out`` (a fixed defect
    changes a module's list: its run is then reported apart, not against the frozen one)."""
    names = only or [m["name"] for m in config["module"]]
    mutants = [m for m in enumerate_mutants(config) if m["module"] in names]
    if new_list:  # a module whose code changed: its own list, kept in ``out``, compared with no earlier run
        results = json.loads(out.read_text()) if resume and out.is_file() else {"mutants": {}, "baseline": {}}
        if results.setdefault("list", mutants) != mutants:
            raise SystemExit(f"the code no longer gives {out}'s own mutant list")
    elif mutants != [m for m in json.loads(MUTANTS.read_text()) if m["module"] in names]:
        raise SystemExit(f"the code or scripts/mutation.toml no longer gives {MUTANTS.relative_to(ROOT)}'s mutants")
    else:
        results = json.loads(out.read_text()) if resume and out.is_file() else {"mutants": {}, "baseline": {}}
    _child_env()
    for name in config["warm"]:
        importlib.import_module(name)
    assert not any(m.split(".")[0] in ("vitattn", "tests") for m in sys.modules), "the harness imported vitattn"
    atexit.register(_put_back)
    signal.signal(signal.SIGTERM, _signal_exit)
    signal.signal(signal.SIGINT, _signal_exit)
    log = Path(tempfile.gettempdir()) / f"mutation-{out.stem}.log"  # the last pytest's output
    modules = {m["name"]: m for m in config["module"]}
    listed = results.get("list") or json.loads(MUTANTS.read_text())
    if survivors_of:  # its killed mutants are carried over as killed, marked with the file they come from
        old = json.loads(survivors_of.read_text())["mutants"]
        for key in [m["id"] for m in mutants if old.get(m["id"], {}).get("status") in ("killed", "timeout")]:
            results["mutants"].setdefault(key, {**old[key], "carried_from": survivors_of.name})
    for name in only or list(modules):  # in the order given
        module = modules[name]
        path = ROOT / module["path"]
        by_coverage = module.get("select", "all") == "coverage"
        if name not in results["baseline"]:  # the tests must pass on the code as it is
            data = Path(tempfile.gettempdir()) / f"mutation-{out.stem}.coverage"
            measure = (path, data) if by_coverage else None
            verdict, seconds, failed = _run_tests(module["tests"], log, module["timeout"], measure)
            if verdict != "survived":
                raise SystemExit(f"{name}: the tests fail without a mutant ({verdict}: {failed}); see {log}")
            results["baseline"][name] = round(seconds, 1)
            if by_coverage:
                results.setdefault("reach", {})[name] = _reach(data, path)
            print(f"{name}: tests pass unmutated in {seconds:.1f} s", flush=True)
        statements = _statements(path)
        todo = [m for m in mutants if m["module"] == name and m["id"] not in results["mutants"]]
        if by_coverage:  # the mutants no test reaches first: they take no time
            tests = {
                m["id"]: _tests_reaching(results["reach"][name], statements(m["line"]), module["tests"]) for m in todo
            }
            todo.sort(key=lambda m: bool(tests[m["id"]]))
        for i, mutant in enumerate(todo, 1):
            args = tests[mutant["id"]] if by_coverage else module["tests"]
            if not args:  # no test runs the line: it survives whatever it is
                verdict, seconds, failed = "survived", 0.0, []
            else:
                original = path.read_text()
                operator = get_operator(mutant["operator"])()
                _restore[path] = original
                path.write_text(mutate_code(original, operator, mutant["occurrence"]))
                try:
                    verdict, seconds, failed = _run_tests(args, log, module["timeout"])
                finally:
                    _put_back()
            results["mutants"][mutant["id"]] = {
                "status": verdict,
                "seconds": round(seconds, 1),
                **({"killed_by": failed} if verdict == "killed" else {}),
                **({"reached": False} if not args else {}),
            }
            print(f"{name} {i}/{len(todo)} {verdict:8} {seconds:5.1f} s {mutant['id']}: {mutant['after']}", flush=True)
            results["summary"] = summary(listed, results)
            out.write_text(json.dumps(results, indent=1) + "\n")


def _reach(data_file: Path, path: Path) -> dict[str, list[str]]:
    """Line -> the tests (node ids) that run it, from the baseline's coverage; "" for a line run at import."""
    import coverage

    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    (measured,) = [f for f in data.measured_files() if Path(f).resolve() == path.resolve()]
    return {str(line): sorted(tests) for line, tests in sorted(data.contexts_by_lineno(measured).items())}


def _statements(path: Path) -> object:
    """A function of a line: the lines of the innermost statement holding it (a compound statement's header only),
    since coverage marks a statement by some of its lines."""
    spans = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            last = body[0].lineno - 1 if isinstance(body, list) and body and body[0].lineno > node.lineno else None
            spans.append((node.lineno, last or node.end_lineno))

    def lines(line: int) -> range:
        a, b = min((s for s in spans if s[0] <= line <= s[1]), key=lambda s: s[1] - s[0], default=(line, line))
        return range(a, b + 1)

    return lines


def _tests_reaching(reach: dict[str, list[str]], lines: range, tests: list[str]) -> list[str]:
    """The pytest arguments that run only the tests reaching ``lines``: all of ``tests`` for a line run at import
    (a default value, a constant), none for a line no test runs."""
    found = {t for line in lines for t in reach.get(str(line), [])}
    if "" in found:
        return tests
    files = [a for a in tests if a.endswith(".py")]
    options = [a for a in tests if a not in files]
    return (
        [*sorted(found, key=lambda t: (files.index(t.split("::")[0]) if t.split("::")[0] in files else 0, t)), *options]
        if found
        else []
    )


def summary(mutants: list[dict], results: dict) -> dict[str, dict[str, int]]:
    """Per module: mutants, and those killed, survived, timed out and not yet run."""
    table: dict[str, dict[str, int]] = {}
    for mutant in mutants:
        row = table.setdefault(mutant["module"], {"mutants": 0, "killed": 0, "survived": 0, "timeout": 0, "not run": 0})
        row["mutants"] += 1
        row[results["mutants"].get(mutant["id"], {}).get("status", "not run")] += 1
    return table


def table(result: Path, before: Path | None) -> str:
    """The Markdown table of ``result`` (and ``before``'s kill rate beside it): the kill rate counts timeouts as
    killed (a mutant that hangs the tests fails them) over the mutants run."""
    mutants, data = json.loads(MUTANTS.read_text()), json.loads(result.read_text())
    rows = summary(data.get("list", mutants), data)
    old = summary(mutants, json.loads(before.read_text())) if before else None

    def rate(row: dict[str, int]) -> str:
        run = row["mutants"] - row["not run"]
        return f"{(row['killed'] + row['timeout']) / run:.0%}" if run else "-"

    total = {k: sum(r[k] for r in rows.values()) for k in next(iter(rows.values()))}
    head = "| module | mutants | killed | survived | timeout | not run | kill rate |" + (" before |" if old else "")
    lines = [head, "|" + "---|" * head.count(" |")]
    for name, row in [*rows.items(), ("all", total)]:
        cells = [row[k] for k in ("mutants", "killed", "survived", "timeout", "not run")]
        extra = ""
        if old:
            extra = f" {rate(old[name] if name in old else {k: sum(r[k] for r in old.values()) for k in total})} |"
        lines.append(f"| {name} | " + " | ".join(map(str, cells)) + f" | {rate(row)} |" + extra)
    return "\n".join(lines)


def _by_text(mutants: list[dict]) -> dict[tuple, dict]:
    """Mutants keyed by what they do, not where: operator, the line before and after, and which of the equal ones
    (in file order), so that a list made after an edit elsewhere in the file matches the frozen one."""
    seen: dict[tuple, int] = {}
    keyed = {}
    for m in mutants:
        key = (m["path"], m["operator"], m["before"], m["after"])
        seen[key] = seen.get(key, -1) + 1
        keyed[(*key, seen[key])] = m
    return keyed


def survivors(before: Path, after: list[Path], notes: Path) -> str:
    """One line per mutant that survived ``before``: where, the mutated line, its verdict from ``notes`` (the
    committed list, by mutant id: "equivalent: why" or "needs a test: what it asserts") and, given ``after``
    (result files; one with its own list, ``--new-list``, matched by ``_by_text``), its result there; then the
    survivors of a new list that the frozen one lacks or that before did not run."""
    frozen = json.loads(MUTANTS.read_text())
    mutants = {m["id"]: m for m in frozen}
    verdicts = {}
    if notes.is_file():
        for line in notes.read_text().splitlines():
            if line.startswith("- `") and " -- " in line:
                verdicts[line[3:].split("`", 1)[0]] = line.split(" -- ", 1)[1].split(" => after:")[0]
    old = json.loads(before.read_text())["mutants"]
    new: dict[str, dict] = {}
    changed: set[str] = set()  # the modules run on a list of their own
    extra: list[tuple[dict, str]] = []  # a new list's survivors: not in the frozen list, or not run before
    for path in after:
        result = json.loads(path.read_text())
        if "list" not in result:
            new.update(result["mutants"])
            continue
        changed |= {m["module"] for m in result["list"]}
        keyed = _by_text([m for m in frozen if m["module"] in changed])
        for key, m in _by_text(result["list"]).items():
            status = result["mutants"].get(m["id"], {"status": "not run"})
            was = keyed[key]["id"] if key in keyed else None
            if was:
                new[was] = {**status, "now": m["id"]}
            if status["status"] == "survived" and old.get(was, {}).get("status") != "survived":
                extra.append((m, "not run before" if was else "new"))
    lines = []
    for key, mutant in mutants.items():
        if old.get(key, {}).get("status") != "survived":
            continue
        line = f"- `{key}` line {mutant['line']}: `{mutant['after']}` -- {verdicts.get(key, 'TODO')}"
        if after:
            gone = {"status": "gone (the code changed)"} if mutant["module"] in changed else {"status": "not run"}
            result = new.get(key, gone)
            by = f" by {result['killed_by'][0]}" if "killed_by" in result else ""
            now = f" (now `{result['now']}`)" if result.get("now", key) != key else ""
            line += f" => after: {result['status']}{by}{now}"
        lines.append(line)
    for m, why in extra:
        lines.append(f"- `{m['id']}` ({why}) line {m['line']}: `{m['after']}` -- {verdicts.get(m['id'], 'TODO')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("freeze", help=f"write the mutant list to {MUTANTS.relative_to(ROOT)}")
    run_parser = sub.add_parser("run", help="run every mutant of the frozen list")
    run_parser.add_argument("--out", type=Path, required=True)
    run_parser.add_argument("--resume", action="store_true", help="skip the mutants already in --out")
    run_parser.add_argument("--module", action="append", default=[], help="only these modules, in this order")
    run_parser.add_argument(
        "--new-list", action="store_true", help="the modules' mutants as the code gives them now, kept in --out"
    )
    run_parser.add_argument(
        "--only-survivors", type=Path, metavar="BEFORE", help="only the mutants BEFORE (a result file) did not kill"
    )
    table_parser = sub.add_parser("table", help="the per-module table of a result file")
    table_parser.add_argument("result", type=Path)
    table_parser.add_argument("before", type=Path, nargs="?")
    survivors_parser = sub.add_parser("survivors", help="the survivors of BEFORE, their verdicts, AFTER's result")
    survivors_parser.add_argument("before", type=Path)
    survivors_parser.add_argument("after", type=Path, nargs="*")
    survivors_parser.add_argument("--notes", type=Path, default=MUTANTS.parent / "survivors.md")
    args = parser.parse_args()
    config = tomllib.loads(CONFIG.read_text())
    if args.command == "freeze":
        mutants = enumerate_mutants(config)
        MUTANTS.parent.mkdir(parents=True, exist_ok=True)
        MUTANTS.write_text(json.dumps(mutants, indent=1) + "\n")
        counts = {m["module"]: 0 for m in mutants}
        for m in mutants:
            counts[m["module"]] += 1
        print(f"{len(mutants)} mutants: {counts}")
    elif args.command == "run":
        os.nice(10)
        run(config, args.out, args.resume, args.module, args.only_survivors, args.new_list)
        print(table(args.out, None))
    elif args.command == "table":
        print(table(args.result, args.before))
    else:
        print(survivors(args.before, args.after, args.notes))


if __name__ == "__main__":
    main()
