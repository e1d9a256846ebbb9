"""ValidationPictures: every validation writes the attention figures (captioning) or the confusion
matrix (classification) into the run's TensorBoard event file."""

import io

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.training import train

# 64 training images in batches of 8: a validation at steps 8 and 16.
RUN = [*TINY, *TINY_SHAPES, "logger=tensorboard", "trainer.max_steps=16", "test=false", "export_bundle=false"]


def _events(run_dir) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    return events


def _png(event) -> Image.Image:
    image = Image.open(io.BytesIO(event.encoded_image_string))
    assert image.format == "PNG" and image.width > 100 and image.height > 100
    return image


@pytest.mark.slow
def test_caption_validation_logs_attention_figures_of_four_images(tmp_path):
    result = train(compose_train([*RUN, "weights=last"], tmp_path))
    events = _events(tmp_path)
    tags = sorted(t for t in events.Tags()["images"] if t.startswith("val/attention/"))
    assert tags == [f"val/attention/{k}" for k in range(4)]
    for tag in tags:
        logged = events.Images(tag)
        assert [e.step for e in logged] == [8, 16], tag  # every validation, the sanity check left out
        _png(logged[-1])
    # The figures' captions are the ones validation generated for the same images (ids 0-3, first in order).
    (text,) = [t for t in events.Tags()["tensors"] if t.startswith("val/attention/captions")]
    last = events.Tensors(text)[-1]
    assert last.step == 16
    logged_text = last.tensor_proto.string_val[0].decode()
    for k, (caption, references) in enumerate(result.samples[:4]):
        assert f"{k}. **{caption}**  \nreference: {'; '.join(references)}" in logged_text


@pytest.mark.slow
def test_classification_validation_logs_the_confusion_matrix(tmp_path):
    train(compose_train(["head=classification", *RUN], tmp_path))
    logged = _events(tmp_path).Images("val/confusion_matrix")
    assert [e.step for e in logged] == [8, 16]
    _png(logged[-1])


@pytest.mark.slow
def test_pictures_go_to_mlflow_as_artifacts(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow_logger = [
        "+logger.mlflow._target_=lightning.pytorch.loggers.MLFlowLogger",
        f"+logger.mlflow.tracking_uri={uri}",
        f"+logger.mlflow.artifact_location={tmp_path / 'artifacts'}",
        "+logger.mlflow.experiment_name=pictures",
    ]
    train(compose_train([*RUN, *mlflow_logger, "trainer.max_steps=8"], tmp_path / "run"))
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pictures").experiment_id])
    for k in range(4):
        (artifact,) = client.list_artifacts(run.info.run_id, f"val/attention/{k}")
        assert artifact.path == f"val/attention/{k}/step000008.png"
        local = client.download_artifacts(run.info.run_id, artifact.path, str(tmp_path / "down"))
        assert Image.open(local).format == "PNG"
