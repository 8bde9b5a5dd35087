"""`bench/timing.py`'s `write_json`: where a bench script's results go (--json, else $OUT, else nowhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def write_json(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as `python bench/<script>.py` has it
    import timing

    return timing.write_json


def test_an_explicit_path_wins_over_out(write_json, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    explicit = tmp_path / "mine.json"
    assert write_json(explicit, "bench_x.json", {"a": 1}) == explicit
    assert json.loads(explicit.read_text()) == {"a": 1}
    assert not (tmp_path / "out").exists()


def test_out_takes_the_default_name(write_json, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    assert write_json(None, "bench_x.json", {"b": [1, 2]}, indent=2) == tmp_path / "bench_x.json"
    assert json.loads((tmp_path / "bench_x.json").read_text()) == {"b": [1, 2]}


def test_neither_writes_nothing(write_json, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert write_json(None, "bench_x.json", {}) is None
    assert not list(tmp_path.iterdir())
