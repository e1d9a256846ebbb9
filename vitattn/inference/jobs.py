"""A captioning job as plain values: what ``vitattn-caption`` runs from its command line and the bootstrap's
captioning child from the JSON its training process sends (``CaptionJob.to_json``), through one function,
``run_caption_job``: the model (and a candidate filter) loaded, its decoding settings, image files or shards
captioned by the resumable engine (``caption_files``, ``caption_shards``)."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from vitattn.bundle import LoadedModel, load_model, runtime_of
from vitattn.data.shards import expand_shards
from vitattn.inference.candidates import CandidateFilter, CandidateOptions
from vitattn.inference.captioning import CaptionSummary, Processes, caption_files, caption_shards, launch_processes
from vitattn.inference.file_list import list_inputs

__all__ = ["CaptionJob", "run_caption_job"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptionJob:
    """``model``'s captions of ``images`` (a folder, a file list or a glob, ``image_dir`` its root; ``shards``: the
    pattern of WebDataset shards, ``shards_key`` its name in messages) into ``out`` in ``format``; ``generate``:
    the given decoding settings (None or absent: the model's own); ``samples``: K scored candidates per image
    (``include_greedy``, a filter model ``score`` and ``score_by``); ``devices`` x ``num_nodes`` processes of
    ``accelerator`` on ``device``. ``name``: the model as the candidates' manifest records it (None: ``model``)."""

    model: str
    images: str
    out: str
    shards: bool = False
    shards_key: str = "shards"
    image_dir: str | None = None
    format: str = "jsonl"
    batch_size: int = 32
    num_workers: int = 2
    progress: bool = True
    seed: int | None = None
    precision: str = "auto"
    merge_tokens: Any = None
    generate: dict[str, Any] = field(default_factory=dict)
    samples: int | None = None
    include_greedy: bool = False
    score: str | None = None
    score_by: str = "auto"
    attention_maps: str | None = None
    devices: int = 1
    num_nodes: int = 1
    accelerator: str = "auto"
    device: str = "cpu"
    name: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CaptionJob:
        return cls(**json.loads(text))

    def launch(self) -> Processes:
        """Start (or join) the job's captioning processes (``launch_processes``)."""
        return launch_processes(
            devices=self.devices,
            num_nodes=self.num_nodes,
            accelerator=self.accelerator,
            device=self.device,
            runtime=runtime_of(self.model),
        )


def run_caption_job(job: CaptionJob, processes: Processes | None = None) -> CaptionSummary:
    """Caption as ``job`` says on ``processes`` (None: the job's, launched here and closed after); every rank calls
    it alike and gets the same summary. ``ValueError`` for a model that does not caption."""
    if processes is None:
        processes = job.launch()
        try:
            return run_caption_job(job, processes)
        finally:
            processes.close()
    model = load_model(job.model, device=processes.device, precision=job.precision, merge_tokens=job.merge_tokens)
    if model.task != "caption":
        raise ValueError(f"model={job.name or job.model} is a {model.task} model; captioning needs a caption model")
    options = dict(
        candidates=_candidate_options(job, model, processes),
        processes=processes,
        format=job.format,
        batch_size=job.batch_size,
        num_workers=job.num_workers,
        progress=job.progress,
        seed=job.seed,
        **model.generate_settings(job.generate),
    )
    if job.shards:
        return caption_shards(model, expand_shards(job.images, job.shards_key), job.out, **options)
    inputs = list_inputs(job.images, job.image_dir)
    log.info("captioning %d images with %s on %d process(es)", len(inputs), job.name or job.model, processes.world_size)
    return caption_files(model, inputs, job.out, attention_maps=job.attention_maps, **options)


def _candidate_options(job: CaptionJob, model: LoadedModel, processes: Processes) -> CandidateOptions | None:
    """The job's ``CandidateOptions``, its filter loaded (the captioner itself when ``score`` names it); None without
    ``samples``."""
    if job.samples is None:
        return None
    name = job.name or job.model
    scorer = None
    if job.score is not None:
        same = job.score == name
        bundle = model if same else load_model(job.score, device=processes.device, precision=job.precision)
        scorer = CandidateFilter(bundle, job.score, job.score_by)
    settings = {"precision": model.precision, "merge_tokens": model.merge_tokens}
    return CandidateOptions(job.samples, job.include_greedy, job.seed or 0, scorer, name, settings=settings)
