"""The captioning child: the teacher writes K scored candidates of each pool image in a process of its own,
started through the library's captioning engine (``caption_files`` / ``caption_shards``, what ``vitattn-caption``
runs) with a typed ``CaptionJob``. The child dies with the training process (Linux); the same job resumes it.

    python -m vitattn.training.bootstrap.child '{"teacher": ..., ...}'   (a CaptionJob as JSON)
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import signal
import subprocess
import sys
from dataclasses import dataclass

from vitattn.bundle import load_model, runtime_of
from vitattn.data.shards import expand_shards
from vitattn.errors import ConfigError
from vitattn.inference import caption_files, caption_shards, list_inputs
from vitattn.inference.candidates import CandidateFilter, CandidateOptions
from vitattn.inference.captioning import launch_processes

__all__ = ["CaptionJob", "caption_in_child", "run_job"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptionJob:
    """What the child captions: ``teacher``'s ``samples`` candidates of each image of ``images`` (a folder or file
    list; ``shards``: WebDataset shards) into ``out``, nucleus samples (``do_sample``, ``top_p``) or the beam's
    best (``num_beams``), scored by ``score`` (a caption model; None: unscored), in ``precision`` on ``devices``
    processes of ``accelerator`` (``gpu`` or ``cpu``)."""

    teacher: str
    images: str
    out: str
    shards: bool = False
    samples: int = 5
    seed: int = 0
    do_sample: bool = True
    top_p: float = 0.9
    num_beams: int | None = None
    score: str | None = None
    batch_size: int = 32
    progress: bool = True
    devices: int = 1
    accelerator: str = "cpu"
    precision: str = "fp32"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def caption_in_child(job: CaptionJob) -> None:
    """Run ``job`` in a child process that dies with this one; exit 1 (some pool images unreadable, counted in the
    manifest) is a success."""
    log.info("bootstrap: %s writes %d candidates per pool image: %s", job.teacher, job.samples, job)
    command = [sys.executable, "-m", __name__, job.to_json()]  # -m: Lightning Fabric relaunches it on each GPU
    done = subprocess.run(command, preexec_fn=_die_with_parent, stdout=subprocess.PIPE, text=True)
    if done.returncode not in (0, 1):
        raise ConfigError(f"bootstrap: captioning the pool failed (exit {done.returncode}); see the lines above")


def run_job(job: CaptionJob) -> int:
    """Caption as ``job`` says, in this process (and the others it starts); 0: all captioned, 1: some unreadable."""
    device = "cuda" if job.accelerator == "gpu" else "cpu"
    processes = launch_processes(
        devices=job.devices, accelerator=job.accelerator, device=device, runtime=runtime_of(job.teacher)
    )
    try:
        model = load_model(job.teacher, device=processes.device, precision=job.precision)
        scorer = None
        if job.score is not None:
            same = job.score == job.teacher
            bundle = model if same else load_model(job.score, device=processes.device, precision=job.precision)
            scorer = CandidateFilter(bundle, job.score)
        settings = {"precision": model.precision, "merge_tokens": model.merge_tokens}
        candidates = CandidateOptions(job.samples, False, job.seed, scorer, job.teacher, settings=settings)
        search = {"do_sample": job.do_sample}
        search |= {"top_p": job.top_p} if job.do_sample else {"num_beams": job.num_beams or job.samples}
        options = dict(
            candidates=candidates,
            processes=processes,
            batch_size=job.batch_size,
            num_workers=0,
            progress=job.progress,
            seed=job.seed,
            **model.generate_settings(search),
        )
        if job.shards:
            summary = caption_shards(model, expand_shards(job.images, "bootstrap.images"), job.out, **options)
        else:
            summary = caption_files(model, list_inputs(job.images), job.out, **options)
    finally:
        processes.close()
    return 1 if summary.failed else 0


def _die_with_parent() -> None:
    """In the child: SIGKILL when the training process dies (Linux), so a killed run leaves no captioner running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        pass


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # as vitattn-caption's
    job = CaptionJob(**json.loads(argv[0]))
    try:
        return run_job(job)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"bootstrap: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
