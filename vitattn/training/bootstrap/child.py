"""The captioning child: the teacher writes K scored candidates of each pool image in a process of its own, a
library ``CaptionJob`` (what ``vitattn-caption`` runs too) sent to it as JSON and run by ``run_caption_job``. The
child dies with the training process (Linux); the same job resumes it.

    python -m vitattn.training.bootstrap.child '{"model": ..., ...}'   (a CaptionJob as JSON)
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys

from vitattn.errors import ConfigError
from vitattn.inference.jobs import CaptionJob, run_caption_job

__all__ = ["caption_in_child"]

log = logging.getLogger(__name__)


def caption_in_child(job: CaptionJob) -> None:
    """Run ``job`` in a child process that dies with this one; exit 1 (some pool images unreadable, counted in the
    manifest) is a success."""
    log.info("bootstrap: %s writes %d candidates per pool image: %s", job.model, job.samples, job)
    command = [sys.executable, "-m", __name__, job.to_json()]  # -m: Lightning Fabric relaunches it on each GPU
    done = subprocess.run(command, preexec_fn=_die_with_parent, stdout=subprocess.PIPE, text=True)
    if done.returncode not in (0, 1):
        raise ConfigError(f"bootstrap: captioning the pool failed (exit {done.returncode}); see the lines above")


def _die_with_parent() -> None:
    """In the child: SIGKILL when the training process dies (Linux), so a killed run leaves no captioner running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        pass


def main(argv: list[str]) -> int:
    """The child: 0 all captioned, 1 some unreadable, 2 an error (said in one line)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # as vitattn-caption's
    try:
        summary = run_caption_job(CaptionJob.from_json(argv[0]))
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"bootstrap: {err}", file=sys.stderr, flush=True)
        return 2
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
