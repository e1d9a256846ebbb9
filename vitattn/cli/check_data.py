"""``vitattn-check-data``: read every image of a training config's data once, in parallel; list the bad ones.

Usage: ``vitattn-check-data data=imagefolder data.root=DIR [threads=N]`` (the arguments are vitattn-train's,
plus ``threads``: reading threads, default the cores, at most 16). Prints ``PATH: REASON`` on stdout for each
file that cannot be read, and a summary on stderr. Exit status: 0 when every image reads, 1 when some do not,
2 on a usage or data error. ``vitattn-train ... data.verify=true`` does the same check before it trains.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig

from vitattn.cli.args import UsageError, run_main
from vitattn.errors import first_line

__all__ = ["main", "parse_args", "run"]

log = logging.getLogger("vitattn")


def parse_args(argv: list[str]) -> tuple[DictConfig, int]:
    """Hydra overrides (and ``threads=N``) -> the composed training config and the number of threads."""
    from vitattn.training.config import compose_train

    threads = 0
    overrides = []
    for arg in argv:
        if arg.startswith("threads="):
            value = arg.partition("=")[2]
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"threads={value!r} must be a whole number of at least 1")
            threads = int(value)
        else:
            overrides.append(arg)
    try:
        cfg = compose_train(overrides)
    except HydraException as err:  # an unknown override, a group option that does not exist
        raise UsageError(first_line(err, limit=1000)) from None
    return cfg, threads


def run(args: tuple[DictConfig, int]) -> int:
    """Check the images of the composed config's data; returns the exit status (1 when some are bad)."""
    from vitattn.cli.run_split import read_once
    from vitattn.data.bad_images import find_bad_images
    from vitattn.run_dir import check_targets
    from vitattn.training.build import setup_data
    from vitattn.training.config import check_data_paths, data_name

    cfg, threads = args
    check_targets(cfg.data)
    check_data_paths(cfg.data)
    datamodule: Any = hydra.utils.instantiate(cfg.data, **read_once(cfg.data))  # this reads each file once itself
    if not getattr(datamodule, "reads_files", False):
        raise UsageError(
            f"data={data_name(cfg.data)} has no image files to check; give data=imagefolder, data=coco or data=karpathy"
        )
    setup_data(cfg, datamodule)
    paths = datamodule.image_files()
    started = time.monotonic()
    bad = find_bad_images(paths, threads)
    seconds = time.monotonic() - started
    for path, reason in bad.items():
        print(f"{path}: {reason}", flush=True)
    total = len(set(paths))
    rate = total / seconds if seconds > 0 else 0.0
    log.info("%d of %d images cannot be read (%.1f s, %.0f images/s)", len(bad), total, seconds, rate)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    return run_main(__doc__, argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
