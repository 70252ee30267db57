"""The pytest plugin: suite-wide options, the Hypothesis profiles, and the differential test's
parametrization over (backend, arch, case).

Loaded by ``suites/conftest.py`` (``pytest_plugins = ["mxmoe.harness.plugin"]``). Options:

* ``--backend PATTERN`` (repeatable): shell globs on backend ids; none = every backend of kind
  ``backend`` plus every file-given one (``harness.run.registry.select``).
* ``--backend-file PATH:Class`` (repeatable): a backend written outside the project.
* ``--profile pr|nightly``: the case list (``harness.run.profiles``) and the Hypothesis profile.
* ``--shard I/K``: shard I of K of the differential tests (by a hash of the test id; CI matrices).
* ``--results DIR``: record every verdict there (``harness.run.results``), and a reproducer for every
  FAIL and ERROR; without it nothing is written.

Under pytest-xdist, ``-n auto`` starts one worker per CPU core (at least one per visible GPU, CUDA
or ROCm) and worker ``gwN`` is pinned to GPU N modulo their number. A worker killed by a
kernel fault (a segfault, an illegal memory access that ends the process) is replaced by xdist;
the test it was running is recorded here as that case's ERROR (with ``--results``), and every
other worker's results stay in their own files.

Workers that share a GPU share its memory through a ledger (``harness.run.ledger``): each test takes
a share before it runs and gives it back after, its need estimated from the case it runs (a
differential's, a ``Case`` among its parameters, or a ``device_case`` mark's: ``PEAK_MARGIN`` times
``platforms.case_gpu_gib``; else ``TEST_GIB``), and a worker hands its allocator's cache back after a
heavy test. A test that runs out of device memory beside others' shares runs again alone, once, and
says so in its report and in the run's summary; out of memory alone, it fails. ``--device-share GIB``
sets what the shares of one GPU may add up to (default: ``DEVICE_SHARE`` of the GPU less each of its
workers' CUDA context).

Any test that requests ``differential`` is parametrized over every selected backend x every arch
it declares x every case of the profile, with ids ``engine.test_id`` (``emulation-gfx942-tiny-
interleaved-t7``). The set is the same on every host: whether this host has the arch is decided
when the test runs (a SKIP with the engine's reason), never at collection.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings

from mxmoe.harness.contract.cases import Case
from mxmoe.harness.diagnosis.explain import summarize
from mxmoe.harness.judge.engine import Result, failure_message, run_case, test_id
from mxmoe.harness.run.profiles import PROFILES, profile_cases
from mxmoe.harness.run.registry import Loaded, discover, select, with_tactics

for _name, _examples in (("pr", 25), ("nightly", 400)):
    settings.register_profile(
        _name,
        max_examples=_examples,
        deadline=None,
        derandomize=True,  # a run's examples derive from the test's identity, never from the clock
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )

_SELECTED = pytest.StashKey[list[Loaded]]()
_RECORDER = pytest.StashKey[object]()


@dataclass(frozen=True)
class Differential:
    """One differential test's parameter: the backend (and where it came from), the arch, the case."""

    loaded: Loaded
    arch: str
    case: Case

    @property
    def test_id(self) -> str:
        """``backend-arch-case``."""
        return test_id(self.loaded.backend.declaration.id, self.arch, self.case)


def _shard(value: str) -> tuple[int, int]:
    i, _, k = value.partition("/")
    try:
        index, count = int(i), int(k)
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise pytest.UsageError(f"--shard: expected I/K with 0 <= I < K, got {value!r}")
    return index, count


def shard_of(test_id: str, count: int) -> int:
    """The shard of ``test_id`` among ``count``: a hash of the id, stable across hosts and runs."""
    import hashlib

    return int.from_bytes(hashlib.sha256(test_id.encode()).digest()[:8], "little") % count


def _seconds_long(item: pytest.Item) -> float:
    """The seconds a ``long`` test is marked with (0 for the rest)."""
    mark = item.get_closest_marker("long")
    return float(mark.args[0]) if mark is not None and mark.args else 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The tests marked ``long`` first, longest first: parallel workers then each start on one and
    # fill in with short tests, instead of one worker starting a several-minute test at the end
    # (with ``pytest_configure``'s small scheduling chunks). The rest keep their order.
    items.sort(key=lambda item: -_seconds_long(item))
    shard = config.getoption("--shard")
    if shard is None:
        return
    index, count = shard
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        differential = callspec.params.get("differential") if callspec is not None else None
        mine = shard_of(differential.test_id, count) == index if differential is not None else index == 0
        (keep if mine else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mxmoe", "MXFP4 MoE differential harness")
    group.addoption(
        "--backend",
        action="append",
        default=[],
        metavar="PATTERN",
        help="backends to check: shell glob on the backend id (repeatable); default: every kind-'backend' "
        "backend plus every --backend-file one",
    )
    group.addoption(
        "--backend-file",
        action="append",
        default=[],
        metavar="PATH:Class",
        help="load a backend class from a Python file outside the project (repeatable)",
    )
    group.addoption(
        "--shard",
        default=None,
        type=_shard,
        metavar="I/K",
        help="run shard I of K (0 <= I < K) of the differential tests, chosen by a hash of the test id (so "
        "the split does not depend on collection order); other tests run in shard 0 only",
    )
    group.addoption(
        "--tactics",
        default="default",
        metavar="default|all|NAME,...",
        help="also run each backend under its declared tactics (kernel configurations): 'all', or names; "
        "default: each kernel's own pick only",
    )
    group.addoption(
        "--profile",
        default="pr",
        choices=PROFILES,
        help="test profile: pr (fast, what CI runs) or nightly (many more cases)",
    )
    group.addoption(
        "--device-share",
        default=None,
        type=float,
        metavar="GIB",
        help="device memory the tests running at once on one GPU may hold together, in GiB (pytest-xdist's "
        "workers take shares of it per test); default: 90%% of the GPU less each worker's CUDA context. "
        "Given explicitly, the workers share it on a host without a GPU too",
    )
    group.addoption(
        "--results",
        default=None,
        metavar="DIR",
        help="record every differential verdict (one JSON-lines file per process) and a reproducer for every "
        "FAIL/ERROR in DIR; default: record nothing",
    )


def pytest_configure(config: pytest.Config) -> None:
    from mxmoe.harness.contract.platforms import use_triton_interpreter_without_gpu

    use_triton_interpreter_without_gpu()  # before any test module imports triton
    settings.load_profile(config.getoption("--profile"))
    config.addinivalue_line(
        "markers", "long(seconds): runs for minutes on a 2-core CPU (about SECONDS); started first under xdist"
    )
    config.addinivalue_line(
        "markers", "device_case(*cases): runs these cases on the host's device; its share of GPU memory is theirs"
    )
    if getattr(config.option, "maxschedchunk", "absent") is None:
        # xdist hands each worker a quarter of its share at once by default, in collection order;
        # small chunks let the long tests above go to different workers.
        config.option.maxschedchunk = 2
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        from mxmoe.harness.contract.platforms import pin_gpu

        pin_gpu(int(worker[2:]))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        # Each xdist worker would otherwise start one compute thread per core: on CI's 2 cores two
        # workers' CPU forwards then contend and run several times slower than one worker alone.
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Each ``--backend-file`` (or installed) backend that failed to load, with its file, class and
    exception, at the head of the run: its tests carry a made-up id, and each is an ERROR."""
    from mxmoe.harness.run.registry import load_failures

    if not config.getoption("--backend-file"):
        return []
    try:
        return [f"backend {line}" for line in load_failures(selected_backends(config))]
    except pytest.UsageError:  # reported where the backends are selected, with the failures in it
        return []


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker per CPU core, and never fewer than the visible GPUs (each worker is
    pinned to GPU N modulo their number, so every GPU is used and the many CPU-bound tests of the
    suite are not run one at a time on a one-GPU host)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(gpus, os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: object) -> None:
    """A worker died while running ``crashitem``: record it as that case's ERROR (pytest reports
    it as failed already); the controller writes its own results file."""
    config = getattr(sched, "config", None) or _CONTROLLER.get("config")
    results_dir = config.getoption("--results") if config is not None else None
    name = crashitem.rpartition("[")[2].rstrip("]") if crashitem.endswith("]") else ""
    if not results_dir or not name:
        return None
    found = next((d for d in _differentials(config) if d.test_id == name), None)
    if found is None:
        return None
    d = found.loaded.backend.declaration
    said = report.longreprtext.strip().splitlines()
    result = Result(found.test_id, d.id, found.arch, found.case, "ERROR",
                    reason=f"the pytest-xdist worker running it died ({said[-1] if said else 'no message'})")
    _recorder(config, results_dir).record(result, found.loaded)
    return None


_CONTROLLER: dict[str, pytest.Config] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    _CONTROLLER["config"] = session.config


TEST_GIB = 1.0
"""The share of GPU memory (GiB) a test that names no case runs with: most of the suite touches the
GPU lightly or not at all. One that holds more names its cases (a ``Case`` parameter, or the
``device_case`` mark); what an estimate misses, running out of memory beside others shows."""
RAN_AGAIN_ALONE = "ran again alone"
"""The user property of a test that ran out of device memory beside others and ran again alone."""
_LEDGER = pytest.StashKey[object]()
_RUN_ID = pytest.StashKey[str]()
_ALONE = pytest.StashKey[bool]()
_AGAIN = pytest.StashKey[list[str]]()


class OutOfMemoryBesideOthers(Exception):
    """A differential test's backend ran out of device memory while other tests held shares of
    its GPU: not a verdict, so nothing is recorded, and the test runs again alone."""


def _ledger(config: pytest.Config) -> object | None:
    """This xdist worker's GPU's ``Ledger``, or None where no workers share a device: not an xdist
    worker, a single worker, or a host without a GPU (unless ``--device-share`` is given)."""
    if _LEDGER not in config.stash:
        config.stash[_LEDGER] = None
        run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        share = config.getoption("--device-share")
        if run_id and workers > 1 and worker.startswith("gw") and worker[2:].isdigit():
            import torch

            from mxmoe.harness.contract.platforms import CONTEXT_GIB, DEVICE_SHARE
            from mxmoe.harness.run.ledger import Ledger

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if gpus or share is not None:
                gpu = int(worker[2:]) % max(gpus, 1)  # as pin_gpu pins it
                if share is None:
                    total = torch.cuda.get_device_properties(gpu).total_memory / (1 << 30)
                    share = DEVICE_SHARE * total - CONTEXT_GIB * len(range(gpu, workers, gpus))
                config.stash[_LEDGER] = Ledger.for_run(run_id, gpu, share)
    return config.stash[_LEDGER]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    """The controller notes the run's id (``testrunuid``, what its workers name their ledgers by)
    as each worker starts, so that it can remove the ledgers when the run ends."""
    node.config.stash[_RUN_ID] = node.workerinput["testrunuid"]


def pytest_unconfigure(config: pytest.Config) -> None:
    """In the controller of a pytest-xdist run, once its workers are gone: remove their ledgers."""
    if _RUN_ID in config.stash:
        from mxmoe.harness.run.ledger import remove_run

        remove_run(config.stash[_RUN_ID])


def _device_need(item: pytest.Item) -> float:
    """The share (GiB) ``item`` runs with: ``PEAK_MARGIN`` times ``case_gpu_gib`` of the largest
    case it runs on this host's device (a differential's on this host's arch, any ``Case``
    parameter, a ``device_case`` mark's cases), at least ``TEST_GIB``."""
    from mxmoe.harness.contract.platforms import PEAK_MARGIN, case_gpu_gib, host_arch

    cases = [case for mark in item.iter_markers("device_case") for case in mark.args]
    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec is not None else ()):
        if isinstance(value, Differential) and value.arch == host_arch():
            cases.append(value.case)
        elif isinstance(value, Case):
            cases.append(value)
    return max([TEST_GIB] + [PEAK_MARGIN * case_gpu_gib(case) for case in cases])


def _give_back_cache() -> None:
    import torch

    from mxmoe.harness.contract.platforms import CACHE_KEPT_GIB, free_device_memory

    if torch.cuda.is_available() and torch.cuda.memory_reserved() > CACHE_KEPT_GIB * (1 << 30):
        free_device_memory()


def _ran_out_of_memory(exc: BaseException) -> bool:
    from mxmoe.harness.contract.platforms import says_out_of_memory

    if isinstance(exc, OutOfMemoryBesideOthers):
        return True
    return isinstance(exc, (Exception, pytest.fail.Exception)) and says_out_of_memory(f"{type(exc).__name__}: {exc}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """Run the test on a share of its GPU (module docstring); once more alone if it ran out of
    device memory beside others, in a fresh ``tmp_path``."""
    ledger = _ledger(item.config)
    if ledger is None:
        return (yield)
    item.stash[_ALONE] = False
    try:
        with ledger.hold(_device_need(item)):
            try:
                return (yield)
            finally:
                _give_back_cache()
    except BaseException as exc:
        if not _ran_out_of_memory(exc):
            raise
        said = next((line for line in str(exc).splitlines() if "memory" in line.lower()), str(exc)[:200])
    item.user_properties.append((RAN_AGAIN_ALONE, said.strip()[:300]))
    note = f"out of device memory beside other tests' shares ({said.strip()}); ran again alone"
    item.add_report_section("call", "device memory", note)
    funcargs = getattr(item, "funcargs", {})
    if isinstance(funcargs.get("tmp_path"), os.PathLike):
        fresh = funcargs["tmp_path"].parent / (funcargs["tmp_path"].name + "-alone")
        fresh.mkdir()
        funcargs["tmp_path"] = fresh
    item.stash[_ALONE] = True
    with ledger.alone():
        try:
            return item.runtest()
        finally:
            _give_back_cache()


def _beside_others(item: pytest.Item) -> bool:
    """Whether ``item`` runs on a shared GPU and not alone (a run out of memory is then not its own)."""
    return _ledger(item.config) is not None and not item.stash.get(_ALONE, True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _CONTROLLER.get("config")
    if config is not None and report.when == "call":
        said = [value for key, value in report.user_properties if key == RAN_AGAIN_ALONE]
        if said:
            config.stash.setdefault(_AGAIN, []).append(f"{report.nodeid}: {said[0]}")


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    again = config.stash.get(_AGAIN, [])
    if again:
        terminalreporter.section("device memory")
        terminalreporter.write_line(f"{len(again)} test(s) ran out of device memory beside other tests' shares "
                                    "of their GPU and ran again alone (their outcome is that run's):")  # fmt: skip
        for line in again:
            terminalreporter.write_line(f"  {line}")


def _differentials(config: pytest.Config) -> list[Differential]:
    """Every differential test of this run: selected backend x declared arch x profile case."""
    cases = profile_cases(config.getoption("--profile"))
    return [
        Differential(item, arch, case)
        for item in selected_backends(config)
        for arch in item.backend.declaration.archs
        for case in cases
    ]


@pytest.fixture(scope="session")
def host_arch() -> str:
    """This host's architecture token (``sm90``, ``gfx942``, ``cpu``): tests of the engine run on
    the hardware they find, never on a hard-coded one, so the suite means the same on every host."""
    from mxmoe.harness.contract.platforms import host_arch as _host_arch

    return _host_arch()


@pytest.fixture(scope="session")
def host_device(host_arch: str) -> str:
    """The torch device of ``host_arch`` (``cuda`` on a GPU, ROCm's too; ``cpu`` without one)."""
    from mxmoe.harness.contract.platforms import device_for

    return device_for(host_arch)


@pytest.fixture(scope="session")
def profile(request: pytest.FixtureRequest) -> str:
    """The active profile's name, for tests that size their own sweeps."""
    return request.config.getoption("--profile")


def selected_backends(config: pytest.Config) -> list[Loaded]:
    """The backends this run checks (discovered once per process)."""
    if _SELECTED not in config.stash:
        try:
            loaded = discover(tuple(config.getoption("--backend-file")))
            chosen = select(loaded, tuple(config.getoption("--backend")))
            config.stash[_SELECTED] = with_tactics(chosen, config.getoption("--tactics"))
        except ValueError as exc:  # a pattern matching nothing, or two backends with one id
            raise pytest.UsageError(str(exc)) from None
    return config.stash[_SELECTED]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "differential" not in metafunc.fixturenames:
        return
    params = _differentials(metafunc.config)
    metafunc.parametrize("differential", params, ids=[p.test_id for p in params])


def replay_pytest_command(request: pytest.FixtureRequest, differential: Differential) -> str:
    """The pytest command that reruns exactly this test (a node id, not ``-k``: ``-k`` matches
    substrings, and ``...-t1`` is a substring of ``...-t16-wide``)."""
    config = request.config
    path = request.node.path
    try:
        path = path.relative_to(config.rootpath)
    except ValueError:
        pass
    node = f"{path.as_posix()}::{request.node.name}"
    args = ["python", "-m", "pytest", node, "--backend", differential.loaded.backend.declaration.id]
    if differential.loaded.spec.rpartition(":")[0].endswith(".py"):  # built-in and entry-point ones are found anyway
        args += ["--backend-file", differential.loaded.spec]
    profile = config.getoption("--profile")
    if profile != "pr":
        args += ["--profile", profile]
    return shlex.join(args)


def _recorder(config: pytest.Config, directory: str) -> object:
    """This process's Recorder: one results file per process, so xdist workers never interleave."""
    if _RECORDER not in config.stash:
        from mxmoe.harness.run.results import Recorder

        config.stash[_RECORDER] = Recorder(directory)
    return config.stash[_RECORDER]


def check_differential(differential: Differential, request: pytest.FixtureRequest) -> Result:
    """Run one differential test: ``engine.run_case``, record the verdict (with ``--results``), write
    a reproducer for FAIL/ERROR, then map the outcome to pytest (PASS returns the Result; SKIP,
    XFAIL, FAIL and ERROR raise through pytest)."""
    loaded = differential.loaded
    result, inputs = run_case(loaded.backend, differential.case, differential.arch, diagnose=summarize)
    if _beside_others(request.node):
        from mxmoe.harness.run.sweep import out_of_memory

        if out_of_memory(result):
            said = [line for line in (result.traceback or "").splitlines() if line.strip()]
            raise OutOfMemoryBesideOthers(f"{result.test_id}: {result.reason}: {said[-1] if said else ''}")
    results_dir = request.config.getoption("--results")
    replay = None
    if results_dir:
        from mxmoe.harness.run.results import replay_command, save_repro

        repro = None
        if result.outcome in ("FAIL", "ERROR") and inputs is not None:
            repro = save_repro(results_dir, result, inputs, loaded.spec)
            replay = replay_command(repro)
        _recorder(request.config, results_dir).record(result, loaded, repro)
    if replay is None:
        replay = replay_pytest_command(request, differential)
    if result.outcome == "SKIP":
        pytest.skip(result.reason)
    if result.outcome == "XFAIL":
        pytest.xfail(result.reason)
    if result.outcome in ("FAIL", "ERROR"):
        pytest.fail(failure_message(result, replay), pytrace=False)
    for finding in result.findings:
        request.node.add_report_section("call", "finding", finding)
    return result
