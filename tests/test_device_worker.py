"""scripts/device_worker.py: jobs run one after another in ONE detached process (what lets the device machine's
later jobs reuse the kernels the first compiled), each with its own log and exit status."""

import json
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "device_worker.py"

JOB = '''
import os, sys
state = sys.modules.setdefault("_device_worker_test_state", type(sys)("_device_worker_test_state"))
state.runs = getattr(state, "runs", 0) + 1
print("run", state.runs, "pid", os.getpid(), "args", " ".join(sys.argv[1:]), "cwd", os.getcwd(),
      "env", os.environ.get("DEVICE_WORKER_TEST", "unset"))
os.write(2, b"written to file descriptor 2\\n")
if "raise" in sys.argv:
    raise RuntimeError("the job failed")
if "exit" in sys.argv:
    sys.exit(5)
if "refuse" in sys.argv:
    sys.exit("this job needs CUDA")
if "hold" in sys.argv:  # a module global of this job, and __mp_main__ made to point at this job's module
    import weakref
    class Held:
        pass
    held = Held()
    state.held = weakref.ref(held)
    sys.modules["__mp_main__"] = sys.modules["__main__"]
    state.main_module = sys.modules["__main__"]  # as dill keeps the __main__ of its first import
if "check" in sys.argv:
    import gc
    gc.collect()
    print("held alive", state.held() is not None)
if "hard_exit" in sys.argv:
    print("leaving hard", flush=True)
    os._exit(7)
'''


def _worker(*args, check=True):
    return subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True,
                          check=check, timeout=300)


def test_jobs_share_one_process_and_keep_their_own_logs_and_status(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    queue = tmp_path / "queue_dir"
    _worker("start", queue, "--idle", 120)
    try:
        for name, mode in [("first", "ok"), ("hard", "hard_exit"), ("second", "ok"), ("fails", "raise"),
                           ("exits", "exit"), ("refuses", "refuse"), ("holds", "hold"), ("checks", "check")]:
            _worker("submit", queue, name, script, "--", mode, "--flag", 1)
        _worker("submit", "--own-process", "--env", "DEVICE_WORKER_TEST=set", queue, "alone", script, "exit")
        _worker("submit", queue, "after", script, "ok")
        refused = _worker("submit", queue, "first", script, check=False)
        assert refused.returncode != 0 and "already submitted" in refused.stderr
        waited = _worker("wait", queue, "--seconds", 240)
        assert waited.returncode == 0, waited.stdout + waited.stderr
        records = {r["name"]: r for r in map(json.loads, waited.stdout.splitlines())}
        statuses = {name: record["rc"] for name, record in records.items()}
        # os._exit ends the job with its status, not the worker: the jobs after it ran in the same process
        assert statuses == {"first": 0, "hard": 7, "second": 0, "fails": 1, "exits": 5, "refuses": 1, "holds": 0,
                            "checks": 0, "alone": 5, "after": 0}
        assert "held alive False" in (queue / "checks.log").read_text()  # nothing of a finished job stays alive
        logs = {name: (queue / f"{name}.log").read_text() for name in records}
        assert "run 1 " in logs["first"]  # each later job saw the earlier ones' state
        pids = {name: log.split(" pid ")[1].split()[0] for name, log in logs.items()}
        assert len({pids[name] for name in ("first", "hard", "second", "fails", "exits")}) == 1  # one process, all
        assert "leaving hard" in logs["hard"] and "run 2 " in logs["hard"] and "run 3 " in logs["second"]
        # a job that raised may have left anything alive: the worker starts afresh (same pid, a new process image)
        assert "run 4 " in logs["fails"] and "run 1 " in logs["exits"] and "run 3 " in logs["holds"]
        assert records["fails"].get("worker_restarted") and not records["exits"].get("worker_restarted")
        assert pids["alone"] != pids["first"] and "run 1 " in logs["alone"]  # a process of its own
        assert "env set" in logs["alone"] and "env unset" in logs["first"]
        # before a job of its own process, a worker that ran jobs itself starts afresh (the GPU memory it holds goes)
        assert "run 1 " in logs["after"] and pids["after"] == pids["first"]
        assert "starts afresh before alone" in (queue / "worker.log").read_text()
        assert "args ok --flag 1" in logs["first"] and f"cwd {tmp_path}" in logs["first"]
        assert all("written to file descriptor 2" in log for log in logs.values())
        assert "RuntimeError: the job failed" in logs["fails"]
        assert "this job needs CUDA" in logs["refuses"]  # sys.exit's message, which Python itself would print
    finally:
        _worker("stop", queue)
    for _ in range(600):  # it leaves after the job in hand
        if not (queue / "worker.pid").exists():
            break
        time.sleep(0.1)
    assert not (queue / "worker.pid").exists()


def test_a_job_whose_worker_died_is_reported_lost_not_rerun(tmp_path):
    queue = tmp_path / "queue_dir"
    (queue / "running").mkdir(parents=True)
    (queue / "running" / "0000-orphan.json").write_text(json.dumps(dict(name="orphan", script="x.py", args=[])))
    (queue / "worker.pid").write_text("999999999")  # no such process
    started = _worker("start", queue, "--idle", 1)
    assert "orphan: lost" in started.stdout
    assert json.loads((queue / "orphan.rc").read_text())["rc"] == "lost"
    assert not list((queue / "running").iterdir())


def test_submit_names_what_is_wrong(tmp_path):
    bad_name = _worker("submit", tmp_path, "a/b", WORKER, check=False)
    assert bad_name.returncode != 0 and "job name 'a/b'" in bad_name.stderr
    no_script = _worker("submit", tmp_path, "job", tmp_path / "missing.py", check=False)
    assert no_script.returncode != 0 and "no script" in no_script.stderr
    shared_env = _worker("submit", "--env", "A=1", tmp_path, "job", WORKER, check=False)
    assert shared_env.returncode != 0 and "--own-process" in shared_env.stderr


def test_jobs_keep_their_submission_order_whatever_state_the_earlier_ones_are_in(tmp_path):
    """The queue's numbers come from the submissions, not from counting files the worker moves: a job between
    ``running/`` and its ``.rc`` (counted in neither) no longer hands its number to the next submission."""
    queue = tmp_path / "queue_dir"
    for name in ("zeta", "alpha", "mid"):
        _worker("submit", queue, name, WORKER)
    for path in (queue / "queue").glob("*.json"):  # as if the worker had taken them and not yet written their status
        path.unlink()
    _worker("submit", queue, "beta", WORKER)
    assert [p.name for p in (queue / "queue").iterdir()] == ["0003-beta.json"]
    again = _worker("submit", queue, "zeta", WORKER, check=False)
    assert again.returncode != 0 and "already submitted" in again.stderr
