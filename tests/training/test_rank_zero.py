"""Waiting for what rank 0 writes once for every rank, on a clock that moves only when the code sleeps: it gives up
past ``wait`` seconds, looks once a second, and returns what ``read`` gives once the file is there."""

import logging
from types import SimpleNamespace

import pytest

from vitattn.training import rank_zero
from vitattn.training.rank_zero import wait_for_rank_zero


class _Clock:
    """``rank_zero.time`` replaced by a clock that moves only when the code sleeps; ``on_sleep`` runs at each sleep."""

    def __init__(self, monkeypatch, on_sleep=lambda now: None) -> None:
        self.now, self.sleeps, self.on_sleep = 0.0, [], on_sleep
        monkeypatch.setattr(rank_zero, "time", SimpleNamespace(monotonic=lambda: self.now, sleep=self._sleep))

    def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep(self.now)


def test_waiting_for_rank_zero_gives_up_once_more_than_wait_seconds_passed_looking_once_a_second(
    tmp_path, monkeypatch, caplog
):
    clock = _Clock(monkeypatch)
    with caplog.at_level(logging.INFO, "vitattn.training.rank_zero"):
        with pytest.raises(TimeoutError, match=r"^rank 0 wrote no .*missing in 5 s; see rank 0's log for why$"):
            wait_for_rank_zero(tmp_path / "missing", wait=5)
    assert clock.sleeps == [1.0] * 6  # at 5 s it still waits: past 5 s it stops
    assert "waiting for rank 0 to write" in caplog.text


def test_waiting_for_rank_zero_returns_what_read_gives_once_the_file_is_there_and_not_before(
    tmp_path, monkeypatch, caplog
):
    path = tmp_path / "reward.json"
    reads = iter([None, "new"])  # None: rank 0 is still replacing an older file
    clock = _Clock(monkeypatch, on_sleep=lambda now: now == 2 and path.write_text("x"))
    with caplog.at_level(logging.INFO, "vitattn.training.rank_zero"):
        assert wait_for_rank_zero(path, wait=10, read=lambda p: next(reads)) == "new"
    assert clock.sleeps == [1.0] * 3  # absent at 0 and 1 s, there but not ready at 2 s, read at 3 s
    caplog.clear()
    assert wait_for_rank_zero(path, wait=10) is True  # there already, no read: at once, without a word
    assert clock.sleeps == [1.0] * 3 and not caplog.text
