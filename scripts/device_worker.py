"""One long-lived Python process on the device machine that runs benchmark scripts one after another, in itself.

Every new process there compiles and autotunes its kernels again (fla's Triton autotuning, TileLang, FlashAttention-4's
CuTe DSL: 150-300 s before the first timed run, 2026-12-04), which took a third to a half of each 10-minute call.
Jobs run by one worker share what the first compiled. Each job is a script of the checkout with its arguments, run as
``__main__`` in the worker (its folder first on ``sys.path``, its folder as the working directory, its stdout and
stderr, Python's and the kernels' own, in ``DIR/NAME.log``); its exit status and seconds go to ``DIR/NAME.rc``. A job
that ends with ``sys.exit`` or ``os._exit`` ends itself, not the worker (``os._exit`` is turned into ``SystemExit``
while a job runs: the trainer benchmark ends that way to skip teardown, and took the worker and its queue with it).
Nothing of a finished job stays alive: its module's globals are cleared when it ends (libraries keep the ``__main__``
module of their first import: ``multiprocessing`` as ``sys.modules['__mp_main__']``, dill, which datasets imports, as
``dill._dill._main_module``; were it a job's, that job's globals, a trainer and its model among them, would stay for
the worker's life: 37 GiB of weights, gradients and AdamW states for the 2.3B preset). A job that raises, or leaves more
than ``LEFT_BEHIND_GIB`` of GPU memory allocated, makes the worker start afresh before the next job (``os.execv``: the
same pid, a new process; kernels compiled so far load from disk), and so does a job of its own process (``submit
--own-process``) after jobs that ran in the worker: the child gets the GPU memory the worker would otherwise hold.

    python3 scripts/device_worker.py start DIR                      # a detached worker serving DIR, if none is alive
    python3 scripts/device_worker.py submit DIR NAME SCRIPT [ARGS...]   # queue a job (a leading '--' is dropped);
                                                                     # `submit --own-process [--env K=V] DIR ...`: in a
                                                                     # child process (with K=V in its environment)
    python3 scripts/device_worker.py wait DIR --seconds 540         # until the queue is empty, the time is up or the
                                                                     # worker is gone (exit 0, 3 and 4)
    python3 scripts/device_worker.py stop DIR                       # the worker ends after the job in hand

The worker leaves after ``--idle`` seconds without a job (default 600). A job found running when ``start`` finds its
worker dead (a call's end that took the worker with it) gets rc ``lost`` and is not run again.
"""

import argparse
import contextlib
import fcntl
import gc
import json
import multiprocessing  # noqa: F401  (its import aliases __mp_main__ to the worker's __main__, not a job's module)
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_BEHIND_GIB = 1.0  # GPU memory a finished job may leave allocated before the worker starts afresh


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _worker_pid(folder: Path) -> int | None:
    path = folder / "worker.pid"
    if not path.exists():
        return None
    pid = int(path.read_text())
    return pid if _alive(pid) else None


def _queued(folder: Path) -> list[Path]:
    return sorted((folder / "queue").glob("*.json"))


def _running(folder: Path) -> list[Path]:
    return sorted((folder / "running").glob("*.json"))


@contextlib.contextmanager
def _output_to(log: Path):
    """File descriptors 1 and 2 (Python's streams and everything C code writes) into ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab", buffering=0) as handle:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _exit_the_job(code: int = 0):
    """``os._exit`` while a job runs in the worker: the job ends with that status, the worker goes on."""
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def _run_as_main(script: Path) -> None:
    """Run ``script`` as ``__main__`` (as ``python script`` would) in a module of its own, whose globals are cleared
    when it ends, whatever still holds the module."""
    module = types.ModuleType("__main__")
    module.__file__, module.__spec__, module.__builtins__ = str(script), None, __builtins__
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        exec(compile(script.read_bytes(), str(script), "exec"), module.__dict__)
    finally:
        sys.modules["__main__"] = saved
        module.__dict__.clear()


def run_job(folder: Path, job: dict) -> dict:
    """Run one job in this process (or, for ``own_process`` jobs, in a child); the record written to ``NAME.rc``."""
    script = (ROOT / job["script"]).resolve()
    start = time.perf_counter()
    with _output_to(folder / f"{job['name']}.log"):
        print(f"[device_worker] {job['script']} {' '.join(job['args'])}", flush=True)
        if job.get("own_process"):  # a script that cannot share a process (one that sets up torch.distributed, say)
            env = dict(os.environ, **dict(item.split("=", 1) for item in job.get("env", [])))
            rc = subprocess.run([sys.executable, str(script), *job["args"]], cwd=script.parent, env=env).returncode
            return dict(name=job["name"], rc=rc, seconds=round(time.perf_counter() - start, 2))
        argv, cwd, path = sys.argv, os.getcwd(), list(sys.path)
        sys.argv = [str(script), *job["args"]]
        sys.path.insert(0, str(script.parent))
        os.chdir(script.parent)
        hard_exit = os._exit
        os._exit = _exit_the_job
        raised = False
        try:
            _run_as_main(script)
            rc = 0
        except SystemExit as stop:
            rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):  # sys.exit("message"): the message, as Python prints it
                print(stop.code, file=sys.stderr, flush=True)
        except BaseException:  # a job's failure (out of memory included) is its own, not the worker's
            traceback.print_exc()
            traceback.clear_frames(sys.exc_info()[2])  # the failed job's locals (a trainer, its model) let go
            rc, raised = 1, True
        finally:
            os._exit = hard_exit
            sys.argv, sys.path[:] = argv, path
            os.chdir(cwd)
    gc.collect()
    record = dict(name=job["name"], rc=rc, seconds=round(time.perf_counter() - start, 2))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()  # the next job starts with the memory this one held given back
            record["cuda_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)  # left behind by the job
            record["cuda_reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 3)  # kept by torch's allocator
            free, total = torch.cuda.mem_get_info()
            record["device_used_gib"] = round((total - free) / 2**30, 3)  # by every process on the card
        except Exception as error:  # a sticky CUDA error (an illegal memory access): this process is done for
            record["cuda_error"] = str(error).split("\n")[0]
            raised = True
    # a job that raised or left GPU memory behind may hold anything (2026-12-05: a trainer's 37 GiB after its
    # out-of-memory error, and the three jobs after it failed at once): serve() starts the worker afresh
    if raised or record.get("cuda_allocated_gib", 0) > LEFT_BEHIND_GIB:
        record["worker_restarted"] = True
    return record


def _afresh(folder: Path, idle: float) -> None:
    """Replace this process with a new worker serving ``folder`` (``os.execv``: the same pid, nothing of this one)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), "serve", str(folder), "--idle", str(idle)])


def serve(folder: Path, idle: float) -> None:
    (folder / "worker.pid").write_text(str(os.getpid()))
    last = time.monotonic()
    ran_here = False  # whether a job has run in this process (and may hold GPU memory a child process would lack)
    while not (folder / "stop").exists():
        queued = _queued(folder)
        if not queued:
            if time.monotonic() - last > idle:
                break
            time.sleep(0.5)
            continue
        running = folder / "running" / queued[0].name
        queued[0].rename(running)
        job = json.loads(running.read_text())
        if job.get("own_process") and ran_here:
            # a child process gets only the GPU memory this one does not hold; after a job here that is more than the
            # allocator's cache (2026-12-05, H100: the worker still held 8.45 GiB after its jobs had left 0.06 GiB
            # allocated, and the three child jobs after them ran out of memory): back to the queue, and afresh
            running.rename(folder / "queue" / running.name)
            print(f"worker starts afresh before {job['name']}, a job of its own process", flush=True)
            _afresh(folder, idle)
        record = run_job(folder, job)
        ran_here = ran_here or not job.get("own_process")
        (folder / f"{job['name']}.rc").write_text(json.dumps(record) + "\n")
        running.unlink()
        print(json.dumps(record), flush=True)
        last = time.monotonic()
        if record.get("worker_restarted"):
            _afresh(folder, idle)
    (folder / "worker.pid").unlink(missing_ok=True)


def start(folder: Path, idle: float) -> None:
    for sub in ("queue", "running"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    pid = _worker_pid(folder)
    if pid is not None:
        print(f"worker {pid} is serving {folder}")
        return
    for lost in _running(folder):  # its worker died with it
        name = json.loads(lost.read_text())["name"]
        (folder / f"{name}.rc").write_text(json.dumps(dict(name=name, rc="lost")) + "\n")
        lost.unlink()
        print(f"job {name}: lost with its worker")
    (folder / "stop").unlink(missing_ok=True)
    with open(folder / "worker.log", "ab") as log:
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "serve", str(folder), "--idle",
                                  str(idle)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, cwd=ROOT)
    for _ in range(100):  # the pid file says the worker runs
        if (folder / "worker.pid").exists():
            break
        time.sleep(0.05)
    print(f"worker {child.pid} started, serving {folder}")


def submit(folder: Path, name: str, script: str, args: list[str], own_process: bool = False,
           env: list[str] = ()) -> None:
    if not name or not all(c.isalnum() or c in "._-" for c in name):
        raise SystemExit(f"submit: job name {name!r} must be letters, digits, '.', '_' or '-' (it names DIR/NAME.log)")
    if not (ROOT / script).is_file():
        raise SystemExit(f"submit: no script {script!r} under {ROOT} (give its path from the checkout's root)")
    if env and not own_process:
        raise SystemExit("submit: --env sets a child's environment; add --own-process (a job in the worker shares its "
                         "environment)")
    if any("=" not in item or not item.split("=", 1)[0] for item in env):
        raise SystemExit(f"submit: --env takes NAME=VALUE, got {list(env)}")
    (folder / "queue").mkdir(parents=True, exist_ok=True)
    job = dict(name=name, script=script, args=args[1:] if args[:1] == ["--"] else args, own_process=own_process,
               env=list(env))
    # Numbers and names come from a ledger of every submission, read and extended under a lock: counting the files in
    # queue/, running/ and *.rc raced the worker moving a job between them (2026-12-07 CI: a job counted in neither
    # place took an earlier job's number, and the two ran in the order of their names, not of their submission)
    with open(folder / "submitted.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ledger = folder / "submitted"
        names = ledger.read_text().split() if ledger.exists() else []
        if name in names:
            raise SystemExit(f"submit: a job named {name!r} was already submitted to {folder}; pick another name")
        staged = folder / "queue" / f"{len(names):04d}-{name}.staged"  # whole before the worker can see it
        staged.write_text(json.dumps(job))
        staged.rename(staged.with_suffix(".json"))
        with open(ledger, "a") as handle:
            handle.write(name + "\n")
    print(f"queued {name}: {script} {' '.join(job['args'])}")


def wait(folder: Path, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    seen = set()  # every finished job's record, those finished before this call included
    while True:
        for path in sorted(folder.glob("*.rc")):
            if path.name not in seen:
                seen.add(path.name)
                print(path.read_text().strip(), flush=True)
        pending = _queued(folder) + _running(folder)
        if not pending:
            return 0
        if _worker_pid(folder) is None:
            print(f"the worker is gone; {len(pending)} jobs not finished: {', '.join(p.stem for p in pending)}")
            return 4
        if time.monotonic() > deadline:
            print(f"time is up; {len(pending)} jobs not finished: {', '.join(p.stem for p in pending)}")
            return 3
        time.sleep(1.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    for verb in ("start", "serve"):
        sub = verbs.add_parser(verb)
        sub.add_argument("folder", type=Path)
        sub.add_argument("--idle", type=float, default=600.0, help="seconds without a job before the worker leaves")
    sub = verbs.add_parser("submit")
    sub.add_argument("--own-process", action="store_true", help="run the job in a process of its own")
    sub.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="with --own-process: set in the child's environment (repeatable)")
    sub.add_argument("folder", type=Path)
    sub.add_argument("name")
    sub.add_argument("script", help="the script's path from the checkout's root")
    sub.add_argument("args", nargs=argparse.REMAINDER)
    sub = verbs.add_parser("wait")
    sub.add_argument("folder", type=Path)
    sub.add_argument("--seconds", type=float, default=540.0, help="at most this long")
    verbs.add_parser("stop").add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    folder = args.folder.resolve()
    if args.verb == "start":
        start(folder, args.idle)
    elif args.verb == "serve":
        serve(folder, args.idle)
    elif args.verb == "submit":
        submit(folder, args.name, args.script, args.args, args.own_process, args.env)
    elif args.verb == "wait":
        return wait(folder, args.seconds)
    else:
        (folder / "stop").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
