import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from omegaconf import OmegaConf

import vitattn.training.recipe
from tests.helpers.datasets import make_coco, make_karpathy
from tests.helpers.images import make_image_folder
from tests.helpers.runs import CONF_DIR, TINY, TINY_SHAPES, compose_train, metrics_with_weights
from vitattn.bundle import load_bundle
from vitattn.data.shapes import CLASS_NAMES
from vitattn.data.shards.writer import shapes_samples, write_shards
from vitattn.models import VisionTransformer
from vitattn.training import build_system, train
from vitattn.training.build import build_datamodule, instantiate_group
from vitattn.training.callbacks import EMA, FreezeEncoder, Preemption, TimeBudgetHorizon
from vitattn.training.config import check_config
from vitattn.training.plan import resolve

GROUPS = {
    g: sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml"))
    for g in ("head", "model", "finetune", "data", "trainer", "logger", "callbacks", "experiment")
}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    folder = make_image_folder(root / "folder")
    coco = make_coco(root / "coco")
    karpathy = make_karpathy(root / "karpathy")
    shards = write_shards(shapes_samples("train", 12, img_size=32), root / "shards", 6, class_names=CLASS_NAMES)
    return {
        "imagefolder": [f"data.root={folder}"],
        "coco": [f"data.{k}={v}" for k, v in coco.items()],
        "karpathy": [f"data.{k}={v}" for k, v in karpathy.items()],
        "webdataset": [f"data.train_shards={shards[0].parent}", f"data.val_shards={shards[0]}", "data.num_workers=0"],
    }


def _data_overrides(name, datasets):
    head = "head=caption" if name in ("coco", "karpathy", "shapes") else "head=classification"
    return [head, f"data={name}", *datasets.get(name, [])]


# An MLflow logger opens (and creates) its SQLite store when it is built: seconds.
SLOW_CONFIGS = {("logger", "mlflow"), ("logger", "many")}


@pytest.mark.parametrize(
    "group,option",
    [
        pytest.param(g, o, marks=[pytest.mark.slow] if (g, o) in SLOW_CONFIGS else [])
        for g, opts in GROUPS.items()
        for o in opts
    ],
)
def test_every_config_composes_and_instantiates(group, option, datasets, tmp_path):
    overrides = [f"{group}={option}", f"paths.runs_dir={tmp_path}"]  # a tracker's store goes under runs_dir
    if group == "data":
        overrides = _data_overrides(option, datasets)
    if group == "experiment" and ("karpathy" in option or "flickr" in option):
        overrides += datasets["karpathy"]
    elif group == "experiment" and "coco" in option:
        overrides += datasets["coco"]
    cfg = compose_train(overrides, tmp_path)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    if group == "model":
        model = VisionTransformer(**OmegaConf.to_container(cfg.model))  # the group holds its arguments only
        assert isinstance(model, VisionTransformer) and model.embed_dim == cfg.model.embed_dim
    elif group == "data":
        dm = hydra.utils.instantiate(cfg.data)
        dm.setup("fit")
        assert dm.img_size == cfg.data.img_size
    elif group == "trainer":
        trainer_cfg = OmegaConf.merge(
            cfg.trainer, {"accelerator": "cpu", "precision": "32-true", "devices": 1, "strategy": "auto"}
        )
        assert isinstance(hydra.utils.instantiate(trainer_cfg, logger=False), Trainer)
        if option in ("gpu", "ddp"):  # bf16-mixed or 16-mixed by the GPU's compute capability (tests/test_precision.py)
            assert cfg.trainer.precision == "auto"
        if option == "ddp":
            assert cfg.trainer.strategy == "ddp"
    elif group == "logger":
        objects = instantiate_group(cfg.logger)
        assert all(type(o).__module__ == "vitattn.training.loggers" for o in objects)  # Lightning's, resumable
        assert (len(objects) > 0) == (option != "none")
    elif group == "callbacks":
        objects = instantiate_group(cfg.callbacks)
        assert all(type(o).__module__.startswith(("lightning", "vitattn.training.callbacks")) for o in objects)
        assert any(isinstance(o, Preemption) for o in objects)  # switched on by its key, in every option
        assert any(isinstance(o, ModelCheckpoint) for o in objects) == (option == "default")
    elif group == "head":
        assert cfg.head.task == ("caption" if option == "coca" else option)  # coca: a captioner that also embeds
    elif group == "experiment":
        assert cfg.head.task in ("caption", "classification")


def test_a_group_entry_is_left_out_while_its_enabled_is_off():
    group = OmegaConf.create(
        {
            name: {"_target_": "lightning.pytorch.callbacks.LearningRateMonitor", "enabled": enabled}
            for name, enabled in {"false": False, "null": None, "zero": 0, "true": True, "set": 0.999}.items()
        }
        | {"unswitched": {"_target_": "lightning.pytorch.callbacks.LearningRateMonitor"}, "off": None}
    )
    assert [type(o).__name__ for o in instantiate_group(group)] == ["LearningRateMonitor"] * 3


@pytest.mark.parametrize("callbacks", ["default", "none"])
def test_the_run_keys_switch_their_callbacks_in_every_callbacks_option(callbacks, tmp_path):
    switches = ["ema.decay=0.99", "early_stopping.patience=3", "finetune.freeze_encoder_epochs=2"]
    built = {
        on: {type(o): o for o in instantiate_group(compose_train([f"callbacks={callbacks}", *on], tmp_path).callbacks)}
        for on in ((), tuple(switches))
    }
    switched = (EMA, EarlyStopping, FreezeEncoder)
    assert not any(kind in built[()] for kind in switched)  # off by default
    ema, stop, freeze = (built[tuple(switches)][kind] for kind in switched)
    assert (ema.decay, stop.patience, stop.monitor, freeze.unfreeze_at_epoch) == (0.99, 3, "val/cider_d", 2)
    assert Preemption in built[()] and TimeBudgetHorizon in built[()]


def test_derived_values_are_interpolated_not_repeated(tmp_path):
    cfg = compose_train(["data.img_size=48", "data.max_caption_len=30", "model=tiny"], tmp_path)
    assert cfg.model.img_size == 48 and cfg.head.decoder.max_len == 30
    assert cfg.head.decoder.embed_dim == cfg.model.embed_dim == 192


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], (False, False)),
        (["model.grad_checkpointing=true"], (True, True)),
        (["model.grad_checkpointing=true", "head.decoder.grad_checkpointing=false"], (True, False)),
        (["head=classification", "model.grad_checkpointing=true"], (True, None)),
    ],
)
def test_model_grad_checkpointing_switches_the_encoder_and_the_decoder(overrides, expected, tmp_path):
    plan = resolve(compose_train([*TINY, *TINY_SHAPES, *overrides], tmp_path))
    cfg = plan.cfg
    datamodule = build_datamodule(plan)
    datamodule.setup("fit")
    model = build_system(plan, datamodule).model
    if cfg.head.task == "caption":
        assert (model.encoder.grad_checkpointing, model.decoder.grad_checkpointing) == expected
    else:
        assert (model.grad_checkpointing, None) == expected


def test_a_run_with_grad_checkpointing_trains_and_exports_a_bundle_that_loads(tmp_path):
    cfg = compose_train([*TINY, *TINY_SHAPES, "model.grad_checkpointing=true", "trainer.fast_dev_run=true"], tmp_path)
    result = train(cfg)
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.metrics["val/loss"]))
    bundle = load_bundle(result.bundle_dir)
    assert bundle.config["model"]["encoder"]["grad_checkpointing"] is True and not bundle.model.training
    assert bundle.model.generate(torch.randn(2, 3, 32, 32)).shape[0] == 2


@pytest.mark.parametrize("name", ["shapes-caption", "shapes-classification", "imagefolder", "coco"])
def test_fast_dev_run_through_train(name, datasets, tmp_path):
    data = name.split("-")[0]
    overrides = _data_overrides(data, datasets)
    if name == "shapes-classification":
        overrides[0] = "head=classification"
    if data == "shapes":
        overrides += TINY_SHAPES
    else:
        overrides += ["data.num_workers=0"]
    if data == "coco":
        overrides += ["data.min_word_freq=1"]
    if "head=caption" in overrides:
        overrides += ["head.decoder.depth=1"]
    cfg = compose_train([*overrides, *TINY, "trainer.fast_dev_run=true"], tmp_path)
    result = train(cfg)
    assert result.global_step == 1
    assert "val/loss" in result.metrics and torch.isfinite(torch.tensor(result.metrics["val/loss"]))
    assert (tmp_path / "config.yaml").is_file()
    if cfg.head.task == "caption":
        assert (tmp_path / "vocab.json").is_file() and "val/bleu4" in result.metrics
    else:
        assert "val/acc" in result.metrics


# Train on the first batch only, with a high learning rate and nothing else in the way.
OVERFIT = [
    *TINY,
    *TINY_SHAPES,
    "trainer.overfit_batches=1",
    "trainer.max_epochs=-1",
    "optim.lr=3e-3",
    "optim.warmup_steps=5",
    "optim.weight_decay=0",
    "callbacks=none",
    "test=false",
    "export_bundle=false",
    "trainer.check_val_every_n_epoch=1000",
]


@pytest.mark.slow
def test_overfit_one_batch_classifier(tmp_path):
    cfg = compose_train(["head=classification", *OVERFIT, "trainer.max_steps=120", "head.label_smoothing=0"], tmp_path)
    result = train(cfg)
    assert result.global_step == 120
    from vitattn.training.datamodules import ShapesDataModule

    dm = ShapesDataModule(task="classification", img_size=32, num_train=64, num_val=16, num_test=16, batch_size=8)
    dm.setup("fit")
    images, labels = next(iter(torch.utils.data.DataLoader(dm.train_dataset, batch_size=8)))
    system = result.system.eval()
    assert (system.model(dm.normalize(images)).argmax(-1) == labels).all()  # the loaders' uint8, normalised


@pytest.mark.slow
def test_overfit_one_batch_captioner(tmp_path):
    cfg = compose_train(["head=caption", *OVERFIT, "trainer.max_steps=250", "head.decoder.drop_rate=0"], tmp_path)
    result = train(cfg)
    from vitattn.data.tokenizer import collate_captions
    from vitattn.training.datamodules import ShapesDataModule

    dm = ShapesDataModule(task="caption", img_size=32, num_train=64, num_val=16, num_test=16, batch_size=8)
    dm.setup("fit")
    batch = dm.ready_batch(collate_captions([dm.train_dataset[i] for i in range(8)]))  # images normalised
    system = result.system.eval()
    captions = system.vocab.decode_batch(system.model.generate(batch["images"]))
    targets = [system.vocab.decode(t) for t in batch["tokens"]]
    assert captions == targets


def _steps_logged(run_dir: Path) -> list[int]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return sorted({int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")})


# A classifier run that logs and checkpoints every few steps; max_steps is added per run.
CONTINUED = [
    "head=classification",
    *TINY,
    *TINY_SHAPES,
    "trainer.max_epochs=-1",
    "trainer.log_every_n_steps=1",
    "callbacks.step_checkpoint.every_n_train_steps=2",
    "test=false",
    "export_bundle=false",
    "optim.warmup_steps=100",
    "trainer.check_val_every_n_epoch=1000",
]


def test_resume_continues_step_optimizer_and_schedule(tmp_path):
    common = CONTINUED
    first = tmp_path / "first"
    train(compose_train([*common, "trainer.max_steps=4"], first))
    ckpt = torch.load(first / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4
    second = tmp_path / "second"
    result = train(compose_train([*common, "trainer.max_steps=8", f"resume={first}"], second))
    assert result.global_step == 8
    assert _steps_logged(second) == [4, 5, 6, 7]  # continues, nothing repeated
    final = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)
    adam_steps = {int(s["step"]) for s in final["optimizer_states"][0]["state"].values()}
    assert adam_steps == {8}  # optimizer moments restored, not restarted
    assert final["lr_schedulers"][0]["last_epoch"] == 8


def test_ckpt_path_continues_the_saved_step_in_a_new_run_directory(tmp_path):
    first = tmp_path / "first"
    train(compose_train([*CONTINUED, "trainer.max_steps=4"], first))
    ckpt = first / "checkpoints" / "last.ckpt"
    saved = ckpt.read_bytes()
    assert torch.load(ckpt, weights_only=True)["global_step"] == 4
    second = tmp_path / "second"
    cfg = compose_train([*CONTINUED, "trainer.max_steps=10", f"ckpt_path={ckpt}"], second)
    result = train(cfg)
    assert result.run_dir == second and result.global_step == 10  # ends at the new trainer.max_steps
    assert _steps_logged(second) == [4, 5, 6, 7, 8, 9]  # starts at the saved global step
    final = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)
    assert final["global_step"] == 10 and final["lr_schedulers"][0]["last_epoch"] == 10
    assert {int(s["step"]) for s in final["optimizer_states"][0]["state"].values()} == {10}
    assert (second / "config.yaml").is_file() and str(ckpt) in (second / "config.yaml").read_text()
    assert ckpt.read_bytes() == saved and _steps_logged(first) == [0, 1, 2, 3]  # the first run is left as it was


# Two CPU processes (gloo), three steps of the tiny captioner on the shapes.
DDP_CPU = [
    "trainer=ddp",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "trainer.max_steps=3",
    "trainer.benchmark=false",
    *TINY,
    *TINY_SHAPES,
]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """One two-process run through ``vitattn-train``'s ``main`` started as a module, as ``python -m vitattn.cli.train``
    is (tests/helpers/ddp_train.py: the same ``main``, recording each rank's bundle export), of a captioner on an
    encoder that normalises after pooling (timm's avg pool: ``fc_norm``, not ``norm``, follows the layers; DDP's
    reducer fails the second step on a parameter without a gradient), logging to TensorBoard, exporting its bundle.
    Its output, run directory and export record."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    runs, exports = tmp_path / "runs", tmp_path / "exports.log"
    overrides = ["model.global_pool=avg", "model.norm_pre=true", "logger=tensorboard", f"paths.runs_dir={runs}"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
        "VITATTN_EXPORT_LOG": str(exports),
    }
    launch = [sys.executable, "-m", "tests.helpers.ddp_train"]
    proc = subprocess.run(
        [*launch, *DDP_CPU, *overrides, "test=false"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = [p for p in (runs / "caption").iterdir() if p.is_dir()]
    return proc, run_dirs, exports


@pytest.mark.slow
def test_ddp_two_processes_through_the_cli(ddp_run):
    proc, run_dirs, _ = ddp_run
    assert len(run_dirs) == 1, run_dirs  # one run directory, not one per process
    run = run_dirs[0]
    writers = {p.name.split(".")[-2] for p in (run / "tensorboard").glob("events.out.tfevents.*")}
    assert len(writers) == 1, writers  # one process (rank 0) logs; its pid is in each event file's name
    assert proc.stdout.count("run directory:") == 1
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3


@pytest.mark.slow
def test_ddp_trains_a_captioner_on_an_encoder_that_normalises_after_pooling(ddp_run):
    _, (run,), _ = ddp_run
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3 and "model.encoder.fc_norm.weight" in ckpt["state_dict"]
    assert "model.encoder.norm.weight" not in ckpt["state_dict"]  # the pooled tokens' norm is fc_norm


@pytest.mark.slow
def test_ddp_training_exports_one_bundle_from_rank_zero_only(ddp_run):
    proc, (run,), exports = ddp_run
    assert exports.read_text().splitlines() == [f"0 {run / 'bundle'}"]  # written once, by rank 0
    assert proc.stdout.count("model bundle:") == 1
    assert sorted(p.name for p in run.iterdir() if "bundle" in p.name) == ["bundle"]  # no temporary bundle folders
    assert sorted(os.listdir(run / "bundle")) == ["config.json", "model.safetensors", "vocab.json"]
    bundle = load_bundle(run / "bundle")
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert bundle.task == "caption" and ckpt["global_step"] == 3
    assert isinstance(
        bundle.model.encoder.fc_norm, torch.nn.LayerNorm
    )  # the bundle rebuilds the encoder that pools, then normalises
    for key, value in bundle.model.state_dict().items():  # the trained weights, as rank 0 held them
        assert torch.equal(value, ckpt["state_dict"][f"model.{key}"]), key


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ([], False),  # CPU trainer: eager
        (["trainer=gpu"], True),  # GPU trainer: compiled
        (["trainer=gpu", "compile=false"], False),
        (["compile=true"], True),
    ],
)
def test_compile_auto_follows_the_accelerator(overrides, expected, tmp_path):
    from vitattn.training.build import should_compile
    from vitattn.training.plan import resolve

    assert should_compile(resolve(compose_train(overrides, tmp_path))) is expected


@pytest.mark.slow
def test_compiled_training_keeps_parameter_names(tmp_path, monkeypatch):
    """``compile=true`` compiles the model in place: its checkpoint and bundle keep the eager parameter names. The
    ``aot_eager`` backend traces the model through dynamo and AOTAutograd as inductor's does, without inductor's
    C++ code generation (70 s of this test on a CPU), which is not what is tested here."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager", **kw))
    cfg = compose_train(
        [
            "head=classification",
            *TINY,
            *TINY_SHAPES,
            "compile=true",
            "trainer.max_steps=2",
            "test=false",
            "trainer.check_val_every_n_epoch=1000",
        ],
        tmp_path,
    )
    result = train(cfg)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert not any("_orig_mod" in k for k in ckpt["state_dict"])
    from vitattn.bundle import load_bundle

    bundle = load_bundle(result.bundle_dir)
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(bundle.model(images), result.system.model.eval()(images), atol=1e-4, rtol=1e-4)


def test_num_threads_sets_torch_threads(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    cfg = compose_train(
        ["head=classification", *TINY, *TINY_SHAPES, "num_threads=1", "trainer.fast_dev_run=true"], tmp_path
    )
    train(cfg)
    assert seen == [1]


def _model_weights(checkpoint: dict) -> dict[str, torch.Tensor]:
    return {k[len("model.") :]: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}


def test_the_best_checkpoint_is_tested_and_exported(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from vitattn.cli.export import main as export_main
    from vitattn.training.systems import ClassificationSystem

    def ruin_after_step_12(self, outputs, batch, batch_idx):
        if self.global_step > 12:  # noise over every weight: each later validation is worse than the best
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(torch.randn_like(p))

    monkeypatch.setattr(ClassificationSystem, "on_train_batch_end", ruin_after_step_12)
    overrides = ["head=classification", *TINY, *TINY_SHAPES, "trainer.max_steps=24", "trainer.max_epochs=-1"]
    overrides += ["trainer.val_check_interval=4", "trainer.check_val_every_n_epoch=null", "optim.lr=5e-3"]
    result = train(compose_train(overrides, tmp_path / "run"))
    run = tmp_path / "run"
    best = torch.load(run / "checkpoints" / "best.ckpt", weights_only=True)
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert best["global_step"] <= 12 < last["global_step"] == 24  # best is not last
    assert result.weights.startswith("best (val/acc ") and result.weights.endswith(f"at step {best['global_step']})")
    weights = {which: _model_weights(c) for which, c in (("best", best), ("last", last))}
    bundle = load_file(run / "bundle" / "model.safetensors")
    assert bundle.keys() == weights["best"].keys()
    assert all(torch.equal(bundle[k], weights["best"][k]) for k in bundle)
    datamodule = result.system.trainer.datamodule
    tested = {k: metrics_with_weights(result.system, w, datamodule, "test")["test/loss"] for k, w in weights.items()}
    assert result.metrics["test/loss"] == pytest.approx(tested["best"], rel=1e-5)
    assert result.metrics["test/loss"] != pytest.approx(tested["last"], rel=1e-2)
    for which, checkpoint in (("best", best), ("last", last)):
        out = tmp_path / which
        assert export_main([f"model={run}", f"which={which}", f"out={out}"]) == 0
        exported = load_file(out / "model.safetensors")
        assert all(torch.equal(exported[k], checkpoint["state_dict"][f"model.{k}"]) for k in exported)
    assert export_main([f"model={run}", "which=worst", f"out={tmp_path / 'x'}"]) == 2


def test_the_self_critical_recipe_is_the_first_stages_second_stage(datasets, tmp_path):
    from vitattn.errors import ConfigError

    given = [*datasets["karpathy"], "trainer.devices=1"]
    cfg = compose_train(["experiment=coco_karpathy_vit_b16_scst", *given], tmp_path)
    with pytest.raises(ConfigError, match=r"^finetune=scst needs finetune.init=RUN_OR_BUNDLE"):
        check_config(cfg)  # the first stage's model is what it starts from
    first = compose_train(["experiment=coco_karpathy_vit_b16", *given], tmp_path)
    cfg = compose_train(["experiment=coco_karpathy_vit_b16_scst", f"finetune.init={tmp_path}", *given], tmp_path)
    check_config(cfg)
    assert cfg.finetune.scst.samples == 5 and cfg.finetune.scst.baseline == "mean" and cfg.finetune.init_kind == "model"
    assert cfg.data == first.data and cfg.optim.lr < first.optim.lr


@pytest.mark.parametrize("recipe", ["coco_karpathy_vit_b16", "flickr8k_vit_s16"])
def test_captioning_recipes_pass_validation(recipe, datasets, tmp_path):
    from vitattn.training.start_weights import source_kind

    cfg = compose_train([f"experiment={recipe}", *datasets["karpathy"], "trainer.devices=1"], tmp_path)
    check_config(cfg)
    assert source_kind(cfg.finetune.init)[0] == "timm-name"  # no network: checked against timm's registry only
    assert cfg.finetune.init.startswith("vit_") and cfg.finetune.init_kind == "encoder"
    assert cfg.head.generate.num_beams == 3
    assert cfg.data._target_ == "vitattn.training.datamodules.KarpathyDataModule" and cfg.optim.layer_decay == 0.75


class _ProfileStep(Callback):
    """``torch.profiler`` over one whole training step, from its batch's start to the next batch's."""

    def __init__(self, step: int) -> None:
        self.step, self.profiler, self.events = step, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.profiler is None:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        elif self.profiler is not None and self.events is None:
            self.profiler.__exit__(None, None, None)
            self.events = self.profiler.events()


def _within(event, prefix: str) -> bool:
    """Whether ``event`` runs inside a profiled range whose name starts with ``prefix``."""
    while event is not None and not event.name.startswith(prefix):
        event = event.cpu_parent
    return event is not None


# EMA on, nonfinite=raise, logging every 50 steps: step 3 logs nothing.
QUIET_STEP = ["ema.decay=0.99", "head.nonfinite=raise", "trainer.log_every_n_steps=50", "trainer.max_steps=5"]
QUIET_STEP += ["trainer.max_epochs=-1", "test=false", "export_bundle=false"]


@pytest.mark.parametrize("head", ["caption", "classification"])
def test_a_training_step_that_logs_nothing_reads_nothing_back_from_the_device(head, tmp_path, monkeypatch):
    profile = _ProfileStep(step=3)
    build = vitattn.training.build.instantiate_group

    def with_profile(group, *extra):  # the callbacks group, not the loggers' (which comes with their arguments)
        return [*build(group, *extra), *([] if extra else [profile])]

    monkeypatch.setattr(vitattn.training.build, "instantiate_group", with_profile)
    run = [f"head={head}", *TINY, *TINY_SHAPES, *QUIET_STEP]
    train(compose_train(run, tmp_path))
    reads = [event for event in profile.events if event.name in ("aten::item", "aten::_local_scalar_dense")]
    # AdamW (neither fused nor capturable) keeps its step counts on the host, on a GPU too: reading them is no sync.
    assert [event.name for event in reads if not _within(event, "Optimizer.step#")] == []
    names = {event.name for event in profile.events}
    assert {"Optimizer.step#AdamW.step", "aten::_foreach_lerp_"} <= names  # the whole step: the EMA's update too


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_true_precision_is_refused_in_one_line_and_bf16_mixed_trains(precision, tmp_path):
    from vitattn.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        train(compose_train([*TINY, *TINY_SHAPES, f"trainer.precision={precision}"], tmp_path / "refused"))
    assert str(err.value).startswith(f"trainer.precision={precision} keeps the weights") and "\n" not in str(err.value)
    assert "use trainer.precision=bf16-mixed" in str(err.value)
    result = train(
        compose_train([*TINY, *TINY_SHAPES, "trainer.precision=bf16-mixed", "trainer.max_steps=2"], tmp_path / "run")
    )
    assert result.global_step == 2 and math.isfinite(result.metrics["test/loss"])
