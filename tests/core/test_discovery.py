"""Discovery against REAL throwaway distributions (dist-info folders on sys.path, in a subprocess).

Nothing in importlib is mocked: the subprocess sees the throwaway distributions exactly as it
would see pip-installed ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

GOOD_MODULE = """
from rlinfer_core.discovery import BackendInfo
from rlinfer_core.types import Capabilities, Capability


def describe():
    return Capabilities("good", "1.5", "cpu", {Capability.STREAM}, {"generate.chat": "not on this engine"})


class GoodBackend:
    def __init__(self, config):
        self.config = config


def make(config):
    return GoodBackend(config)


class Observer:
    pass


backend = BackendInfo("good", ("fakeengine>=1,<2",), "rlinfer_good:make", describe, summary="a good one")
badfactory = BackendInfo("badfactory", ("fakeengine>=1",), "rlinfer_good:nope", describe)
observer = Observer()
"""

OLD_MODULE = """
from rlinfer_core.discovery import BackendInfo
from rlinfer_good import describe

old = BackendInfo("old", ("oldengine>=2,<3",), "rlinfer_good:make", describe)
missing = BackendInfo("missing", ("notinstalledengine>=1",), "rlinfer_good:make", describe)
"""


def _dist(site: Path, name: str, version: str, entry_points: str = "") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    _dist(site, "fakeengine", "1.5")
    _dist(site, "oldengine", "1.0")
    (site / "rlinfer_good.py").write_text(GOOD_MODULE)
    _dist(
        site,
        "rlinfer-good",
        "0.1",
        """
        [rlinfer.backends]
        good = rlinfer_good:backend
        badfactory = rlinfer_good:badfactory

        [rlinfer.plugins]
        observer = rlinfer_good:observer
        """,
    )
    (site / "rlinfer_broken_mod.py").write_text("import does_not_exist_xyz  # noqa\n")
    _dist(
        site,
        "rlinfer-broken",
        "0.2",
        """
        [rlinfer.backends]
        broken = rlinfer_broken_mod:backend

        [rlinfer.plugins]
        brokenplugin = rlinfer_broken_mod:plugin
        """,
    )
    (site / "rlinfer_wrongtype_mod.py").write_text("backend = 42\n")
    _dist(site, "rlinfer-wrongtype", "0.3", "[rlinfer.backends]\nwrongtype = rlinfer_wrongtype_mod:backend\n")
    (site / "rlinfer_old_mod.py").write_text(OLD_MODULE)
    _dist(
        site,
        "rlinfer-old",
        "0.4",
        "[rlinfer.backends]\nold = rlinfer_old_mod:old\nmissing = rlinfer_old_mod:missing\n",
    )
    return site


PROBE = """
import json, sys
import attrs
from rlinfer_core.discovery import discover, get_backend
from rlinfer_core.types import EngineConfig

found = discover()


def attempt(fn):
    try:
        return ["ok", fn()]
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


out = {
    "backends": sorted(found.backends),
    "plugins": sorted(found.plugins),
    "failures": [attrs.asdict(f) for f in found.failures],
    "versions": {n: attempt(lambda i=i: list(i.engine_version())) for n, i in found.backends.items()},
    "get": {n: attempt(lambda n=n: get_backend(n).name) for n in ["good", "broken", "wrongtype", "nosuch"]},
    "create": {
        n: attempt(lambda n=n: type(get_backend(n).create(EngineConfig(model="m"))).__name__)
        for n in ["good", "old", "missing", "badfactory"]
    },
    "heavy_modules": sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "vllm", "sglang"}),
}
print(json.dumps(out))
"""


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RLINFER_BACKENDS", "RLINFER_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def probe(site: Path, **extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=_env(site, **extra), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _failure(out: dict[str, Any], name: str) -> dict[str, Any]:
    matches = [f for f in out["failures"] if f["name"] == name]
    assert len(matches) == 1, out["failures"]
    return matches[0]


def test_good_backend_and_its_engine_requirement(site: Path) -> None:
    out = probe(site)
    assert {"good", "old", "missing", "badfactory"} <= set(out["backends"])
    assert out["versions"]["good"] == ["ok", ["fakeengine", "1.5"]]
    assert out["get"]["good"] == ["ok", "good"]
    assert out["create"]["good"] == ["ok", "GoodBackend"]
    assert "observer" in out["plugins"]


def test_broken_entry_point_is_reported_and_hides_nothing(site: Path) -> None:
    out = probe(site)
    broken = _failure(out, "broken")
    assert broken["group"] == "rlinfer.backends"
    assert broken["distribution"] == "rlinfer-broken 0.2"
    assert broken["value"] == "rlinfer_broken_mod:backend"
    assert "ModuleNotFoundError" in broken["error"] and "does_not_exist_xyz" in broken["error"]
    plugin = _failure(out, "brokenplugin")
    assert plugin["group"] == "rlinfer.plugins" and plugin["distribution"] == "rlinfer-broken 0.2"
    assert "good" in out["backends"]  # (a) still there
    kind, message = out["get"]["broken"]
    assert kind == "BackendLoadError"
    assert "rlinfer-broken 0.2" in message and "does_not_exist_xyz" in message


def test_entry_point_naming_the_wrong_object_type(site: Path) -> None:
    out = probe(site)
    wrong = _failure(out, "wrongtype")
    assert wrong["distribution"] == "rlinfer-wrongtype 0.3"
    assert "must name a rlinfer_core.discovery.BackendInfo, got int" in wrong["error"]
    assert "wrongtype" not in out["backends"]
    assert out["get"]["wrongtype"][0] == "BackendLoadError"


def test_allow_lists_restrict_what_is_loaded(site: Path) -> None:
    out = probe(site, RLINFER_BACKENDS="good, old", RLINFER_PLUGINS="nothing-here")
    assert out["backends"] == ["good", "old"]
    assert out["plugins"] == []
    assert out["failures"] == []  # broken ones were never even imported
    kind, message = out["get"]["broken"]
    assert kind == "BackendNotFound"
    assert "RLINFER_BACKENDS='good, old' excludes it" in message


def test_engine_version_mismatch_and_missing_engine(site: Path) -> None:
    out = probe(site)
    kind, message = out["versions"]["old"]
    assert kind == "BackendLoadError"
    assert "oldengine>=2,<3" in message and "oldengine==1.0" in message
    kind, message = out["versions"]["missing"]
    assert kind == "BackendLoadError"
    assert "not installed" in message and "pip install rlinfer-missing" in message
    # create() checks the engine first, so the factory is never imported for them
    assert out["create"]["old"][0] == "BackendLoadError"
    assert out["create"]["missing"][0] == "BackendLoadError"
    kind, message = out["create"]["badfactory"]
    assert kind == "BackendLoadError" and "cannot import factory 'rlinfer_good:nope'" in message


def test_unknown_backend_lists_installed_ones(site: Path) -> None:
    kind, message = probe(site)["get"]["nosuch"]
    assert kind == "BackendNotFound"
    assert "no rlinfer backend named 'nosuch'" in message
    assert "installed: " in message and "good" in message and "old" in message
    assert "pip install rlinfer-nosuch" in message


def test_discovery_imports_no_torch_or_engine(site: Path) -> None:
    assert probe(site)["heavy_modules"] == []


def test_backends_cli_json(site: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlinfer_core.cli", "backends", "--json"],
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = {r["name"]: r for r in report["backends"]}
    good = rows["good"]
    assert good["usable"] is True
    assert good["engine"] == "fakeengine" and good["engine_version"] == "1.5"
    assert good["summary"] == "a good one"
    # sessions are derived by the facade from generate alone (rlinfer_core.agent.derive_capabilities)
    assert good["capabilities"]["supported"] == ["generate.stream", "sessions"]
    assert "generate.chat" in good["capabilities"]["unsupported"]
    assert good["capabilities"]["notes"]["generate.chat"] == "not on this engine"
    assert "facade" in good["capabilities"]["notes"]["sessions"]
    assert rows["old"]["usable"] is False and "oldengine==1.0" in rows["old"]["error"]
    assert rows["missing"]["usable"] is False and "not installed" in rows["missing"]["error"]
    errors = {e["name"]: e for e in report["load_errors"]}
    assert errors["broken"]["distribution"] == "rlinfer-broken 0.2"
    assert errors["wrongtype"]["distribution"] == "rlinfer-wrongtype 0.3"
    assert report["plugins"] == ["observer"]
