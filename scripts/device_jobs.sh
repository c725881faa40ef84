# The measurements still open (issues 22, 23, 25, 26), queued on the device's job worker; sourced after
# scripts/device_env.sh by every call of a session, the first of which queues them (once per machine):
#
#   T0=$(date +%s); bash -c "T0=$T0; source scripts/device_env.sh && source scripts/device_jobs.sh" 2>&1 | tail -40
#
# (carry .device/site.tar.xz, .device/tf.tar.xz and .device/liger.tar.xz in the first call; later calls carry nothing
# while the machine stays warm; where .device/kernels/ holds saved kernels, a call carrying only it comes first: see
# SAVE_CACHES below).
# Each call waits for the queue until 25 s before its 600 s, then packs $OUT/results.tgz (finish). The list depends on
# the card: an H200 (141 GB) runs the headline settings; an H100 (80 GB) smaller planner pieces, since the 2.3B
# preset's fp32 weights, gradients and AdamW states take 37 GiB (2026-12-05, H100: the `swe` scale-0.05 trainer at
# --tree-token-budget 65536 peaked at 57.8 GiB in its first step, before AdamW's states existed, and ran out of memory
# in its second) and the `distinct` forest alone peaks at 92.5 GiB. Jobs from transformers 5.24 (bailing_hybrid) run
# in child processes (job_tf524); the rest share the worker's compiled kernels.
# Every call's results.tgz holds autotune/<card>.json, Triton's autotuning choices so far on that machine: copy it into
# scripts/autotune/ and commit it, so that the next machine of that kind restores them instead of timing every
# configuration of every autotuned kernel again (scripts/triton_autotune.py).
J=$JOBS/w
mkdir -p "$JOBS"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
probe=benchmarks/plan_memory_probe.py
trainer=benchmarks/multi_gpu_tree_grpo.py
same=(--no-history --kernels fused --keep-attention on)
if [ "${mem:-0}" -gt 100000 ]; then  # an H200: the headline settings
  nemotron=131072 ling3=65536 h200=1
else  # an H100: no Ling-3 packed `swe` (one trajectory of 43,840 tokens peaked at 63.2 GiB, 2026-12-05; the longest
  # has 72,913); smaller tree pieces than on the H200, set per job below, with the allocator's expandable segments
  # (on an H100, 2026-12-06, Ling-3's `swe` tree at 32,768-token pieces and Kimi's `tau` tree at 49,152 ran out of
  # memory with 22-33 GiB reserved but unallocated; with expandable segments Kimi's whole `tau` forest fit)
  h200=0
fi
if [ ! -f "$JOBS/.queued" ]; then
  touch "$JOBS/.queued"
  # (run on an H100, 2026-12-06 05:32-05:50 and 08:05-08:21 UTC, and taken off this list: the `tau`@0.02 host profile
  # (twice), the `swe` 0.05 trainer at 32,768-token pieces, the Nemotron-H `tau` profile of both paths and its `swe`
  # tree + packed path, the Mamba-2 scan's half-precision inputs against fp32: parity and full-size `tau`)
  # (run on an H100, 2026-12-06 11:02-11:40 UTC, and taken off: Nemotron-H `swe` both paths at bf16 scan inputs,
  # Ling-3 `swe` tree at 16,384, Kimi `tau` both paths at 32,768 and its profile, Ling-3's experts A/B on `tau` at
  # 16,384, the headline's `tau` / `grpo` / `distinct` on an H100)
  # (run on an H100, 2026-12-06 13:51-14:26 UTC, and taken off: shared keys in place and FlexAttention, the attention
  # alone on whole forests at three head shapes; Kimi `tau` with each and Nemotron-H `tau` with shared keys; the
  # `distinct` trainers, tree and TRL with Liger, two timed steps on an H100)
  # (run on H100s, 2026-12-06 17:04-17:31 UTC, and taken off: the Triton sum of the gathered rows' gradients against
  # index_add_, attention alone and Kimi / 2B `tau` steps (now the default); FlexAttention in Nemotron-H and 2B `tau`)
  # (run on an H100, 2026-12-06 20:24-20:41 UTC, and taken off: Kimi `tau` both paths, whole and in 32,768-token
  # pieces, with the KDA serial state pass A/B and shared keys, and its whole forest profiled; Nemotron-H `swe` both
  # paths at 65,536 and the tree at 131,072; Ling-3 `tau` packed and tree at 16,384, 32,768, 49,152, 65,536)
  # (run on an H100, 2026-12-06 23:35-23:50 UTC, and taken off: Kimi `tau` both paths with the fused KDA inputs' and
  # the kept node outputs' A/B; Ling-3 `tau` in one process at 65,536; the kept node outputs' A/B on Nemotron-H `tau`
  # (both paths) and `swe` (tree) and on the 2B `tau` tree)
  # (run on an H100, 2026-12-07 02:41-03:07 UTC, and taken off: MLA on FlashAttention-4 with unpadded values, the
  # attention alone and the latent-attention parity row; Kimi `tau` both paths and `swe` both paths on it, Ling-3
  # `tau` at 65,536 both paths on it; Nemotron-H `tau` both paths rerunning the scan's outputs beside the kept tree)
  # FlashAttention-4 where its stack travelled (device_env.sh: two calls of archives first), else torch's flash varlen
  # (harts_hf's default): the headline's kernel, and MLA's fastest (values unpadded)
  fa4=fused; [ -f .device/fa4x/.fa4libs ] && fa4=fused_fa4
  # issue 22 (queued 2026-12-08; no machine came that session): planner pieces WITHOUT gradient checkpointing against
  # the whole forest checkpointed. Checkpointing reruns every layer's forward (0.92 of 5.01 device seconds on the
  # H200's `tau`, the per-part profile); pieces small enough to keep every layer's activations pay instead the
  # hand-off sources' no-grad forward (tau: 2-7 hand-offs at 49,152-16,384, the shared prompt) and smaller GEMMs. Each
  # budget both ways (--stored-layers 24 0) so the pieces' own cost shows apart from the rerun's. Both kinds of card,
  # first in line (the whole forest checkpointed: the headline job's `tau` tree on an H200, tau_ckpt on an H100); on
  # an H100 with the allocator's expandable segments (the worker's environment: every job there; the 2.3B `tau`
  # forest with more kept than the default needed them on an H100, 2026-12-06)
  [ "$h200" = 1 ] || export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  [ "$h200" = 1 ] && pieces=(49152 32768 24576) || pieces=(24576 16384)
  [ "$h200" = 1 ] || job tau_ckpt $probe --workload tau --scale 1.0 --budget 0 "${same[@]}" --kernels $fa4 \
    --repeats 2 --out $J/tau_ckpt
  job tau_pieces $probe --workload tau --scale 1.0 --budget "${pieces[@]}" --stored-layers 24 0 "${same[@]}" \
    --kernels $fa4 --repeats 2 --out $J/tau_pieces
  job grpo_pieces $probe --workload grpo --scale 1.0 --budget "${pieces[@]}" --stored-layers 24 0 "${same[@]}" \
    --kernels $fa4 --repeats 2 --out $J/grpo_pieces
  # (run on an H100, 2026-12-07 05:47-05:55 UTC, and taken off: Kimi `tau` both paths on FlashAttention-4 with the
  # kept node outputs, and profiled; the Ling-3 `swe` tree on it at 32,768; Nemotron-H `tau` both paths kept, profiled)
  # (run on an H100, 2026-12-07 07:09-07:13 UTC, and taken off: shared key segments in place on FlashAttention-4, Kimi's
  # `tau` tree with and without them and the attention alone at MLA's heads)
  # (run on an H100, 2026-12-07 12:58-13:05 UTC, and taken off: the recurrent mixers whole in their node's executed
  # layout against the node's gathers on Kimi, Nemotron-H and 2B `tau`, and both profiled on Kimi and Nemotron-H)
  # (run on an H100, 2026-12-07 13:35-13:41 UTC, and taken off: Mamba-2's scan on chunks of 64 against the mixer's 128,
  # Nemotron-H `tau` both paths, and its bf16 parity at 64)
  # (run on an H100, 2026-12-07 15:48-15:55 UTC, and taken off: Nemotron-H `tau` both paths on chunks of 64 on another
  # machine, and `swe` both paths at 65,536 on chunks of 64)
  # (run on an H100, 2026-12-07 16:24-16:40 UTC, and taken off: Nemotron-H `swe` at 65,536 profiled in pieces, with the
  # hand-off sources' graphs kept, and on FlashAttention-4 against torch's flash call, then the packed path)
  # (run on an H100, 2026-12-07 19:02-19:22 UTC, and taken off: Nemotron-H `swe` and `tau` both paths on
  # FlashAttention-4, and the headline's `tau` / `grpo` / `distinct` on it, both paths)
  # issue 23: the headline's `tau`, `grpo` and `distinct` rows again, both paths, one process (the packed rows of
  # 2026-12-04 predate the packed path's executed layout as views, 940afb9); each packed call warmed up (the 12-04 rows
  # warmed the first only); on $fa4 (where that is torch's flash varlen, a new row, not a re-run)
  [ "$h200" = 1 ] && job headline $probe --workload tau grpo distinct --scale 1.0 --budget 0 --no-history \
    --kernels $fa4 --repeats 2 --keep-attention on --packed-groups 0 --packed-warmup each \
    --out $J/headline
  # issue 22, on an H200: the kept node outputs' A/B on the headline's `tau`, both paths (on an H100 the 2.3B tree saved
  # 2.9% for 13.3 GiB; the packed path with them was not timed against itself)
  [ "$h200" = 1 ] && job tau_keep_mixers $probe --workload tau --scale 1.0 --budget 0 "${same[@]}" \
    --kernels fused_keep_mixers fused --repeats 2 --packed-groups 0 --packed-warmup each --out $J/tau_keep_mixers
  # issue 22: the trainer's step on the H200, one tree forward per microbatch (no pieces: the target is this
  # H200 step); the trainers' attention is FlashAttention-4 where its stack travelled (varlen.KERNEL "auto", the
  # default since 2026-12-07), torch's flash varlen otherwise
  [ "$h200" = 1 ] && job tree_swe005 $trainer --preset 2b --scale 0.05 --workload swe --tasks-per-step 4 --steps 5 \
    --warmup 2 --trainer tree --out $J/tree_swe005
  # issue 26: Nemotron-H full-size `swe` on the H200 (the scan's inputs in bf16, the default since 2026-12-06: both
  # paths again), the tree with the pruned hand-off forward, with and without the source's second forward
  [ "$h200" = 1 ] && job nemotron_swe_tree $probe --model nemotron_h_shaped --workload swe --scale 1.0 \
    --budget $nemotron "${same[@]}" --repeats 2 --packed-groups $nemotron --packed-warmup each \
    --out $J/nemotron_swe_tree
  [ "$h200" = 1 ] && job nemotron_swe_keep $probe --model nemotron_h_shaped --workload swe --scale 1.0 \
    --budget $nemotron "${same[@]}" --repeats 2 --no-recompute --out $J/nemotron_swe_keep
  # issue 25: Ling-3 full-size `swe`, tree and packed in one child process (one compilation: its first tree run took
  # 503 s with it on the H200, 2026-12-05); the packed path only on an H200
  ling3_both=(); [ "$h200" = 1 ] && ling3_both=(--packed-groups $ling3 --packed-warmup each)
  [ "$h200" = 1 ] && job_tf524 ling3_swe $probe --model ling3_shaped --workload swe --scale 1.0 --budget $ling3 \
    "${same[@]}" --kernels $fa4 --repeats 2 "${ling3_both[@]}" --out $J/ling3_swe
  # issue 25: Ling-3's full-size `tau` on the H200, the whole forest against the packed path in one process, with the
  # routed experts in bf16 (harts_hf's default since 2026-12-05; its H200 row of 2026-12-03, fraction 1.004, ran both
  # paths with fp32 experts; an H100 measured the experts' A/B, 2026-12-06)
  [ "$h200" = 1 ] && job_tf524 ling3_tau_h200 $probe --model ling3_shaped --workload tau --scale 1.0 --budget 0 \
    "${same[@]}" --kernels $fa4 --repeats 2 --packed-groups 0 --packed-warmup each --out $J/ling3_tau_h200
  # issues 22/23: the Qwen3-Next full-size `swe` tree with and without the source's second forward, one process
  [ "$h200" = 1 ] && job swe_tree_keep $probe --workload swe --scale 1.0 --budget 131072 "${same[@]}" \
    --repeats 2 --no-recompute --out $J/swe_tree_keep
  [ "$h200" = 1 ] && job swe_tree $probe --workload swe --scale 1.0 --budget 131072 "${same[@]}" --repeats 2 \
    --out $J/swe_tree
  [ "$h200" = 1 ] && job tree_distinct $trainer --preset 2b --workload distinct --scale 1.0 --tasks-per-step 8 \
    --rows-per-task 8 --steps 3 --warmup 1 --trainer tree --out $J/tree_distinct
  # issue 23: TRL's GRPOTrainer with Liger on the same rows, two timed steps (its row has one); fla's short convolution
  # in place of transformers' PyTorch one (causal-conv1d is not on the device); Liger travels as .device/liger.tar.xz
  [ "$h200" = 1 ] && job trl_distinct $trainer --preset 2b --workload distinct --scale 1.0 --tasks-per-step 8 \
    --rows-per-task 8 --steps 3 --warmup 1 --grad-accum 16 --trainer trl --liger --trl-conv fla --out $J/trl_distinct
  # issue 23: the per-trajectory loop over every full-size `swe` trajectory (each alone, second of two runs)
  [ "$h200" = 1 ] && job swe_loop $probe --workload swe --scale 1.0 --budget 131072 "${same[@]}" --loop-only \
    --loop-sample -1 --out $J/swe_loop
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$W/gpu.txt" 2>&1
jobs_start
jobs_wait
# SAVE_CACHES=1: the compiled kernels and Triton's autotuning choices come back as $OUT/kernels.tar.xz.* for
# .device/kernels/, which a later machine unpacks before anything compiles (a fresh H200 spent 329 s on the first
# Nemotron-H tree run and 503 s on Ling-3's, compiling, 2026-12-05); start that call's T0 60 s early
# (T0=$(( $(date +%s) - 60 ))), to leave time for the packing. .device/ is not committed, and a session's checkout
# may start without it (2026-12-06), so this helps a later machine of the same session only; the autotuning choices
# travel between sessions through scripts/autotune/ (see the header).
[ "${SAVE_CACHES:-0}" = 1 ] && save_caches
finish
tail -n 3 "$JOBS"/*.log 2>/dev/null | cut -c1-200
