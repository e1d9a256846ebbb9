"""The size of the package: files, lines, docstring lines, and the imports between its modules.

    python scripts/house.py [PACKAGE_DIR]           # default: vitattn/ of this checkout
    python scripts/house.py --trace [PACKAGE_DIR]   # also follow the config and its plan through one tiny train(cfg)
    python scripts/house.py --trace --trace-overrides finetune.init=RUN head=classification  # that run's trace
    python scripts/house.py --counts [-v] [PACKAGE_DIR]  # also count raw config reads, task strings, config imports

Docstring lines are the lines of module, class and function docstrings. An import arrow is one module
importing another of the package (top level or inside a function, as grimp counts them); a circle is a
set of two or more modules that reach each other through such arrows (a strongly connected component), or a
module that imports a name from its own package (``from vitattn.data.shards import reading`` inside
``vitattn.data.shards.stream``), whose ``__init__`` imports the module back.

``--counts`` (by module; ``-v``: each hit with its line), from the syntax tree alone:

- A raw config read, counted outside training/plan.py and training/config.py: ``E.key``, ``E.get(...)``,
  ``E[...]`` or ``"key" in E`` where ``E`` is a config expression: a name of a function whose parameter annotation
  names ``DictConfig`` (``cfg: DictConfig``, ``DictConfig | None``), any ``X.cfg`` (``plan.cfg``), or a name assigned
  from either or from a read (``cfg = plan.cfg``, ``data = cfg.data``) in that function. A chain is one read:
  ``cfg.head.task``, ``cfg.trainer.get("devices", 1)``, ``plan.cfg.head["task"]`` count 1 each. A nested function
  starts with its own parameters only; a value passed on as a plain argument (``f(cfg.model.depth)``) is one read.
- A task comparison, counted under training/: ``==``, ``!=``, ``in`` or ``not in`` with a task's name ("caption",
  "classification", "coca") or a collection of them on one side (``task == "caption"``, ``trained in (...)``).
- ``"contrastive" in X`` (and ``not in``), package-wide: head=coca told apart by a key.
- omegaconf and hydra imports: the modules that import either (at the top or inside a function), with what.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import grimp


def docstring_lines(source: str) -> int:
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                count += first.end_lineno - first.lineno + 1
    return count


def circles(graph: grimp.ImportGraph) -> list[set[str]]:
    """Tarjan's strongly connected components of two or more modules."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(module: str) -> None:
        index[module] = low[module] = counter[0]
        counter[0] += 1
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(10_000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def own_package_imports(package: Path, files: list[Path]) -> list[str]:
    found = []
    for path in files:
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts))} - {module}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in ancestors:
                found.append(f"{module} imports from its own package {node.module}")
    return found


# the image-text head and what came with it (zero-shot, retrieval, embeddings, the Hub), counted apart
IMAGE_TEXT = [
    "models/coca.py", "training/systems/coca.py", "losses.py", "inference/embeddings.py",
    "inference/zero_shot.py", "serve/embeddings.py", "bundle/hub.py", "bundle/card.py", "metrics/metric.py",
    "metrics/retrieval.py",
]  # fmt: skip

TINY = [
    "model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.patch_size=8", "data.img_size=32",
    "data.batch_size=8", "data.num_train=32", "data.num_val=8", "data.num_test=8", "trainer.fast_dev_run=true",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "logger=csv", "num_threads=1",
]  # fmt: skip


def follow_config(output_dir: Path, overrides: list[str] = ()) -> list[str]:
    """The vitattn modules entered, in order, by the calls that receive the config (or a node of it), the plan
    resolved from it or one of the plan's typed parts (trainer, precision, resume, start weights) during one tiny
    ``train(cfg)`` (captioning unless ``overrides`` say otherwise); consecutive calls into the same module are one
    visit. An override whose value is ``RUN`` (``finetune.init=RUN``) names a tiny run of the other overrides,
    trained first, untraced."""
    from hydra import compose, initialize_config_module
    from omegaconf import DictConfig

    def composed(folder: Path, extra: list[str]) -> DictConfig:
        with initialize_config_module("vitattn.conf", version_base="1.3"):
            return compose("train", overrides=[*TINY, *extra, f"paths.output_dir={folder}"])

    from vitattn.training.recipe import train

    plain = [o for o in overrides if o.partition("=")[2] != "RUN"]
    if len(plain) < len(overrides):
        start = output_dir.parent / "start"
        train(composed(start, plain))
        overrides = [f"{o.partition('=')[0]}={start}" if o.partition("=")[2] == "RUN" else o for o in overrides]
    cfg = composed(output_dir, list(overrides))
    from vitattn.training.plan import Plan, Precision, Resume, TrainerPlan
    from vitattn.training.start_weights import EncoderWeights, ModelWeights

    followed = (DictConfig, Plan, TrainerPlan, Precision, Resume, ModelWeights, EncoderWeights)

    visits: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("vitattn."):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(isinstance(frame.f_locals.get(n), followed) for n in names) and (not visits or visits[-1] != module):
            visits.append(module)

    sys.setprofile(profile)
    try:
        train(cfg)
    finally:
        sys.setprofile(None)
    return visits


# The --counts section: how the package reads its config (see the module docstring for the rules).
CONFIG_OWNERS = ("training/plan.py", "training/config.py")
TASK_NAMES = {"caption", "classification", "coca"}


def _mentions_dictconfig(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return "DictConfig" in annotation.value
    return any(isinstance(n, ast.Name | ast.Attribute) and _name(n) == "DictConfig" for n in ast.walk(annotation))


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


class _ConfigReads(ast.NodeVisitor):
    """The raw reads of one module: each outermost ``E.key``, ``E.get(...)`` or ``E[...]`` on a config expression
    ``E`` (a config-typed name of the function it is in, or ``X.cfg``), one read per chain."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, str]] = []
        self.scopes: list[set[str]] = [set()]

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]
        typed = {a.arg for a in args if a is not None and _mentions_dictconfig(a.annotation)}
        self.scopes.append(set(typed))
        for statement in node.body:
            self.visit(statement)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _is_config(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.scopes[-1]
        return isinstance(node, ast.Attribute) and node.attr == "cfg"  # plan.cfg, self.cfg

    def _read_base(self, node: ast.expr) -> bool:
        """``node`` is a read: a key, ``.get(...)`` or ``[...]`` of a config expression or of another read."""
        if isinstance(node, ast.Call):
            return isinstance(node.func, ast.Attribute) and node.func.attr == "get" and self._chain(node.func.value)
        if isinstance(node, ast.Attribute | ast.Subscript):
            return self._chain(node.value)
        return False

    def _chain(self, node: ast.expr) -> bool:
        return self._is_config(node) or self._read_base(node)

    def _note(self, node: ast.expr) -> bool:
        if self._read_base(node):
            self.reads.append((node.lineno, ast.unparse(node)))
            for child in ast.iter_child_nodes(node):  # arguments of .get(...) and subscripts may read too
                if not self._chain(child):
                    self.visit(child)
            return True
        return False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not self._note(node):
            self.generic_visit(node)

    visit_Subscript = visit_Attribute

    def visit_Call(self, node: ast.Call) -> None:
        if not self._note(node):
            self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign | ast.AnnAssign) -> None:
        value = node.value
        if value is not None:
            self.visit(value)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        typed = value is not None and (self._is_config(value) or self._read_base(value))
        typed = typed or (isinstance(node, ast.AnnAssign) and _mentions_dictconfig(node.annotation))
        for target in targets:
            if isinstance(target, ast.Name):
                (self.scopes[-1].add if typed else self.scopes[-1].discard)(target.id)
            else:
                self.visit(target)

    visit_AnnAssign = visit_Assign

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, ast.In | ast.NotIn) and self._is_config(right):  # "tokenizer" in cfg
                self.reads.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def config_reads(source: str) -> list[tuple[int, str]]:
    visitor = _ConfigReads()
    visitor.visit(ast.parse(source))
    return visitor.reads


def _strings(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def task_comparisons(source: str) -> list[tuple[int, str]]:
    """``==``, ``!=``, ``in``, ``not in`` with a task's name (or a collection of them) on one side."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            equality = all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops)
            if equality and any(_strings(o) and _strings(o) <= TASK_NAMES for o in operands):
                found.append((node.lineno, ast.unparse(node)))
    return found


def contrastive_tests(source: str) -> list[tuple[int, str]]:
    """``"contrastive" in X`` and ``not in``: head=coca told apart by a key of its config."""
    return [
        (node.lineno, ast.unparse(node))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Constant)
        and node.left.value == "contrastive"
        and isinstance(node.ops[0], ast.In | ast.NotIn)
    ]


def config_imports(source: str) -> list[str]:
    """The omegaconf and hydra modules imported (at the top or inside a function), in order, each once."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        for module in modules:
            if module.split(".")[0] in ("omegaconf", "hydra") and module not in names:
                names.append(module)
    return sorted(names)


def print_counts(package: Path, files: list[Path], verbose: bool) -> None:
    def rows(title: str, found: dict[str, list[tuple[int, str]]]) -> None:
        total = sum(len(v) for v in found.values())
        print(f"{title}: {total}")
        for module, hits in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            if hits:
                print(f"  {len(hits):4d}  {module}")
                for line, text in sorted(hits) if verbose else ():
                    print(f"          {line}: {text}")

    relative = {p: p.relative_to(package).as_posix() for p in files}
    sources = {relative[p]: p.read_text() for p in files}
    outside = {m: config_reads(s) for m, s in sources.items() if m not in CONFIG_OWNERS}
    rows("raw config reads outside training/plan.py and training/config.py", outside)
    training = {m: task_comparisons(s) for m, s in sources.items() if m.startswith("training/")}
    rows("task comparisons under training/", training)
    rows('"contrastive" in X', {m: contrastive_tests(s) for m, s in sources.items()})
    imports = {m: config_imports(s) for m, s in sources.items()}
    importers = {m: names for m, names in imports.items() if names}
    under = [m for m in importers if m.startswith("training/")]
    print(f"modules importing omegaconf or hydra: {len(importers)} ({len(under)} under training/)")
    for module, names in sorted(importers.items()):
        print(f"  {module:<40} {', '.join(names)}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(__file__).resolve().parents[1] / "vitattn"
    parser.add_argument("package", nargs="?", type=Path, default=default, help="default: vitattn/ of this checkout")
    parser.add_argument("--counts", action="store_true", help="also count how the package reads its config")
    parser.add_argument("-v", "--verbose", action="store_true", help="with --counts: each read, line by line")
    parser.add_argument(
        "--trace", action="store_true", help="also follow the config and its plan through one tiny train(cfg)"
    )
    parser.add_argument(
        "--trace-overrides",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="with --trace: overrides of the traced run (a value RUN: a tiny run of the others, trained first)",
    )
    args = parser.parse_args(argv)
    package, trace = args.package.resolve(), args.trace
    files = sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)
    lines = sum(len(p.read_text().splitlines()) for p in files)
    docs = sum(docstring_lines(p.read_text()) for p in files)
    sys.path.insert(0, str(package.parent))
    graph = grimp.build_graph(package.name, include_external_packages=False)
    arrows = sum(len(graph.find_modules_directly_imported_by(m)) for m in graph.modules)
    found = circles(graph)
    own = own_package_imports(package, files)
    print(f"files {len(files)}  lines {lines}  docstring lines {docs} ({100 * docs / lines:.1f} %)")
    rest = [p for p in files if p.relative_to(package).as_posix() not in IMAGE_TEXT]
    rest_lines = sum(len(p.read_text().splitlines()) for p in rest)
    rest_docs = sum(docstring_lines(p.read_text()) for p in rest)
    print(f"  without the image-text modules: files {len(rest)}  lines {rest_lines}  docstring lines {rest_docs}")
    print(f"modules {len(graph.modules)}  import arrows {arrows}  circles {len(found) + len(own)}")
    for component in found:
        print("  circle: " + " <-> ".join(sorted(component)))
    for line in own:
        print("  circle: " + line)
    if args.counts:
        print_counts(package, files, args.verbose)
    if trace:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            visits = follow_config(Path(tmp) / "run", args.trace_overrides)
        returns = len(visits) - len(set(visits))
        config = sum(v.endswith(".config") for v in visits)
        modules = len(set(visits))
        print(f"the config and its plan through train(): {modules} modules, {len(visits)} visits, {returns} returns")
        print(f"  to a module already left; the config module entered {config} times")
        print("  " + " > ".join(v.removeprefix("vitattn.") for v in visits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
