"""docs/reliability.md stays true: every test it names exists."""

from __future__ import annotations

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _test_names(path: str) -> set:
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


@pytest.mark.slow
def test_every_test_named_in_reliability_md_exists():
    with open(os.path.join(REPO, "docs", "reliability.md"), encoding="utf-8") as fh:
        text = fh.read()
    refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert len(refs) >= 30, "the table names the tests that show each guarantee"
    missing = [f"{path}::{name}" for path, name in refs if name not in _test_names(path)]
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
    named = {name for _, name in refs}
    here = os.path.dirname(os.path.abspath(__file__))
    for f in sorted(os.listdir(here)):
        if f.startswith("test_reliability_") and f.endswith(".py") and f != os.path.basename(__file__):
            unlisted = _test_names(os.path.join("tests", "reliability", f)) - named
            assert not unlisted, f"tests in {f} missing from docs/reliability.md: {sorted(unlisted)}"
