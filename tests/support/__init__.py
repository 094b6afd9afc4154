"""Helpers shared by the test folders (fakes, fixtures registered once by the root
conftest, polling, docs and golden-output tools)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_DATA = ROOT / "tests" / "data"
