"""The names of the files vitattn writes (run folders, bundles, ONNX folders, shard sets) are each spelled in one
module, which every other module asks; docstrings and messages may mention them. A module's docstring says what
and why in at most 12 lines (design notes go to docs/)."""

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import vitattn

FILE_NAME = re.compile(r"^[\w.-]+\.(json|jsonl|yaml|ckpt|onnx|safetensors|txt|csv)$")
# Names of files that are not ours to lay out: what timm's hub repositories hold (vitattn.models.timm_weights: their
# weights and their config.json).
NOT_OURS = {"model.safetensors", "open_clip_model.safetensors", "config.json"}
NOT_OURS_MODULE = "vitattn/models/timm_weights.py"


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _messages(tree: ast.AST) -> set[int]:
    """String pieces of f-strings and of arguments to raise/log calls: text for people, not paths."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            ids.update(id(v) for v in node.values)
    return ids


def spelled_file_names(root: Path) -> dict[str, set[str]]:
    where: dict[str, set[str]] = defaultdict(set)
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree) | _messages(tree)
        module = str(path.relative_to(root.parent))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if FILE_NAME.match(node.value) and not (node.value in NOT_OURS and module == NOT_OURS_MODULE):
                    where[node.value].add(module)
    return where


def test_each_file_name_is_spelled_in_one_module():
    where = spelled_file_names(Path(vitattn.__file__).parent)
    assert {"vocab.json", "config.json", "config.yaml", "last.ckpt", "onnx.json", "classes.txt"} <= set(where)
    twice = {name: sorted(modules) for name, modules in where.items() if len(modules) > 1}
    assert not twice, f"file names spelled in several modules: {twice}"


def test_the_check_sees_a_second_spelling(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text('VOCAB = "vocab.json"\n')
    (package / "b.py").write_text('"""Reads ``vocab.json``."""\nNAME = f"{1}.json"\nPATH = "vocab.json"\n')
    assert spelled_file_names(package) == {"vocab.json": {"pkg/a.py", "pkg/b.py"}}


MODULE_DOCSTRING_LINES = 12


def test_every_module_docstring_is_at_most_12_lines():
    long = {}
    for path in sorted(Path(vitattn.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        first = tree.body[0] if tree.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            if first.end_lineno - first.lineno + 1 > MODULE_DOCSTRING_LINES:
                long[str(path.relative_to(Path(vitattn.__file__).parent))] = first.end_lineno - first.lineno + 1
    assert long == {}


def test_the_house_script_prints_its_usage():
    house = Path(__file__).resolve().parents[1] / "scripts" / "house.py"
    done = subprocess.run([sys.executable, str(house), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: house.py"), done.stderr
    assert "--trace" in done.stdout


def test_the_house_counts_follow_their_rules():
    """``house.py --counts``: each form of its docstring's rules counted once per chain, and nothing else."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("house", Path(__file__).resolve().parents[1] / "scripts" / "house.py")
    house = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(house)
    source = """
def build(plan, cfg: "DictConfig", other):
    a = cfg.head.task == "caption"          # 1 read, 1 task comparison
    b = cfg.trainer.get("devices", 1)       # 1
    c = plan.cfg["seed"]                    # 1
    data = cfg.data                         # 1, and data is a config now
    d = data.img_size if "root" in data else other.x   # 2; other is no config
    e = "contrastive" in cfg.head           # 1 read, 1 contrastive test
    f = kind in ("caption", "classification") or kind == "words"  # 1 task comparison
    from omegaconf import OmegaConf
    import hydra.utils
"""
    reads = [text for _, text in house.config_reads(source)]
    assert sorted(reads) == sorted(
        ["cfg.head.task", "cfg.trainer.get('devices', 1)", "plan.cfg['seed']", "cfg.data", "data.img_size"]
        + ["'root' in data", "cfg.head"]
    )
    assert [t for _, t in house.task_comparisons(source)] == [
        "cfg.head.task == 'caption'",
        "kind in ('caption', 'classification')",
    ]
    assert [t for _, t in house.contrastive_tests(source)] == ["'contrastive' in cfg.head"]
    assert house.config_imports(source) == ["hydra.utils", "omegaconf"]
