"""The pytest11 plugin: options, markers, hypothesis profiles, the session engine, the report.

Activated by ``--rlinfer-backend NAME``. Without it the kit's tests are skipped, so having the
plugin installed never changes other test runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.report import KitReport
from rlinfer_core.types import Capability

SUITE_PACKAGE = "rlinfer_conformance.suite"
PROFILES = ("ci", "thorough")
_REPORT = pytest.StashKey[KitReport]()

MARKERS = (
    "requires(*capabilities): the test needs these rlinfer Capability values; skipped (naming them) "
    "when the backend does not claim them",
    "unsupported(capability): negative contract test, run only when the backend does not claim it",
    "hooks(*names): the rlinfer hooks this kit test exercises (checked by the meta-tests)",
    "rlinfer_last: run after every other kit test (e.g. shutdown)",
)


def register_hypothesis_profiles() -> None:
    """ "ci": few examples, derandomized, no deadline; "thorough": many, random."""
    from hypothesis import HealthCheck, settings

    quiet = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile(
        "ci", max_examples=8, derandomize=True, deadline=None, database=None, suppress_health_check=quiet
    )
    settings.register_profile("thorough", max_examples=60, deadline=None, suppress_health_check=quiet)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the kit's command-line options."""
    group = parser.getgroup("rlinfer", "rlinfer conformance kit")
    group.addoption("--rlinfer-backend", default=None, help="run the rlinfer conformance kit against this backend")
    group.addoption("--rlinfer-report", default=None, help="write the kit's JSON report to this file")
    group.addoption(
        "--rlinfer-config",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="EngineConfig field for the kit's engine, e.g. enable_memory_release=true (repeatable)",
    )
    group.addoption(
        "--rlinfer-configuration",
        action="append",
        default=[],
        metavar="FIELD=VALUE[,FIELD=VALUE...]",
        help="one configuration of the kit's engines, e.g. mode=server or replicas=2 (EngineConfig fields, and "
        "replicas as --rlinfer-replicas; repeatable): the kit runs once per "
        "configuration in this one session, ending one configuration's engines before the next starts; "
        "test ids name it (test_x[mode-server]); --rlinfer-config fields apply to every one",
    )
    group.addoption(
        "--rlinfer-engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine-specific argument (EngineConfig.engine_kwargs), e.g. attention_backend=triton",
    )
    group.addoption(
        "--rlinfer-logprob-tol",
        default=None,
        help="max |logprob - oracle| (default 1e-5, for float32 on CPU; GPU kernels need more, e.g. 1e-3)",
    )
    group.addoption(
        "--rlinfer-replicas",
        type=int,
        default=1,
        help="N > 1: run the kit against an rlinfer-ray pool of N replicas (needs rlinfer-ray)",
    )
    group.addoption(
        "--rlinfer-architectures",
        default=None,
        metavar="A,B,...",
        help="run the per-architecture tests on these architectures only (default: every one of "
        "rlinfer_core.tiny_model.ARCHITECTURES); others are deselected",
    )
    group.addoption(
        "--rlinfer-trainer-device",
        default=None,
        metavar="DEVICE",
        help="where the kit's trainer holds the weights it sends (default cpu); e.g. cuda:1: tensor and "
        "bucket updates then go through CUDA IPC, which each of them asserts",
    )
    group.addoption(
        "--rlinfer-broadcast-backend",
        default=None,
        choices=("gloo", "nccl"),
        help="the kit's weight broadcast group (default gloo); nccl needs --rlinfer-trainer-device on a GPU "
        "other than the engine's",
    )
    group.addoption(
        "--rlinfer-profile",
        default=os.environ.get("RLINFER_HYPOTHESIS_PROFILE", "ci"),
        choices=PROFILES,
        help="hypothesis profile for the kit (default: ci)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register markers and hypothesis profiles; create the report when the kit is active."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    register_hypothesis_profiles()
    tolerance = config.getoption("--rlinfer-logprob-tol")
    if tolerance is not None:
        os.environ["RLINFER_LOGPROB_TOL"] = str(float(tolerance))  # read by rlinfer_conformance.world
    from rlinfer_conformance import trainer_side

    for option, variable in (
        ("--rlinfer-trainer-device", trainer_side.DEVICE_ENV),
        ("--rlinfer-broadcast-backend", trainer_side.BROADCAST_BACKEND_ENV),
    ):
        if config.getoption(option) is not None:
            os.environ[variable] = str(config.getoption(option))  # read by rlinfer_conformance.trainer_side
    backend = config.getoption("--rlinfer-backend")
    if backend:
        import tempfile

        from hypothesis import settings

        from rlinfer_core.fault_plan import ENV

        # before any engine starts, so that every engine process inherits it (see fault_plan)
        os.environ.setdefault(ENV, os.path.join(tempfile.gettempdir(), f"rlinfer-fault-plan-{os.getpid()}.json"))

        profile = config.getoption("--rlinfer-profile")
        settings.load_profile(profile)
        config.stash[_REPORT] = KitReport(backend=backend, profile=profile)


def is_kit_item(item: pytest.Item) -> bool:
    """True for tests defined in the packaged suite (wherever they were imported)."""
    fn = getattr(item, "function", None)
    return bool(fn is not None and getattr(fn, "__module__", "").startswith(SUITE_PACKAGE))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the kit without a backend; run each configuration's tests together, its ``rlinfer_last``
    tests at their end."""
    if not config.getoption("--rlinfer-backend"):
        skip = pytest.mark.skip(reason="rlinfer conformance kit: pass --rlinfer-backend NAME to run it")
        for item in items:
            if is_kit_item(item):
                item.add_marker(skip)
        return
    positions = {spec: i for i, spec in enumerate(config.getoption("--rlinfer-configuration"))}

    def order(item: pytest.Item) -> tuple[int, bool]:  # per configuration: rlinfer_last tests at its end
        return positions.get(configuration_of(item), 0), item.get_closest_marker("rlinfer_last") is not None

    items.sort(key=order)
    _select_architectures(config, items)
    pool_skip = pytest.mark.skip(reason="kills single engines of its own; pool replica deaths: tests/ray")
    for item in items:
        if item.name.startswith("test_each_engine_process_killed_in_turn"):
            fields = parse_configuration(configuration_of(item))
            if int(fields.get("replicas", config.getoption("--rlinfer-replicas"))) > 1:
                item.add_marker(pool_skip)


def configuration_of(item: pytest.Item) -> str | None:
    """The ``--rlinfer-configuration`` an item runs under, if any."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("rlinfer_configuration") if callspec is not None else None


def parse_configuration(spec: str | None) -> dict[str, Any]:
    """``"mode=server,replicas=2"`` -> ``{"mode": "server", "replicas": 2}`` (None: no fields)."""
    from rlinfer_core.types import parse_assignments

    return {} if spec is None else parse_assignments(spec.split(","), "--rlinfer-configuration")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """With ``--rlinfer-configuration``: every test using the kit's engines, once per configuration."""
    specs = metafunc.config.getoption("--rlinfer-configuration")
    if specs and "rlinfer_configuration" in metafunc.fixturenames:
        metafunc.parametrize("rlinfer_configuration", specs, indirect=True, scope="session", ids=configuration_id)


def configuration_id(spec: str) -> str:
    """The test-id part naming a configuration, usable in ``-k``: ``mode=server`` -> ``mode-server``."""
    return spec.replace("=", "-").replace(",", "+")


def _select_architectures(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect per-architecture tests outside ``--rlinfer-architectures``."""
    from rlinfer_core.tiny_model import ARCHITECTURES

    chosen = config.getoption("--rlinfer-architectures")
    if not chosen:
        return
    wanted = {a.strip() for a in chosen.split(",") if a.strip()}
    unknown = wanted - set(ARCHITECTURES)
    if unknown:
        raise pytest.UsageError(f"--rlinfer-architectures: unknown {sorted(unknown)}; known: {list(ARCHITECTURES)}")
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        arch = callspec.params.get("rlinfer_arch_world") if callspec is not None else None
        (drop if arch is not None and arch not in wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Feed each phase's outcome into the kit report."""
    rep: Any = yield
    kit = item.config.stash.get(_REPORT, None)
    if kit is not None and (rep.when == "call" or rep.outcome != "passed"):
        detail = None
        if rep.skipped and isinstance(rep.longrepr, tuple):
            detail = str(rep.longrepr[2])
        elif rep.failed:
            detail = str(rep.longrepr)
        kit.record_test(item.nodeid, rep.outcome, rep.duration, detail)
    return rep  # type: ignore[no-any-return]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the kit report."""
    kit = session.config.stash.get(_REPORT, None)
    path = session.config.getoption("--rlinfer-report")
    if kit is not None and path:
        kit.write(path)


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rlinfer_backend(pytestconfig: pytest.Config) -> str:
    """Name of the backend under test (``--rlinfer-backend``)."""
    name = pytestconfig.getoption("--rlinfer-backend")
    if not name:
        pytest.skip("rlinfer conformance kit: pass --rlinfer-backend NAME to run it")
    return str(name)


@pytest.fixture(scope="session")
def rlinfer_configuration(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The configuration now under test (one ``--rlinfer-configuration``; none given: no fields):
    EngineConfig fields, and ``replicas`` (N > 1: the kit's engine is a pool, as ``--rlinfer-replicas``)."""
    return parse_configuration(getattr(request, "param", None))


@pytest.fixture(scope="session")
def rlinfer_config_overrides(pytestconfig: pytest.Config, rlinfer_configuration: dict[str, Any]) -> dict[str, Any]:
    """Extra EngineConfig fields for the kit's engines: ``--rlinfer-config``, the configuration now
    under test and ``--rlinfer-engine-arg``; a backend's test file may override this fixture."""
    from rlinfer_core.types import parse_assignments

    fields = parse_assignments(pytestconfig.getoption("--rlinfer-config"), "--rlinfer-config")
    fields.update({name: value for name, value in rlinfer_configuration.items() if name != "replicas"})
    engine_args = parse_assignments(pytestconfig.getoption("--rlinfer-engine-arg"), "--rlinfer-engine-arg")
    if engine_args:
        fields["engine_kwargs"] = {**fields.get("engine_kwargs", {}), **engine_args}
    return fields


@pytest.fixture(scope="session")
def rlinfer_report(pytestconfig: pytest.Config, rlinfer_backend: str) -> KitReport:
    """The kit report of this run."""
    return pytestconfig.stash[_REPORT]


@pytest.fixture(scope="session")
def rlinfer_world(
    rlinfer_backend: str,
    rlinfer_configuration: dict[str, Any],
    rlinfer_config_overrides: dict[str, Any],
    rlinfer_report: KitReport,
    tmp_path_factory: pytest.TempPathFactory,
    pytestconfig: pytest.Config,
) -> Iterator[Any]:
    """ONE engine for the whole session (per configuration), on a tiny random model (seed 0),
    plus the HF oracle."""
    from rlinfer_conformance.oracle import Oracle, tie_band
    from rlinfer_conformance.world import BASE, LOGPROB_TOLERANCE, OTHER, EventRecorder, KitWorld, default_config
    from rlinfer_core.engine import open_engine
    from rlinfer_core.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("rlinfer-kit")
    base_dir = make_tiny_model(tmp / "model-seed0", seed=0)
    config = default_config(base_dir, rlinfer_config_overrides)
    oracle = Oracle(weight_dtype=config.dtype, tie_tolerance=tie_band(LOGPROB_TOLERANCE))
    oracle.add(BASE, base_dir)
    oracle.add(OTHER, make_tiny_model(tmp / "model-seed1", seed=1))
    events = EventRecorder()
    started = time.perf_counter()
    replicas = int(rlinfer_configuration.get("replicas", pytestconfig.getoption("--rlinfer-replicas")))
    if replicas > 1:  # the same kit against an rlinfer-ray pool of engines
        from rlinfer_ray.kit import open_kit_engine

        rlinfer_report.notes.append(f"engine: rlinfer-ray pool of {replicas} replicas")
        engine: Any = open_kit_engine(rlinfer_backend, config, replicas, plugins=[events])
    else:
        engine = open_engine(rlinfer_backend, config, plugins=[events])
    rlinfer_report.timings["engine_start"] = time.perf_counter() - started
    caps = engine.capabilities
    rlinfer_report.capabilities = caps.to_dict()
    rlinfer_report.engine_version = caps.engine_version
    rlinfer_report.engine_platform = caps.platform
    if rlinfer_configuration:
        rlinfer_report.configurations.append(
            {
                "fields": rlinfer_configuration,
                "capabilities": caps.to_dict(),
                "engine_start_s": round(rlinfer_report.timings["engine_start"], 2),
            }
        )
    world = KitWorld(engine, oracle, rlinfer_report, events, Path(tmp), pooled=replicas > 1)
    try:
        yield world
    finally:
        world.close()
        engine.shutdown()


@pytest.fixture
def rlinfer_engine(rlinfer_world: Any) -> Any:
    """The session's :class:`rlinfer_core.engine.Engine`."""
    return rlinfer_world.engine


@pytest.fixture(autouse=True)
def _rlinfer_capability_gate(request: pytest.FixtureRequest) -> None:
    """Skip ``requires`` tests whose capabilities are not claimed (and vice versa)."""
    requires = [Capability(c) for m in request.node.iter_markers("requires") for c in m.args]
    unsupported = [Capability(c) for m in request.node.iter_markers("unsupported") for c in m.args]
    if not requires and not unsupported:
        return
    world = request.getfixturevalue("rlinfer_world")
    caps = world.engine.capabilities
    missing = [c for c in requires if not caps.supports(c)]
    if missing:
        world.report.record_skip(request.node.nodeid, [c.value for c in missing])
        why = "; ".join(f"{c.value}: {caps.notes.get(c.value, 'not claimed')}" for c in missing)
        pytest.skip(
            f"backend {caps.backend!r} does not claim capability {', '.join(c.value for c in missing)} "
            f"({why}); the negative contract test checks it raises UnsupportedCapability"
        )
    claimed = [c for c in unsupported if caps.supports(c)]
    if claimed:
        pytest.skip(f"backend {caps.backend!r} claims {', '.join(c.value for c in claimed)}; positive tests cover it")


@pytest.fixture
def rlinfer_base_weights(rlinfer_world: Any) -> Iterator[Any]:
    """For tests that change weights: the base weights are served before and after the test."""
    rlinfer_world.restore()
    yield rlinfer_world
    rlinfer_world.restore()
