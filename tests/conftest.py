"""Shared test setup."""

import pytest


@pytest.fixture(autouse=True)
def _outside_the_source_tree(tmp_path, monkeypatch):
    """Run every test from its own temporary folder: a child ``python -c`` / ``python -m``
    puts its working directory first on sys.path, and from the repository root the unbuilt
    ``colibri/`` source tree would shadow the installed package."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def wine_env(tmp_path_factory):
    """The environment of a wine prefix of the suite's own (``_support.toolchains``)."""
    from _support.toolchains import WINE, boot_wine, settle_wine

    if WINE is None:
        pytest.skip("wine is not installed (.ci/toolchains.sh installs it)")
    env = boot_wine(tmp_path_factory.mktemp("wine"))
    yield env
    settle_wine(env, kill=True)
