"""``vitattn-eval``: score a trained model on a split; print a table and write ``metrics.json``.

    vitattn-eval model=PATH [split=val|test] [out=DIR] [batch_size=32] [num_workers=2] [device=auto|cpu|cuda]
        [precision=auto|fp32|bf16] [progress=true] [merge_tokens=R|[R,...]] (ToMe: tokens merged in each encoder layer)
      captions:       [references=COCO_JSON [image_dir=DIR]] [predictions=FILE] [scorer=builtin|coco]
                      [num_beams=N] [max_new_tokens=N] [length_penalty=X] [early_stopping=true|false|never]
                      [min_new_tokens=N] [no_repeat_ngram_size=N] [repetition_penalty=X] [rerank=N]
      classification: [data_root=DIR]
      caption models: task=zero_shot data_root=DIR [labels=a,b,c|FILE] [templates='a photo of a {}.|a {}.'|FILE]
                      [zero_shot_scorer=auto|contrastive|likelihood|both] (contrastive and both: head=coca)
      head=coca also: task=retrieval [references=COCO_JSON [image_dir=DIR]]
Default: the run's split, the model's task. Exit status: 0 all scored, 1 some not, 2 a usage, data or model error."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from vitattn.cli.args import DecodingArgs, UsageError, parse_key_values, resolve_device, run_main
from vitattn.metrics import SCORERS
from vitattn.metrics.toolkit import check_toolkit
from vitattn.run_dir import RunDir

__all__ = ["TASKS", "EvalConfig", "main", "parse_args", "run"]

TASKS = ("caption", "classification", "zero_shot", "retrieval")


@dataclass
class EvalConfig(DecodingArgs):
    """``vitattn-eval`` arguments; decoding ones (``DecodingArgs``) left None take the bundle's defaults."""

    model: str = MISSING
    split: str = "val"
    predictions: str | None = None
    references: str | None = None
    image_dir: str | None = None
    data_root: str | None = None
    batch_size: int = 32
    num_workers: int = 2
    out: str | None = None
    device: str = "auto"
    precision: str = "auto"  # auto, fp32 or bf16 (vitattn.precision)
    merge_tokens: Any = None  # ToMe: an int, or a list of one per encoder layer; None: the model's own
    progress: bool = True
    scorer: str = "builtin"
    task: str | None = None  # caption, classification, zero_shot or retrieval; None: the model's own
    labels: Any = None  # zero_shot: a file of class names, one a line, or names separated by commas
    templates: Any = None  # zero_shot: a file of prompt templates, one a line, or templates separated by |
    zero_shot_scorer: str = "auto"  # zero_shot: auto, contrastive, likelihood or both (``scorer`` is the captions')


def parse_args(argv: list[str]) -> Any:
    """``key=value`` arguments -> a validated ``EvalConfig``."""
    cfg = parse_key_values(argv, EvalConfig, "vitattn-eval")
    if cfg.split not in ("val", "test"):
        raise UsageError(f"split={cfg.split!r} is unknown; choose val or test")
    if cfg.scorer not in SCORERS:
        raise UsageError(f"scorer={cfg.scorer!r} is unknown; choose {' or '.join(SCORERS)}")
    if cfg.task is not None and cfg.task not in TASKS:
        raise UsageError(f"task={cfg.task!r} is unknown; choose {', '.join(TASKS)}")
    named = [k for k in ("labels", "templates") if cfg[k] is not None]
    named += ["zero_shot_scorer"] if cfg.zero_shot_scorer != "auto" else []
    if named and cfg.task != "zero_shot":
        raise UsageError(f"{' and '.join(named)} go with task=zero_shot")
    if cfg.task == "zero_shot":
        if cfg.data_root is None:
            raise UsageError("task=zero_shot needs data_root=DIR (holding <split>/<class>/<image>)")
        # heavy: torch, which the zero-shot names need only as the model runs
        from vitattn.inference.zero_shot import SCORERS as ZERO_SHOT_SCORERS
        from vitattn.inference.zero_shot import templates_from

        if cfg.zero_shot_scorer not in ZERO_SHOT_SCORERS:
            raise UsageError(
                f"zero_shot_scorer={cfg.zero_shot_scorer!r} is unknown; choose {' or '.join(ZERO_SHOT_SCORERS)}"
            )
        try:  # refused before a model loads
            cfg.labels = _labels(cfg.labels)
            cfg.templates = None if cfg.templates is None else templates_from(cfg.templates)
        except (ValueError, FileNotFoundError) as err:
            raise UsageError(str(err)) from None
    return cfg


def _labels(value: str | None) -> list[str] | None:
    """``labels=``: a file of one name a line, else comma-separated names."""
    from vitattn.inference.zero_shot import check_labels, read_lines

    if value is None:
        return None
    names = read_lines(value, "labels") if Path(value).is_file() else value.split(",")
    return check_labels(names)


def run(cfg: Any) -> int:
    """Evaluate as ``cfg`` says; returns the exit status (0 every image scored, 1 some were not)."""
    from vitattn.bundle import load_model
    from vitattn.bundle.hub import is_hub_name
    from vitattn.evaluation import evaluate_captions, evaluate_classification, format_report, write_report
    from vitattn.models.generate import SEARCH_KEYS

    given = [k for k in (*SEARCH_KEYS, "merge_tokens") if cfg[k] is not None]
    if cfg.predictions is not None and given:
        raise UsageError(
            f"{', '.join(given)} set how captions are generated; predictions= scores captions already made"
        )
    if cfg.scorer == "coco":
        check_toolkit()  # pycocoevalcap and Java, before a model loads and captions are made
    # a bundle, run, checkpoint or ONNX folder
    bundle = load_model(
        cfg.model, device=resolve_device(cfg.device), precision=cfg.precision, merge_tokens=cfg.merge_tokens
    )
    run = RunDir.find(cfg.model)
    task = cfg.task or bundle.task
    loading = dict(split=cfg.split, batch_size=cfg.batch_size, num_workers=cfg.num_workers, progress=cfg.progress)
    if task in ("zero_shot", "retrieval"):
        report = _embedding_task(cfg, bundle, run, task, loading)
    elif task != bundle.task:
        raise UsageError(f"task={task} but model={cfg.model} is a {bundle.task} model")
    elif task == "caption":
        if cfg.data_root is not None:
            raise UsageError(
                f"data_root= is for classifiers; model={cfg.model} is a caption model (use references=COCO_JSON)"
            )
        generate = None if cfg.predictions is not None else bundle.generate_settings(cfg)
        report = evaluate_captions(
            bundle,
            references=cfg.references,
            image_dir=cfg.image_dir,
            predictions=cfg.predictions,
            generate=generate,
            scorer=cfg.scorer,
            run_split=_run_split(cfg, bundle, run, cfg.references, image_dir=cfg.image_dir),
            **loading,
        )
    else:
        _refuse(cfg, ("references", "image_dir", "predictions"), f"model={cfg.model} is a {bundle.task} model")
        run_split = _run_split(cfg, bundle, run, cfg.data_root)
        report = evaluate_classification(bundle, data_root=cfg.data_root, run_split=run_split, **loading)
    out = Path(cfg.out) if cfg.out is not None else (run.path if run else Path.cwd()) / f"eval-{cfg.split}"
    files = write_report(report, out, model=cfg.model if is_hub_name(cfg.model) else str(Path(cfg.model).resolve()))
    print(format_report(report))
    print(f"metrics -> {files[0]}", flush=True)
    return 0 if report.complete else 1


def _run_split(cfg: Any, bundle: Any, run: RunDir | None, given: str | None, **moved: Any) -> Any:
    """The run's own split (training rebuilds its data) when the model is in a run and no data is ``given``."""
    if run is None or given is not None:
        return None
    # heavy: the run's own data is its DataModule, rebuilt by Hydra (Lightning); a user's files need neither
    from vitattn.cli.run_split import run_split

    return run_split(bundle, run, cfg.split, batch_size=cfg.batch_size, num_workers=cfg.num_workers, **moved)


def _refuse(cfg: Any, keys: tuple[str, ...], why: str) -> None:
    """A ``UsageError`` when any of ``keys``, a decoding setting or ``scorer`` is given: they apply to captions."""
    from vitattn.models.generate import SEARCH_KEYS

    given = [k for k in (*keys, *SEARCH_KEYS) if cfg[k] is not None]
    given += ["scorer"] if cfg.scorer != "builtin" else []
    if given:
        raise UsageError(f"{', '.join(given)} apply to caption models; {why}")


def _embedding_task(cfg: Any, bundle: Any, run: RunDir | None, task: str, loading: dict[str, Any]) -> Any:
    """The report of ``task=zero_shot`` (a caption model) or ``task=retrieval`` (a ``head=coca`` model)."""
    from vitattn.evaluation import evaluate_retrieval, evaluate_zero_shot
    from vitattn.inference.embeddings import embedding_model

    if task == "zero_shot":
        _refuse(cfg, ("references", "image_dir", "predictions"), "task=zero_shot classifies by name")
        labels = None if cfg.labels is None else list(cfg.labels)
        templates = None if cfg.templates is None else list(cfg.templates)
        return evaluate_zero_shot(
            bundle, data_root=cfg.data_root, labels=labels, templates=templates, scorer=cfg.zero_shot_scorer, **loading
        )
    what = "task=retrieval"
    embedding_model(bundle, what, f"model={cfg.model}")
    _refuse(cfg, ("data_root", "predictions"), f"{what} embeds the split's images and captions")
    run_split = _run_split(cfg, bundle, run, cfg.references, image_dir=cfg.image_dir)
    return evaluate_retrieval(
        bundle, references=cfg.references, image_dir=cfg.image_dir, run_split=run_split, **loading
    )


def main(argv: list[str] | None = None) -> int:
    return run_main(__doc__, argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
