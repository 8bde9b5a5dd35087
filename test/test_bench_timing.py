"""`bench/timing.py`: `write_json` (where a bench script's results go: --json, else $OUT, else nowhere) and
`print_kernel_resources`."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

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


class _Compiled:
    """A compiled Triton kernel as `print_kernel_resources` sees it: registers known once its handles load."""

    def __init__(self, loads: bool, warps: int) -> None:
        self.n_regs = self.n_spills = None
        self.loads = loads
        self.metadata = SimpleNamespace(shared=1024, num_warps=warps, num_stages=1)

    def _init_handles(self) -> None:
        if not self.loads:
            raise RuntimeError("out of resources: shared memory")
        self.n_regs, self.n_spills = 128, 0


def test_kernel_resources_load_lazy_variants_and_skip_failed_ones(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import timing

    variants = {"a": _Compiled(loads=True, warps=4), "b": _Compiled(loads=False, warps=8)}
    kernel = SimpleNamespace(__name__="_k", device_caches={0: (variants,)})
    timing.print_kernel_resources(kernel)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["_k (device 0): 128 registers, 0 spills, 1024 B shared, 4 warps, 1 stages"]
