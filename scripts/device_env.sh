# Sourced at the start of every command on the H200 (the device tool's `run`), from the checkout's root:
#
#   source scripts/device_env.sh && cd benchmarks && python3 plan_memory_probe.py ... --out $W/name; cd ..; finish
#
# The first call on a machine carries the archives (`carry`: .device/site.tar.xz from ../shared/device/make-bundle.sh,
# and, where needed, .device/tf.tar.xz from scripts/device_extras.sh); they are extracted once into .device/site and
# .device/tf524, which stay on a warm machine, so later calls carry nothing (a fresh machine needs them again).
# PYTHONPATH then holds the checkout and the bundle; `PYTHONPATH=$TF524:$PYTHONPATH` puts transformers 5.24 first
# (bailing_hybrid). Results go under $W; `finish` packs $W into $OUT/results.tgz (the tool returns at most 8 files)
# with the size of Triton's cache beside them.
for pair in site:site.tar.xz tf524:tf.tar.xz; do
  dir=.device/${pair%%:*}; archive=.device/${pair#*:}
  if [ ! -f "$dir/.ok" ] && [ -f "$archive" ]; then
    mkdir -p "$dir" && tar -C "$dir" -xJf "$archive" && touch "$dir/.ok"
  fi
done
[ -f .device/site/.ok ] || { echo "no .device/site: carry .device/site.tar.xz (a fresh machine)"; exit 3; }
export PYTHONPATH="$PWD:$PWD/.device/site" TF524="$PWD/.device/tf524" PYTHONUNBUFFERED=1
W=$OUT/w
mkdir -p "$W"
finish() {
  du -sh ~/.triton/cache > "$W/triton_cache_size.txt" 2>&1
  tar -C "$W" -czf "$OUT/results.tgz" . && rm -rf "$W"
}
