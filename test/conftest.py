"""Shared pytest fixtures and mark handling for srt's tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch_threads import one_torch_thread


def _index_scalars_with_item() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and `range()` over them calls int() on the
    array, which NumPy >= 2.4 refuses; convert through .item() instead (interpreter only)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_srt_item_index", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._srt_item_index = True
    interpreter._patch_lang_tensor = patched


if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated, i.e. when its module is first imported: it must be set
    # before any test (or srt module a test imports) loads a kernel, so CPU runs use Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _index_scalars_with_item()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def one_thread_for_the_session() -> Iterator[None]:
    """One torch thread for every test (torch_threads.py says why): the tiny models' matmuls gain nothing from
    a second thread, and on a busy 2-core machine OpenMP spin-waits make them many times slower."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a whole module (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory `tiny_checkpoint(preset, seed=0) -> Path`: a float32 tiny checkpoint directory.

    Each (preset, seed) is built once per test session; tests must treat the directory as read-only.
    """
    # Imported here so that collecting tests which never build a checkpoint stays cheap.
    from srt.tools.make_checkpoint import make_checkpoint

    built: dict[tuple[str, int], Path] = {}

    def build(preset: str, seed: int = 0) -> Path:
        key = (preset, seed)
        if key not in built:
            built[key] = make_checkpoint(preset, tmp_path_factory.mktemp(f"{preset}-seed{seed}"), seed=seed)
        return built[key]

    return build


# The flags of `shared_server`: the defaults, and the 1 MiB body limit the request-limit and fuzz tests check.
SHARED_SERVER_FLAGS = ("--max-request-body-mb", "1")


@pytest.fixture(scope="session")
def shared_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One server (tiny E4B, float32, cpu, SHARED_SERVER_FLAGS) for the modules that only send it requests:
    starting it takes seconds of a busy CI machine. A module's own `server` fixture yields it and then waits for
    it to be idle with no slot leaked (serving_fixtures.wait_idle): no module sees another's requests."""
    from serving_fixtures import PRESET, start_server, stop_and_check_no_child_left

    log = tmp_path_factory.mktemp("shared-server") / "server.log"
    server = start_server(tiny_checkpoint(PRESET), log, *SHARED_SERVER_FLAGS)
    try:
        yield server
    finally:
        # what test_serving_openai.py's last test checked on its own server: SIGTERM leaves no child process
        stop_and_check_no_child_left(server)
