"""Docs and presets stay true: the config reference, every YAML preset, README links, the
docs sections the code points to."""

from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest
import yaml

from megatron_ssd.config import OffloadConfig, TrainConfig, load_config
from megatron_ssd.commands.docgen import configuration_reference
from megatron_ssd.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".yaml"))


def test_configuration_reference_is_current():
    with open(os.path.join(REPO, "docs", "configuration.md"), encoding="utf-8") as fh:
        committed = fh.read()
    assert committed == configuration_reference(), "run: python -m megatron_ssd.commands.docgen > docs/configuration.md"


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_validates_and_names_its_command(name):
    path = os.path.join(REPO, "configs", name)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    first = text.splitlines()[0]
    assert first.startswith("# ") and ("megatron-ssd" in first or "python" in first), first
    data = yaml.safe_load(text)
    cls = TrainConfig if "model" in data else OffloadConfig
    config = load_config(cls, path)
    assert isinstance(config, cls)


def test_presets_cover_the_shipped_sizes_and_io_profiles():
    for name in ("gpt-tiny", "gpt-ref-cpu", "gpt-1.3b", "gpt-7b", "gpt-13b", "gpt-70b", "bert-large", "t5-base",
                 "io-nvme1", "io-raid0x4", "io-gds"):
        assert f"{name}.yaml" in PRESETS


def test_unknown_preset_key_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layer: 4\n")
    with pytest.raises(ConfigError, match=r"ModelConfig: unknown key 'model.num_layer'; did you mean 'model.num_layers'"):
        load_config(TrainConfig, str(bad))


def test_every_doc_is_reachable_from_the_readme():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)\)", readme))
    docs = {f for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md")}
    assert docs <= linked, f"not linked from README.md: {sorted(docs - linked)}"
    assert "make run" in readme and "make test" in readme


def _anchors(doc: str) -> set:
    """The anchors of a Markdown file's headings, as GitHub makes them: lower case, spaces
    to hyphens, everything but letters, digits, ``-`` and ``_`` dropped."""
    with open(os.path.join(REPO, "docs", doc), encoding="utf-8") as fh:
        text = re.sub(r"```.*?```", "", fh.read(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


CODE = sorted(pathlib.Path(REPO, "megatron_ssd").rglob("*.py"))


def test_sections_the_code_points_to_exist():
    """Every ``docs/NAME.md#anchor`` in the package (error messages, NOTE pointers to
    measurements) names a heading of that doc."""
    cited = {(p.relative_to(REPO), doc, anchor) for p in CODE
             for doc, anchor in re.findall(r"docs/([\w.-]+\.md)#([\w-]+)", p.read_text(encoding="utf-8"))}
    assert len(cited) >= 10, cited
    missing = [f"{path}: docs/{doc}#{anchor}" for path, doc, anchor in sorted(cited) if anchor not in _anchors(doc)]
    assert not missing, f"no such section: {missing}"


def _docstrings(tree: ast.AST) -> set:
    bodies = [node.body for node in ast.walk(tree) if isinstance(getattr(node, "body", None), list)]
    return {id(stmt.value) for body in bodies for stmt in body
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)}


def test_messages_send_users_to_docs_not_to_source_notes():
    """A string the code prints or raises names a docs section, never a ``NOTE [...]`` of
    the source (docstrings and comments may cite NOTEs: they are read with the source)."""
    found = []
    for path in CODE:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        found += [f"{path.relative_to(REPO)}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and "NOTE [" in node.value
                  and id(node) not in docs]
    assert not found, found
