"""Environment switches: one module reads them all (srt/envs.py), docs/usage.md documents each."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from srt import envs

ROOT = Path(__file__).resolve().parents[1]


def reads_environment(tree: ast.AST) -> bool:
    """Whether the module touches os.environ or os.getenv."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & {"environ"}:
            return True
    return False


def test_only_envs_reads_the_environment() -> None:
    readers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "srt").rglob("*.py"))
        if path.name != "envs.py" and reads_environment(ast.parse(path.read_text()))
    ]
    assert readers == []


def test_every_switch_is_documented() -> None:
    usage = (ROOT / "docs" / "usage.md").read_text()
    for switch in envs.SWITCHES:
        assert f"`{switch.name}`" in usage, switch.name


@pytest.mark.parametrize(
    ("value", "on_by_default", "off_by_default"),
    [(None, True, False), ("0", False, False), ("1", True, True), (" 0 ", False, False), ("yes", True, False)],
)
def test_default_on_is_off_only_at_0_and_default_off_is_on_only_at_1(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on_by_default: bool, off_by_default: bool
) -> None:
    for switch, expected in ((envs.GEMMA4_YOCO, on_by_default), (envs.SRT_DEBUG_KV_INDICES, off_by_default)):
        if value is None:
            monkeypatch.delenv(switch.name, raising=False)
        else:
            monkeypatch.setenv(switch.name, value)
        assert switch.enabled() is expected
