"""Ray, where RL trainers run FSDP2: plain actors in verl's worker order (OpenRLHF, SkyRL and
NeMo-RL start theirs the same way) and Ray Train's ``TorchTrainer``. The examples in
examples/ray/ run here for real, in one Ray session (2 CPUs, gloo, a 100 MB object store), each
clean (``consistent``, exit 0 on every rank) and with rank 1 built with another rope_theta (one
``config`` finding naming rank 1), and their first update under ``check_step`` consistent. The
same actors then meet a stuck peer and a dead one: the other returns exit 3 naming it within the
check's timeout, and no actor is ended by fsdpcheck. What is compared is the user's program:
Ray's own worker arguments (``--worker-id=…``) are no difference between ranks
(docs/checks.md)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from types import ModuleType

import pytest
import ray
from conftest import QUIET_ENV, REPO

EXAMPLES = REPO / "examples" / "ray"
# TorchTrainer.fit takes no timeout of its own. Ray Train starts five actor processes before its
# workers train: this fixture took 18 s on a quiet 2-core machine, 291 s beside
# `tests/workers/hog.py --cpus 1 --mib 512` (measured; 240 s was too short there).
FIT_TIMEOUT = 600.0
TIMEOUT = 5.0  # the fault cases' checks; the stuck actor is late by twice that


def _example(name: str) -> ModuleType:
    """An example file as a module; its functions and actor classes travel to Ray's workers by
    value (the examples folder is no package the workers could import)."""
    module_name = f"fsdpcheck_example_{name.removesuffix('.py')}"
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # cloudpickle pickles by value only what is imported
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory):
    """One local Ray for the module, its temp dir under pytest's; always shut down. Workers
    inherit this environment: no PYTHONHASHSEED, as Ray users run."""
    temp = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as env:
        for key, value in {
            **QUIET_ENV,
            "OMP_NUM_THREADS": "1",
            "RAY_AUTH_MODE": "disabled",  # no token written to ~/.ray
            "RAY_USAGE_STATS_ENABLED": "0",
            # one actor fewer to start: no node here is ever drained
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
            # Ray's 60 s default restarts a worker group that starts slowly on a loaded machine
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600",
        }.items():
            env.setenv(key, value)
        env.delenv("PYTHONHASHSEED", raising=False)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=100 * 1024**2,
            _temp_dir=str(temp),
        )
        try:
            yield temp
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def actors(ray_session) -> dict[str, list[dict]]:
    """examples/ray/verl_actors.py: one pair of actors, one process group, four checks in turn:
    clean, rank 1's other rope_theta, rank 1 stuck, rank 1 dead (last: its group is gone)."""
    example = _example("verl_actors.py")
    workers = example.start_workers(2)
    try:
        runs = {"clean": example.check(workers), "rank-1-rope": example.check(workers, 1)}
        runs["rank-1-stuck"] = example.check(workers, stall_rank=1, timeout=TIMEOUT)
        # both answer afterwards (no os._exit, no ActorDiedError), in the processes that checked
        runs["pids-after-stuck"] = ray.get([w.pid.remote() for w in workers], timeout=30)
        runs["rank-1-dies"] = example.check(workers, die_rank=1, timeout=TIMEOUT)
        runs["pid-after-death"] = ray.get(workers[0].pid.remote(), timeout=30)
        return runs
    finally:
        example.stop_workers(workers)


@pytest.fixture(scope="module")
def trained(ray_session, actors) -> list[list[dict]]:
    """examples/ray/torch_trainer.py: one fit of 2 CPU workers, the clean check then rank 1's
    other rope_theta. After the actors (they hold the session's 2 CPUs until killed)."""
    example = _example("torch_trainer.py")
    done: dict = {}

    def fit() -> None:
        try:
            done["ranks"] = example.fit(ray_session / "out", [None, 1], ray_session / "storage")
        except BaseException as exc:  # handed to the test thread
            done["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    thread.join(FIT_TIMEOUT)
    assert not thread.is_alive(), f"TorchTrainer.fit still running after {FIT_TIMEOUT}s"
    if "error" in done:
        raise done["error"]
    return done["ranks"]


def _assert_clean(ranks: list[dict]) -> None:
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks[0]["findings"]
    assert ranks[0]["verdict"] == "consistent" and ranks[0]["findings"] == []
    assert all(r["headline"] == "all 2 ranks consistent" for r in ranks), ranks


def _assert_rope_on_rank_1(ranks: list[dict]) -> None:
    assert [r["exit_code"] for r in ranks] == [1, 1], ranks
    assert ranks[0]["verdict"] == "inconsistent"
    [config] = [f for f in ranks[0]["findings"] if f["kind"] == "config"]
    assert config["ranks"] == [1]
    assert "rope_theta: 10000.0 on rank 0, 20000.0 on rank 1" in config["summary"]
    assert "launch" not in {f["kind"] for f in ranks[0]["findings"]}


def test_verl_style_actors_are_consistent_and_their_first_update_too(actors) -> None:
    clean = actors["clean"]
    _assert_clean(clean)
    steps = [r["step"] for r in clean]
    assert [s["exit_code"] for s in steps] == [0, 0], steps[0]
    assert steps[0]["verdict"] == "consistent" and steps[0]["findings"] == []


def test_a_verl_style_actor_built_with_another_rope_theta_is_found(actors) -> None:
    broken = actors["rank-1-rope"]
    _assert_rope_on_rank_1(broken)
    assert [r["step"] for r in broken] == [None, None]  # no update after a failed check


def test_a_stuck_verl_style_actor_is_named_and_every_actor_lives_on(actors) -> None:
    alive, stuck = actors["rank-1-stuck"]
    # Within the check's timeout (and well before the stuck actor is back at 2x it).
    assert alive["exit_code"] == 3 and alive["seconds"] < 2 * TIMEOUT, alive
    assert "rank 1 never arrived" in alive["headline"], alive
    assert alive["verdict"] == "error" and alive["step"] is None, alive
    # Back after the others gave up, it is told so at once and returns the same conclusion.
    assert stuck["exit_code"] == 3 and "rank 1 never arrived" in stuck["headline"], stuck
    assert stuck["seconds"] < TIMEOUT, stuck
    assert actors["pids-after-stuck"] == [alive["pid"], stuck["pid"]]


def test_a_verl_style_actor_that_dies_before_its_check_is_named(actors) -> None:
    alive, dead = actors["rank-1-dies"]
    assert dead is None  # its call raised ActorDiedError
    assert alive["exit_code"] == 3 and alive["seconds"] < 2 * TIMEOUT, alive
    assert "rank 1 never arrived" in alive["headline"], alive
    assert actors["pid-after-death"] == alive["pid"]  # the survivor's process lives on


def test_torch_trainer_workers_are_consistent(trained) -> None:
    _assert_clean([checks[0] for checks in trained])


def test_a_torch_trainer_first_update_under_check_step_is_consistent(trained) -> None:
    steps = [checks[0]["step"] for checks in trained]
    assert [s["exit_code"] for s in steps] == [0, 0], steps[0]
    assert steps[0]["verdict"] == "consistent" and steps[0]["findings"] == [], steps[0]
    assert [checks[1]["step"] for checks in trained] == [None, None]  # no update after a failure


def test_a_torch_trainer_worker_built_with_another_rope_theta_is_found(trained) -> None:
    _assert_rope_on_rank_1([checks[1] for checks in trained])


def test_ray_workers_hash_randomly_unless_a_runtime_env_sets_the_seed(ray_session) -> None:
    """What docs/ray.md says: no seed from Ray itself; one from ``runtime_env`` reaches the
    interpreter (hash randomisation off)."""

    @ray.remote(num_cpus=0)
    def hashing() -> tuple:
        import os

        return os.environ.get("PYTHONHASHSEED"), sys.flags.hash_randomization

    assert ray.get(hashing.remote(), timeout=120) == (None, 1)
    seeded = hashing.options(runtime_env={"env_vars": {"PYTHONHASHSEED": "0"}})
    assert ray.get(seeded.remote(), timeout=120) == ("0", 0)


def test_every_example_here_is_run_by_this_module() -> None:
    """So the examples cannot rot: a new file in examples/ray/ needs a test here."""
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == ["torch_trainer.py", "verl_actors.py"]
