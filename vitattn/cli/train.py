"""``vitattn-train``: Hydra entry point around ``vitattn.training.train``.

``resume=RUN_DIR`` (or ``resume=auto hydra.run.dir=DIR``) continues a run in place; a complete run is left as it is;
a preempted run exits 75 (``EX_TEMPFAIL``: run it again) (docs/scaling.md). Returns ``optimized_metric`` for sweeps.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from vitattn.cli.errors import quiet_upstream, report_user_error, user_errors
from vitattn.errors import Preempted
from vitattn.run_dir import RunDir

if TYPE_CHECKING:
    from vitattn.training import TrainResult


def _resume_argv(argv: list[str]) -> list[str]:
    """Expand ``resume=RUN_DIR`` into the run's saved overrides plus ``hydra.run.dir=RUN_DIR``."""
    resume = next((a.split("=", 1)[1] for a in argv if a.startswith("resume=")), None)
    if not resume or any(a.startswith("hydra.run.dir=") for a in argv):
        return argv  # not resuming, or already expanded (DDP child processes), or resume=auto in hydra.run.dir
    if resume == "auto":
        sys.exit(report_user_error(ValueError("resume=auto continues the run in hydra.run.dir: add hydra.run.dir=DIR")))
    previous = RunDir(resume).saved_overrides()
    keys = {a.split("=", 1)[0].lstrip("+~") for a in argv}
    replay = [o for o in previous if o.split("=", 1)[0].lstrip("+~") not in keys]
    return replay + argv + [f"hydra.run.dir={resume}"]


def optimized_value(metrics: dict[str, float], name: str | None) -> float | None:
    """The value of ``optimized_metric`` among a run's final metrics (``None``: ``val/loss`` if logged); a
    ``ValueError`` when ``name`` was chosen but the run did not log it."""
    if name is None:
        return metrics.get("val/loss")
    if name not in metrics:
        logged = ", ".join(sorted(metrics)) or "none"
        raise ValueError(f"optimized_metric={name} was not logged by this run; choose one of: {logged}")
    return metrics[name]


@hydra.main(version_base="1.3", config_path="pkg://vitattn.conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    from lightning.pytorch.utilities import rank_zero_only

    from vitattn.training import train

    quiet_upstream()  # after Hydra has configured logging
    with user_errors(cfg.get("debug", False)):
        try:
            result = train(cfg, overrides=list(HydraConfig.get().overrides.task))
        except Preempted as stop:
            if rank_zero_only.rank == 0:
                again = f"; continue with resume={stop.checkpoint.parents[1]}" if stop.checkpoint else ""
                print(f"{stop}{again}", file=sys.stderr, flush=True)
            sys.exit(os.EX_TEMPFAIL)  # 75: stopped with a checkpoint; start it again to continue
        if rank_zero_only.rank == 0 and not result.already_complete:  # else train() said so in one line
            _report(result)
        return optimized_value(result.metrics, cfg.get("optimized_metric"))


def _report(result: TrainResult) -> None:
    lines = [f"run directory: {result.run_dir}"]
    if result.bundle_dir:
        lines.append(f"model bundle:  {result.bundle_dir}")
    lines.append(f"weights:       {result.weights}")
    lines.append(f"speed:         {result.steps_per_second:.2f} steps/s (training with its validations)")
    lines += [f"  {key:<22} {value:.4f}" for key, value in sorted(result.metrics.items())]
    if result.skipped_images:
        lines.append(f"skipped images ({len(result.skipped_images)} files could not be read; data.bad_images=skip):")
        lines += [f"  {path}: {reason}" for path, reason in result.skipped_images.items()]
    if result.samples:
        lines.append("validation captions (generated | reference):")
        lines += [f"  {caption!r:<60} | {refs[0]!r}" for caption, refs in result.samples]
    print("\n".join(lines), flush=True)


def _completion(argv: list[str]) -> str | None:
    """``RunDir.completion`` of the run ``argv`` resumes, asked before Hydra writes into its folder (its ``.hydra/``
    files and log); None for a multirun and a folder Hydra interpolates (``train()`` asks once it is composed)."""
    if {"-m", "--multirun"} & set(argv):
        return None
    values = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith(("+", "~", "-")))
    run_dir = values.get("hydra.run.dir")
    if not run_dir or "${" in run_dir:
        return None
    ckpt_path = values.get("ckpt_path", "null")
    length = {key.split(".", 1)[1]: values[key] for key in ("trainer.max_steps", "trainer.max_epochs") if key in values}
    return RunDir(run_dir).completion(values.get("resume"), None if ckpt_path == "null" else ckpt_path, length)


def main() -> None:
    sys.argv = [sys.argv[0], *_resume_argv(sys.argv[1:])]
    try:
        complete = _completion(sys.argv[1:])
    except ValueError as err:  # ConfigError included
        sys.exit(report_user_error(err))
    if complete is not None:  # nothing to train, and nothing in the run folder rewritten
        print(complete, flush=True)
        return
    _hydra_main()


if __name__ == "__main__":
    main()
