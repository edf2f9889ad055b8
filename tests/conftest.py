"""Shared test setup."""

import pytest


@pytest.fixture(autouse=True)
def _outside_the_source_tree(tmp_path, monkeypatch):
    """Run every test from its own temporary folder: a child ``python -c`` / ``python -m``
    puts its working directory first on sys.path, and from the repository root the unbuilt
    ``colibri/`` source tree would shadow the installed package."""
    monkeypatch.chdir(tmp_path)
