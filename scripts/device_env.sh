# Sourced at the start of every command on the H200 (the device tool's `run`), from the checkout's root:
#
#   source scripts/device_env.sh && cd benchmarks && python3 plan_memory_probe.py ... --out $W/name; cd ..; finish
#
# The first call on a machine carries the archives (`carry`: .device/site.tar.xz from ../shared/device/make-bundle.sh,
# and, where needed, .device/tf.tar.xz or .device/liger.tar.xz from scripts/device_extras.sh); they are extracted
# once into .device/site, .device/tf524 and .device/liger, which stay on a warm machine, so later calls carry nothing
# (a fresh machine needs them again). PYTHONPATH then holds the checkout, the bundle and liger-kernel where carried;
# `PYTHONPATH=$TF524:$PYTHONPATH` puts transformers 5.24 first (bailing_hybrid). Results go under $W; `finish` packs
# $W into $OUT/results.tgz (the tool returns at most 8 files) with the size of Triton's cache beside them.
# The open measurements: scripts/device_jobs.sh (its header says how to call it).
# FlashAttention-4 (`--kernels fused_fa4`): a fresh machine's first call carries .device/fa4libs.tar.xz alone (this
# script unpacks it and ends the command), the next carries the bundle and .device/fa4rest.tar.xz; both then stay in
# .device/fa4x and are on PYTHONPATH. A machine released when idle (30 s)
# comes back bare: the `warm` field of each call's answer says whether the archives must travel again.
# A fresh machine's first process compiles and autotunes for 150-300 s before its first timed run (fla's Triton
# autotuning, TileLang, FlashAttention-4's CuTe DSL), and every later process with new shapes pays part of it again
# (144 s for the first full-size `swe` packed call, 2026-12-03): run a call's measurements in ONE process
# (`step --workload distinct tau:0.02 ...`) and give it most of the call's time.
# Compiled kernels: Triton's cache (compiled binaries, their metadata and autotuning results; the intermediate
# representations left out), TileLang's and FlashAttention-4's come back with `save_caches` as $OUT/kernels.tar.xz.aa,
# .ab, ... (15 MiB parts: the tool returns files of at most 16 MiB). Copied into .device/kernels/ and carried by a
# later call (`carry: [".device/kernels"]`, on its own: the bundle and the parts together exceed 64 MiB), they are
# unpacked into ~ before anything compiles, so that machine loads the kernels instead of compiling and autotuning
# them again.
for pair in site:site.tar.xz tf524:tf.tar.xz liger:liger.tar.xz; do
  dir=.device/${pair%%:*}; archive=.device/${pair#*:}
  if [ ! -f "$dir/.ok" ] && [ -f "$archive" ]; then
    mkdir -p "$dir" && tar -C "$dir" -xJf "$archive" && touch "$dir/.ok"
  fi
done
# FlashAttention-4's stack (scripts/device_extras.sh): fa4libs.tar.xz (61 MiB) in two halves, .aa and .ab (with the
# checkout, 61 MiB no longer fits one call's 64 MiB): .aa alone in a first call, .ab beside fa4rest.tar.xz in the next
# (a carried file stays on a warm machine, so .aa is still there), then the bundle; everything unpacks into
# .device/fa4x, which stays on a warm machine
if [ ! -f .device/fa4x/.fa4libs ] && compgen -G ".device/fa4libs.tar.xz.a?" > /dev/null; then
  if [ ! -f .device/fa4libs.tar.xz.ab ]; then
    echo "have .device/fa4libs.tar.xz.aa; carry .device/fa4libs.tar.xz.ab and .device/fa4rest.tar.xz next"; exit 0
  fi
  mkdir -p .device/fa4x && cat .device/fa4libs.tar.xz.a? | tar -C .device/fa4x -xJf - && touch .device/fa4x/.fa4libs
fi
for part in fa4libs fa4rest; do
  if [ ! -f ".device/fa4x/.$part" ] && [ -f ".device/$part.tar.xz" ]; then
    mkdir -p .device/fa4x && tar -C .device/fa4x -xJf ".device/$part.tar.xz" && touch ".device/fa4x/.$part"
  fi
done
if [ -f .device/fa4x/.fa4libs ] && [ ! -f .device/site.tar.xz ] && [ ! -f .device/site/.ok ]; then
  echo "unpacked FlashAttention-4's libraries; carry .device/site.tar.xz next"; exit 0
fi
[ -f .device/site/.ok ] || { echo "no .device/site: carry .device/site.tar.xz (a fresh machine)"; exit 3; }
if compgen -G ".device/kernels/kernels.tar.xz.*" > /dev/null && [ ! -f ~/.harts_kernels_restored ]; then
  cat .device/kernels/kernels.tar.xz.* | tar -C ~ -xJf - && touch ~/.harts_kernels_restored
  du -sh ~/.triton/cache ~/.tilelang/cache 2>/dev/null
fi
# Triton's autotuning choices from earlier machines of this kind (scripts/triton_autotune.py), once per machine
if [ "${HARTS_AUTOTUNE_RESTORE:-1}" = 1 ] && [ ! -f ~/.harts_autotune_restored ]; then
  python3 scripts/triton_autotune.py restore scripts/autotune && touch ~/.harts_autotune_restored
fi
export PYTHONPATH="$PWD:$PWD/.device/site" TF524="$PWD/.device/tf524" PYTHONUNBUFFERED=1
# FlashAttention-4 keeps its compiled CuTe kernels on disk only when asked: a later process on the same machine then
# loads them instead of compiling again. On 2026-12-04 (cache off) a fresh machine's first process spent 211 s before
# its first tree run and the next process on it 227 s before its first packed call; how much of that is
# FlashAttention-4's compilation is not measured (the first call with this on will say). Set it to 0 in a command to
# compile afresh, should a cached kernel fail to load.
# Triton keeps compiled kernels on disk but, unless asked, not its autotuning choices: every new process benchmarks
# every configuration of every autotuned kernel (fla's) again, on binaries it already has. With this on, the choices
# are kept in Triton's cache (keyed by the kernel's source, its configurations and the tuning key) and a later process,
# or a machine given the saved caches (`save_caches`), reuses them. How much of a new process's 144-228 s this saves is
# not measured yet (the first call with it on will say); 0 benchmarks afresh.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$HOME/.cache/fa4_cute_dsl}
[ -f .device/liger/.ok ] && PYTHONPATH="$PYTHONPATH:$PWD/.device/liger"  # liger-kernel (TRL's use_liger_kernel)
if [ -f .device/fa4x/.fa4libs ] && [ -f .device/fa4x/.fa4rest ]; then
  PYTHONPATH="$PYTHONPATH:$PWD/.device/fa4x:$PWD/.device/fa4x/nvidia_cutlass_dsl/dsl_packages"
fi
W=$OUT/w
mkdir -p "$W"
save_caches() {
  local dirs=() d
  for d in .triton/cache .tilelang/cache .cache/fa4_cute_dsl; do [ -d ~/"$d" ] && dirs+=("$d"); done
  [ ${#dirs[@]} -gt 0 ] || return 0
  tar -C ~ -cf - --exclude='*.ptx' --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.source' \
    "${dirs[@]}" | xz -T0 -6 | split -b 15M - "$OUT/kernels.tar.xz."
  ls -l "$OUT"/kernels.tar.xz.* > "$W/kernels_saved.txt"
}
# The job worker (scripts/device_worker.py): ONE process on this machine runs every job submitted to it, so the
# kernels compile once per machine instead of once per process. It is detached from the call that starts it (a new
# process session) and outlives that call while the machine stays warm (seen 2026-12-04: started in one call, it ran
# its jobs on through the next, with no first-run compilation in any later job); a machine given back takes it along
# (the next call's `jobs_wait` says the worker is gone, and `jobs_start` marks the job it held as lost). Follow a call
# with the next within the machine's 30 s idle release. Jobs write under $JOBS/w (outside $OUT, which is per call):
#   jobs_start; job tau_tree benchmarks/plan_memory_probe.py --workload tau ... --out $JOBS/w/tau_tree; jobs_wait; finish
JOBS=/tmp/harts_jobs
jobs_start() { python3 scripts/device_worker.py start "$JOBS" --idle "${JOBS_IDLE:-900}"; }
job() { python3 scripts/device_worker.py submit "$JOBS" "$@"; }
job_alone() { python3 scripts/device_worker.py submit --own-process "$JOBS" "$@"; }  # a child process of the worker
job_tf524() {  # a child process with transformers 5.24 first (bailing_hybrid; carry .device/tf.tar.xz once)
  python3 scripts/device_worker.py submit --own-process --env "PYTHONPATH=$TF524:$PYTHONPATH" "$JOBS" "$@"
}
# until the queue is empty, the worker is gone, or 25 s before the call's limit (T0: the call's start; LIMIT: its
# timeout_s, default 600: a call run with a shorter timeout_s must set it, else the call is killed before it packs
# $OUT, and everything it ran is lost, as a 230 s call was on 2026-12-06)
jobs_wait() {
  python3 scripts/device_worker.py wait "$JOBS" --seconds $((${LIMIT:-600} - 25 - ($(date +%s) - ${T0:-$(date +%s)})))
}
finish() {
  # this machine's autotuning choices so far, for scripts/autotune/ (copy $W/autotune/<card>.json there)
  python3 scripts/triton_autotune.py save "$W/autotune" > "$W/autotune_saved.txt" 2>&1
  # where the compiled kernels went
  du -sh ~/.triton/cache ~/.tilelang/cache ~/.cache/fa4_cute_dsl > "$W/triton_cache_size.txt" 2>&1
  # where else compiled kernels may be kept (the three above held only 4.5 MB after 239 s of compiling, 2026-12-04)
  { env | grep -i -E "triton|tilelang|cache|cute" ; du -sh ~/.cache/* ~/.triton/* /tmp/* 2>/dev/null | sort -h | tail -15
  } >> "$W/triton_cache_size.txt" 2>&1
  if [ -d "$JOBS" ]; then  # every job's log, status and results so far (the worker's jobs may still be running)
    tar -C "$JOBS" -czf "$W/jobs.tgz" --exclude=./queue --exclude=./running --exclude=./submitted.lock . 2>/dev/null
  fi
  tar -C "$W" -czf "$OUT/results.tgz" . && rm -rf "$W"
}
