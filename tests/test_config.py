"""nbkit.configure / nbkit.config.setting: every NBKIT_* variable nbkit reads, read one way."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import nbkit
from nbkit import config, dashboard, offline


def test_settings_are_read_from_the_environment_with_defaults(monkeypatch, tmp_path):
    for spec in config.SETTINGS.values():
        monkeypatch.delenv(spec.env, raising=False)
    assert config.setting("dashboard") == "auto" and config.setting("dashboard_interval") == "10"
    assert offline.cache_root() == Path.home() / ".cache" / "nbkit" / "models"
    monkeypatch.setenv("NBKIT_DASHBOARD", " Text ")
    monkeypatch.setenv("NBKIT_CACHE", str(tmp_path))
    assert dashboard.display_mode() == "text"
    assert offline.cache_root() == tmp_path / "models"
    monkeypatch.setenv("NBKIT_DASHBOARD_INTERVAL", "0.5")
    board = dashboard.Dashboard(1, mode="off")
    board.close(success=True)
    assert board.interval == 0.5
    monkeypatch.setenv("NBKIT_DASHBOARD_INTERVAL", "often")
    with pytest.raises(
        ValueError, match="NBKIT_DASHBOARD_INTERVAL='often' is not valid for nbkit's dashboard_interval"
    ):
        dashboard.Dashboard(1, mode="off")


def test_configure_checks_everything_before_changing_anything(monkeypatch):
    for spec in config.SETTINGS.values():
        # set first, so that monkeypatch records each one and removes what configure() writes below (a
        # delenv of a variable that is not there records nothing, and NBKIT_DASHBOARD=off leaked into
        # every later test of the session)
        monkeypatch.setenv(spec.env, "")
        monkeypatch.delenv(spec.env)
    with pytest.raises(ValueError, match="dashboard='fancy' is not valid; use one of 'auto', 'html', 'widget'"):
        nbkit.configure(device_map_policy="error", dashboard="fancy")
    with pytest.raises(ValueError, match="nbkit has no setting 'colour'"):
        nbkit.configure(colour="blue")
    assert "NBKIT_DEVICE_MAP_POLICY" not in os.environ
    now = nbkit.configure(dashboard="off", dashboard_interval="2")
    assert now["dashboard"] == "off" and now["dashboard_interval"] == "2"
    assert os.environ["NBKIT_DASHBOARD"] == "off" and dashboard.display_mode() == "off"


def test_no_module_reads_an_nbkit_variable_around_the_settings():
    package = Path(nbkit.__file__).parent
    declared = {spec.env for spec in config.SETTINGS.values()}
    for path in package.rglob("*.py"):
        if path.name == "config.py":
            continue
        reads = re.findall(r"environ(?:\.get\(|\[)\s*[\"'](NBKIT_\w+)", path.read_text())
        assert not reads, f"{path.name} reads {reads} from os.environ: declare it in nbkit.config.SETTINGS"
    assert {"NBKIT_DASHBOARD", "NBKIT_DASHBOARD_INTERVAL", "NBKIT_CACHE", "NBKIT_DEVICE_MAP_POLICY"} <= declared
