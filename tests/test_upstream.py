"""vitattn/upstream.py against the installed Lightning, LitServe and timm: each adapter does what vitattn relies on,
and one whose private attribute is gone says which library version broke it."""

import inspect
import threading
from importlib.metadata import version
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitattn.upstream import UpstreamChanged, request_sigterm_stop, set_litserve_shutdown, timm_url_cached


def _trainer(**kwargs) -> pl.Trainer:
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(accelerator="cpu", devices=1, **quiet, **kwargs)


def test_request_sigterm_stop_sets_the_flag_lightning_reads():
    trainer = _trainer()
    request_sigterm_stop(trainer, True)
    assert trainer.received_sigterm is True
    request_sigterm_stop(trainer, False)
    assert trainer.received_sigterm is False


class _StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            request_sigterm_stop(trainer, True)


def test_request_sigterm_stop_ends_training_after_the_step_under_way():
    trainer = _trainer(max_steps=10, callbacks=[_StopAt(3)])
    with pytest.raises((SIGTERMException, SystemExit)):
        trainer.fit(BoringModel())
    assert trainer.global_step == 3, f"lightning {version('lightning')} no longer stops on the SIGTERM flag"


def test_request_sigterm_stop_names_the_lightning_version_when_the_attribute_is_gone():
    with pytest.raises(UpstreamChanged) as err:
        request_sigterm_stop(SimpleNamespace(), True)
    assert str(err.value) == (
        f"lightning {version('lightning')} has no Trainer._signal_connector.received_sigterm; "
        "vitattn/upstream.py needs an update for this version"
    )


def test_timm_url_cached_finds_a_file_where_timms_loader_looks(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    url = "https://example.invalid/weights/vit_tiny_test.pth"
    assert not timm_url_cached(url)
    checkpoints = tmp_path / "hub" / "checkpoints"  # torch.hub.get_dir()/checkpoints (timm makes the folder)
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / "vit_tiny_test.pth").write_bytes(b"weights")
    assert timm_url_cached(url), f"timm {version('timm')} looks for cached URL weights elsewhere"


def test_timm_url_cached_names_the_timm_version_when_the_function_is_gone(monkeypatch):
    from timm.models import _hub

    monkeypatch.delattr(_hub, "check_cached_file")
    with pytest.raises(
        UpstreamChanged, match=rf"^timm {version('timm')} has no timm\.models\._hub\.check_cached_file;"
    ):
        timm_url_cached("https://example.invalid/w.pth")


def test_set_litserve_shutdown_sets_the_event_litservers_run_waits_on():
    ls = pytest.importorskip("litserve")

    class Echo(ls.LitAPI):
        def setup(self, device):
            pass

        def predict(self, x):
            return x

    server = ls.LitServer(Echo(), accelerator="cpu")
    where = f"litserve {version('litserve')}"
    assert "self._shutdown_event.wait()" in inspect.getsource(ls.LitServer.run), f"{where}: run() waits elsewhere"
    ending = threading.Thread(target=set_litserve_shutdown, args=(server, 0.01))
    ending.start()  # before run() has made the event: the adapter waits for it
    event = threading.Event()
    server._shutdown_event = event  # what run() does first (a manager Event)
    ending.join(timeout=10)
    assert event.is_set() and not ending.is_alive()


def test_set_litserve_shutdown_names_the_litserve_version_when_the_attribute_is_gone():
    pytest.importorskip("litserve")
    with pytest.raises(UpstreamChanged) as err:
        set_litserve_shutdown(SimpleNamespace())
    assert str(err.value).startswith(f"litserve {version('litserve')} has no LitServer._shutdown_event;")
