"""The size of the package: files, lines, docstring lines, and the imports between its modules.

    python scripts/house.py [PACKAGE_DIR]           # default: vitattn/ of this checkout
    python scripts/house.py --trace [PACKAGE_DIR]   # also follow the config and its plan through one tiny train(cfg)

Docstring lines are the lines of module, class and function docstrings. An import arrow is one module
importing another of the package (top level or inside a function, as grimp counts them); a circle is a
set of two or more modules that reach each other through such arrows (a strongly connected component), or a
module that imports a name from its own package (``from vitattn.data.shards import reading`` inside
``vitattn.data.shards.stream``), whose ``__init__`` imports the module back.
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


def follow_config(output_dir: Path) -> list[str]:
    """The vitattn modules entered, in order, by the calls that receive the config (or a node of it), the plan
    resolved from it or one of the plan's typed parts (trainer, precision, resume, start weights) during one tiny
    captioning ``train(cfg)``; consecutive calls into the same module are one visit."""
    from hydra import compose, initialize_config_module
    from omegaconf import DictConfig

    with initialize_config_module("vitattn.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*TINY, f"paths.output_dir={output_dir}"])
    from vitattn.training.plan import Plan, Precision, Resume, TrainerPlan
    from vitattn.training.recipe import train
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(__file__).resolve().parents[1] / "vitattn"
    parser.add_argument("package", nargs="?", type=Path, default=default, help="default: vitattn/ of this checkout")
    parser.add_argument(
        "--trace", action="store_true", help="also follow the config and its plan through one tiny train(cfg)"
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
    if trace:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            visits = follow_config(Path(tmp) / "run")
        returns = len(visits) - len(set(visits))
        config = sum(v.endswith(".config") for v in visits)
        modules = len(set(visits))
        print(f"the config and its plan through train(): {modules} modules, {len(visits)} visits, {returns} returns")
        print(f"  to a module already left; the config module entered {config} times")
        print("  " + " > ".join(v.removeprefix("vitattn.") for v in visits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
