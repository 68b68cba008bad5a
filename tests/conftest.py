"""Shared test setup: service markers skip locally when a service is missing, fail under CI=true."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from deploy.ray_head import serve_env

IN_CI = os.environ.get("CI", "").lower() == "true"

# Triton kernels run in Triton's CPU interpreter when there is no GPU. The flag is read when a
# kernel is decorated, so it must be set before any ``kernels.*`` module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist each worker's torch (and the commands and Rays it starts) gets its share of
# the cores: every worker using every core would spin its threads against the others'.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# On a GPU, tuning every kernel for every test shape would compile each config for each of them
# (minutes); tests run the first config, and the kernel tests check every config separately.
os.environ.setdefault("TIDE_AUTOTUNE", "0")
os.environ.update(serve_env())  # the Rays the tests start in this process (tide up gives its own)


def _agent_token_file() -> str:
    """The cache agents' token for the apps the tests deploy (a deploy names one, as tide up's
    does; a 0600 file removed when this process ends)."""
    import atexit
    import secrets
    import tempfile

    fd, path = tempfile.mkstemp(prefix="tide-test-agent-", suffix=".token")
    os.write(fd, secrets.token_urlsafe(32).encode())
    os.close(fd)
    atexit.register(os.unlink, path)
    return path


os.environ.setdefault("TIDE_AGENT_TOKEN_FILE", _agent_token_file())


def require(condition: bool, why: str) -> None:
    """Skip (locally) or fail (CI=true) when a needed service is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{why} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(why)


@pytest.fixture(autouse=True)
def _services_for_markers(request):
    if request.node.get_closest_marker("redis"):
        require(shutil.which("redis-server") is not None, "redis-server is not installed")
    if request.node.get_closest_marker("ray"):
        try:
            import ray  # noqa: F401
        except ImportError:
            require(False, "ray is not installed")
    if request.node.get_closest_marker("gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server for the module (killed at its end)."""
    from deploy.redis_proc import RedisServer

    require(shutil.which("redis-server") is not None, "redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A real Redis Cluster for the module: three primaries with a replica each (killed at its end)."""
    from deploy.redis_proc import RedisClusterServer

    require(shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None,
            "redis-server / redis-cli are not installed")
    cluster = RedisClusterServer(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.kill()


# The groups of modules on a shared Ray (tests/shared_ray.py): group -> (the Ray's fixture, its
# modules). A group runs whole, in a row, in one process, so the Ray starts once per process. Listed
# here, not found from the fixtures, because xdist's scheduler sees node ids alone; collection
# checks that every module using a shared Ray is in one of its groups.
SHARED_RAY_GROUPS = {
    "three_nodes": ("three_nodes", ("tests/actors/test_cache_agents.py", "tests/actors/test_ep.py",
                                    "tests/actors/test_tidal_ep.py", "tests/actors/test_faults.py",
                                    "tests/actors/test_tidal.py", "tests/actors/test_tidal_pd.py",
                                    "tests/deploy/test_sim_cluster.py")),
    "local_ray": ("local_ray", ("tests/actors/test_cache_agent_secure_redis.py", "tests/actors/test_pd_handoff.py",
                                "tests/deploy/test_connect.py", "tests/deploy/test_current_families_app.py",
                                "tests/deploy/test_api_fuzz.py", "tests/deploy/test_deepseek_api.py",
                                "tests/deploy/test_openai_app.py", "tests/deploy/test_pd_app.py")),
    # one `tide up` process (its own Ray, the default model), as a user starts it
    "tide_up": ("tide_up", ("tests/deploy/test_clients.py", "tests/deploy/test_hostile_neighbour.py",
                            "tests/deploy/test_bench_batch.py")),
}
_GROUP_OF = {module: group for group, (_, modules) in SHARED_RAY_GROUPS.items() for module in modules}
_ON_SHARED_RAY = {module: SHARED_RAY_GROUPS[group][0] for module, group in _GROUP_OF.items()}
# Each group's seconds in a whole run here, to start the longest groups first; refreshed by
# running the suite with TIDE_GROUP_SECONDS_OUT=tests/group_seconds.json. A group missing from it
# is guessed from its tests' marks.
GROUP_SECONDS = Path(__file__).with_name("group_seconds.json")
_GUESS_S = {"ray": 15.0, "slow": 5.0}


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _group(nodeid: str) -> str:
    """The tests that run together, in a row and in one process: a module's, or all the modules'
    on one shared Ray (so it starts once per process)."""
    return _GROUP_OF.get(_module(nodeid), _module(nodeid))


def _guess(item) -> float:
    return max([s for m, s in _GUESS_S.items() if item.get_closest_marker(m)], default=0.1)


def pytest_collection_modifyitems(config, items):
    """Tests run by group (``_group``), the longest groups first: one process runs each shared
    Ray's modules in a row, and under pytest-xdist (``-n N``, as ``scripts/test.sh`` runs) a
    group goes to one worker whole while the long ones start early."""
    for item in items:
        module = _module(item.nodeid)
        for name in {ray for ray, _ in SHARED_RAY_GROUPS.values()}:
            if name in item.fixturenames and _ON_SHARED_RAY.get(module) != name:
                raise pytest.UsageError(f"{module} uses the shared Ray {name!r}: list it in a group of that "
                                        "Ray in tests/conftest.py's SHARED_RAY_GROUPS")
    ids = [item.nodeid for item in items]
    if len(set(ids)) != len(ids):  # xdist tracks tests by id: all but one of each would not run
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise pytest.UsageError(f"tests share a node id (a plugin's ids on this pytest?): {twice[:5]}")
    known = json.loads(GROUP_SECONDS.read_text()) if GROUP_SECONDS.is_file() else {}
    guessed: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        group = _group(item.nodeid)
        guessed[group] = guessed.get(group, 0.0) + _guess(item)
        first.setdefault(group, i)
    cost = {group: known.get(group, s) for group, s in guessed.items()}
    items.sort(key=lambda item: (-cost[_group(item.nodeid)], first[_group(item.nodeid)]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N``: whole groups (``_group``) to a worker, in the order collection left them
    (the longest first). xdist's own ``loadgroup`` needs marks it cannot read on pytest 9.2."""
    if config.getoption("dist") not in ("load", "loadgroup"):
        return None  # --dist loadfile, each, ...: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False
    return ByGroup(config, log)


_SPENT: dict[str, float] = {}  # group -> seconds its tests took in this run


def pytest_runtest_logreport(report):
    group = _group(report.nodeid)
    _SPENT[group] = _SPENT.get(group, 0.0) + report.duration


def pytest_sessionfinish(session):
    out = os.environ.get("TIDE_GROUP_SECONDS_OUT")
    if out and not hasattr(session.config, "workerinput"):  # the run's one process or xdist's controller
        spent = dict(sorted(((g, round(s, 1)) for g, s in _SPENT.items()), key=lambda kv: -kv[1]))
        Path(out).write_text(json.dumps(spent, indent=1) + "\n")


@pytest.fixture(scope="session")
def _shared_rays(tmp_path_factory):
    from tests.shared_ray import SharedRay, stop_shared

    home = tmp_path_factory.mktemp("shared-ray-home")
    yield {"local_ray": SharedRay(home, nodes=1), "three_nodes": SharedRay(home, nodes=3)}
    stop_shared()


@pytest.fixture(scope="module")
def local_ray(_shared_rays):
    """This run's one-node Ray (2 CPUs; ``tests/shared_ray.py``), shared with the other modules
    that use it and reset when the module ends: Serve and every named actor removed."""
    shared = _shared_rays["local_ray"]
    shared.acquire()
    yield shared
    shared.reset()


@pytest.fixture(scope="module")
def three_nodes(_shared_rays):
    """This run's three simulated nodes (one CPU, resource ``node{i}`` and pod name
    ``tests.shared_ray.pod_name(i)`` each; ``.cluster``), shared like ``local_ray``: a worker
    node a module removed or added is put back or removed when the module ends."""
    shared = _shared_rays["three_nodes"]
    shared.acquire()
    yield shared
    shared.reset()


# the keys of the `tide up` cluster the client libraries and the hostile-neighbour tenants use
TIDE_UP_KEYS = {"sk-client": "clients", "sk-bench-hostile": "hostile", "sk-bench-neighbour": "neighbour"}


@pytest.fixture(scope="session")
def tide_up(tmp_path_factory):
    """A `tide up` cluster serving the default model with ``tide up``'s defaults and the keys of
    ``TIDE_UP_KEYS``, started as a user starts it (a child process, its own HOME and TIDE_HOME)
    by the first module of group ``tide_up`` and taken down with `tide down` at the end: its
    base URL."""
    from deploy.redis_proc import free_port
    from tests.cli import tide

    home = tmp_path_factory.mktemp("tide-up")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TIDE_"))}
    env.update(HOME=str(home / "home"), TIDE_HOME=str(home))
    port = free_port()
    keys = [arg for key, tenant in TIDE_UP_KEYS.items() for arg in ("--api-key", f"{key}:{tenant}")]
    up = tide("up", "--port", str(port), *keys, env=env, replace_env=True)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        yield f"http://127.0.0.1:{port}"
    finally:
        down = tide("down", env=env, replace_env=True)
        assert down.returncode == 0, down.stderr[-3000:]


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_initialized(request):
    """A module whose Ray fixture failed half-way must not leave Ray initialized in this process:
    every later module's ``ray.init`` would fail with "called ray.init twice". A module that
    starts its own Ray (or none) begins without a shared one."""
    own = _module(request.node.nodeid) not in _ON_SHARED_RAY
    if own:
        _stop_ray()
    yield
    if own:
        _stop_ray()


def _stop_ray() -> None:
    from tests.shared_ray import stop_shared

    stop_shared()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
