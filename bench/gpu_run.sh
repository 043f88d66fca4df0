#!/usr/bin/env bash
# One GPU session's measurements in one call (the device allows 10 minutes a command): the GPU test suite,
# then issue 7's points, each step with its own time limit so a slow one cannot starve the rest. Writes
# logs and JSON under $WORK_DIR (default /tmp/gpu-run), packs them into $OUT/gpu-run.tgz (default ./gpu-out)
# after every step, then prints a summary.
#
#   bash bench/gpu_run.sh            # tests + forward/load + gate
#   STEPS="tests forward" bash bench/gpu_run.sh
set -u -o pipefail  # a step's rc is its python's (or timeout's), not the log filter's
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
# The device returns at most 8 files from $OUT, so the logs go to a work folder that is packed into
# $OUT/gpu-run.tgz after every step (a command killed at its time limit still returns what it had).
RESULT=$OUT
OUT=${WORK_DIR:-/tmp/gpu-run}
mkdir -p "$OUT"
pack() { tar -czf "$RESULT/gpu-run.tgz" -C "$OUT" . ; }
# pytest-xdist, where installed, runs the GPU suite in 14 workers (most of its time is Triton compiling; 16 cores)
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n ${TESTS_WORKERS:-14} --dist ${TESTS_DIST:-worksteal}"
# Python packages the device image lacks (pyzmq, for the engine core in its own process), carried as wheels in
# $WHEELS_DIR (default .whl: see /work/.library/device/README.md, Notes, for fetching cp312 manylinux wheels)
if ! python3 -c "import zmq" 2>/dev/null && ls ${WHEELS_DIR:-.whl}/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site ${WHEELS_DIR:-.whl}/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export BENCH_DIR=${BENCH_DIR:-/tmp/b} PYTHONUNBUFFERED=1
mkdir -p "$BENCH_DIR"
STEPS=${STEPS-tests forward gate}
# The ab step's variants, one JSON object of engine_ext.KernelSettings fields per line (AB_VARIANTS overrides);
# the default re-checks the shrink kernel's warps against the default's.
DEFAULT_AB='{"shrink_warps": 4}'
# The Triton kernels' launch settings for the decode.py steps (JSON; the ab step sets its winner)
KERNEL_SETTINGS=${KERNEL_SETTINGS:-"{}"}
quiet() { grep -v "^adapter '" ; }  # the per-adapter "trained on" notice, 64 lines per engine
# bench/serve_load.py once per set of open-loop runs on one engine: load_sets NAME MODES REQUESTS WARMUP EXTRA SET...,
# each SET shape:rank:mix:runs (runs comma-separated); each run within ${<NAME>_TIMEOUT:-240} s (OPENLOOP_TIMEOUT, ...).
# With AB_TREE (an earlier commit unpacked beside this one: git archive <commit> | tar -x -C .ab/<commit>) each set
# also runs in that tree, right after this one's, with AB_EXTRA in place of EXTRA (flags an older serve_load lacks)
load_sets() {
  local prefix=$1 modes=$2 requests=$3 warmup=$4 extra=$5 set shape rank mix runs name limit tree tag args
  limit=$(eval echo "\${${prefix^^}_TIMEOUT:-240}")
  shift 5
  for set in "$@"; do
    IFS=: read -r shape rank mix runs <<<"$set"
    for tree in . ${AB_TREE:-}; do
      name="$prefix-${shape#llama-}-r$rank-$mix" tag="" args=$extra
      [ "$tree" != . ] && tag="-ab-$(basename "$tree")" args=${AB_EXTRA:-}
      (cd "$tree" && timeout $limit python3 bench/serve_load.py --shape $shape --rank $rank --mix $mix --spec 4 \
        --modes $modes --runs ${runs//,/ } --requests $requests --warmup $warmup $args --work-dir "$BENCH_DIR$tag" \
        --out "$OUT/$name$tag.json" 2>"$OUT/$name$tag.log" >/dev/null)
      echo "$name$tag rc $?"; grep '^compare\|crash\|Error' "$OUT/$name$tag.log" | cut -c1-400
      pack
    done
  done
}

for step in $STEPS; do
  start=$SECONDS
  case $step in
    ab)  # launch settings A/B'd in the whole forward (bench/forward_ab.py); the winner is used by later steps
      mapfile -t variants <<<"${AB_VARIANTS:-$DEFAULT_AB}"
      timeout 420 python3 bench/forward_ab.py --out-dir "$OUT" --settings-out "$OUT/best.json" "${variants[@]}" \
        >"$OUT/ab.log" 2>&1
      echo "ab rc $?"; cat "$OUT/ab.log"
      if [ -s "$OUT/best.json" ]; then KERNEL_SETTINGS=$(cat "$OUT/best.json"); fi
      echo "kernel settings: $KERNEL_SETTINGS" ;;
    tests)  # every gpu-marked engine test (the open-loop stress suite's CUDA backend and the 1B/8B shapes included);
      # TESTS_K narrows it to a pytest -k expression, TESTS_PATHS to some files (the whole suite takes more than one
      # 10-minute call: run test_speculative_greedy.py in one, the other files in another), TESTS_TIMEOUT bounds it (s)
      timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -m gpu ${TESTS_PATHS:-tests/engine_ext} -q -p no:cacheprovider --durations=15 $XDIST ${TESTS_K:+-k "$TESTS_K"} \
        >"$OUT/gpu_tests.log" 2>&1
      echo "tests rc $?: $(tail -1 "$OUT/gpu_tests.log")" ;;
    server)  # the replica's server class from a GPU app config against bench/decode.py's engine figure (issue 16);
      # the deployment's config needs pydantic: installed from wheels carried in $WHEELS when the image lacks it
      python3 -c "import pydantic, pydantic_settings" 2>/dev/null || python3 -m pip install -q --no-index --find-links "${WHEELS:-.gpu/wheels}" pydantic pydantic-settings
      timeout 360 python3 -m pytest -m gpu tests/deployments/gpu -q -s -p no:cacheprovider >"$OUT/server.log" 2>&1
      echo "server rc $?: $(grep -E '^server |passed|failed' "$OUT/server.log" | tr '\n' ' ')" ;;
    openloop)  # issue 20: base-only, plain, gated and forced drafting on identical open-loop traffic at the 1B shape,
      # per rank and adapter mix (OPENLOOP_RANKS, OPENLOOP_MIXES), from light load to saturation (OPENLOOP_RUNS)
      sets=()
      for rank in ${OPENLOOP_RANKS:-16 64}; do
        for mix in ${OPENLOOP_MIXES:-near mixed}; do
          runs=${OPENLOOP_RUNS:-poisson:30 poisson:90 burst}
          sets+=("llama-3.2-1b:$rank:$mix:${runs// /,}")
        done
      done
      load_sets openloop "base plain gated forced" ${OPENLOOP_REQUESTS:-200} 50 "" "${sets[@]}" ;;
    busy)  # issue 28: GPU busy fraction (torch.profiler: the union of kernel intervals over the run's wall time), tok/s
      # and host time per step for every mode on identical open-loop traffic, in this tree and in $AB_TREE (an
      # earlier commit unpacked beside it: git archive <commit> | tar -x -C .ab/<commit>), one shape at a time;
      # BUSY_LOOP=served replays through AsyncLLMEngine as a replica serves (a tree older than 7d7e2b5 has no --loop)
      for shape in ${BUSY_SHAPES:-llama-3.2-1b}; do
        for tree in . ${AB_TREE:-}; do
          name="busy-$shape-$(basename "$(cd "$tree" && pwd)")"
          timeout ${BUSY_TIMEOUT:-300} python3 bench/gpu_busy.py --tree "$tree" --out "$OUT/$name.json" -- \
            --shape "$shape" --rank ${BUSY_RANK:-16} --mix ${BUSY_MIX:-near} --modes ${BUSY_MODES:-base plain gated forced} \
            --runs ${BUSY_RUNS:-burst burst} --requests ${BUSY_REQUESTS:-300} --warmup ${BUSY_WARMUP:-50} \
            ${BUSY_LOOP:+--loop $BUSY_LOOP} 2>"$OUT/$name.log" >/dev/null
          echo "$name rc $?"; grep '^busy\|^compare\|crash\|Error' "$OUT/$name.log" | tail -12
          pack
        done
      done ;;
    lightload)  # issue 41, points 2-4: base-only, plain and gated on identical open-loop traffic, one engine per set.
      # LIGHTLOAD_SETS: shape:rank:mix:runs (runs comma-separated); the default is the issue's matrix, more than one
      # 10-minute call holds: run the 1B sets in one call and the 8B set in another
      load_sets lightload "base plain gated" ${LIGHTLOAD_REQUESTS:-160} 30 --gate-trace ${LIGHTLOAD_SETS:-llama-3.2-1b:16:near:poisson:30,poisson:90,burst llama-3.2-1b:16:mixed:poisson:30,poisson:90,burst llama-3.2-1b:64:mixed:gamma:60:4,burst llama-3.1-8b:16:mixed:poisson:10,poisson:25,burst} ;;
    hostprof)  # where a step's host time goes on this machine (bench/host_profile.py: cProfile over LLMEngine.step at a
      # fixed batch, base-only, plain, forced k = 4 and gated, 1B; HOSTPROF_BATCHES, HOSTPROF_STEPS)
      for b in ${HOSTPROF_BATCHES:-8}; do
        timeout 240 python3 bench/host_profile.py --batch $b --steps ${HOSTPROF_STEPS:-300} --workdir "$BENCH_DIR" \
          --out "$OUT/host-profile-b$b.jsonl" >/dev/null 2>"$OUT/host-profile-b$b.log"
        echo "hostprof b$b rc $?"
        python3 -c 'import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print(d["mode"], "ms/step %.3f wait %.3f host %.3f tokens/step %.1f" % (d["ms_per_step"], d["device_wait_ms_per_step"],
          d["host_ms_per_step"], d["tokens_per_step"]))
    for r in d["top_own"][:12]:
        print("   own %8.1f us %6.2f calls  %s" % (r["own_us_per_step"], r["calls_per_step"], r["fn"]))' "$OUT/host-profile-b$b.jsonl"
        pack
      done ;;
    fp8load)  # issue 40, point 3: open-loop bursts at 8B with bf16 and with FP8 base weights, base-only, plain and
      # gated on identical traffic, one engine each (FP8LOAD_SETS as LIGHTLOAD_SETS; the FP8 engine quantizes the same
      # weights at load, so the two share one work dir)
      sets=${FP8LOAD_SETS:-llama-3.1-8b:16:mixed:burst}
      load_sets bf16load "base plain gated" ${FP8LOAD_REQUESTS:-400} 30 "" $sets
      load_sets fp8load "base plain gated" ${FP8LOAD_REQUESTS:-400} 30 "--quantization fp8" $sets
      for f in "$OUT"/fp8load-*.json; do  # FP8 over bf16 tokens/s per run and mode
        python3 -c 'import json, sys
fp8, bf16 = (json.load(open(p)) for p in sys.argv[1:])
tps = lambda d: {(r["run"], r["mode"]): r["tokens_per_s"] for r in d["runs"]}
a, b = tps(fp8), tps(bf16)
print(sys.argv[1], " ".join("%s %s %.0f/%.0f %.2fx" % (*k, a[k], b[k], a[k] / b[k]) for k in a if k in b))' \
          "$f" "${f/fp8load-/bf16load-}"
      done ;;
    load8b)  # open-loop traffic at the 8B shape with speculation gated: Poisson 10 and 25 req/s, then a burst
      timeout 330 python3 bench/serve_load.py --shape llama-3.1-8b --runs poisson:10 poisson:25 burst --requests 300 \
        --spec 4 --out "$OUT/load8b.json" 2>"$OUT/load8b.log" >/dev/null
      echo "load8b rc $?"; grep '^run ' "$OUT/load8b.log" ;;
    prefix)  # issue 29: shared-prefix chat traffic (20 adapters, 1,000-token system prompts, 3-turn sessions) and its
      # unshared control, prefix caching off and on (PREFIX_REPEATS pairs in alternating order: 2 at 1B, 1 at 8B), on
      # one engine per shape (PREFIX_SHAPES; PREFIX_SESSIONS, PREFIX_RATE_1B/_8B sessions a second; PREFIX_TRAFFICS, PREFIX_SPEC draft
      # tokens (0: plain multi-LoRA), PREFIX_KV_GB the KV cache's size)
      for shape in ${PREFIX_SHAPES:-llama-3.2-1b llama-3.1-8b}; do
        # limits with room for a cold start (random weights written, Triton compiling, graphs captured): the 8B shape
        # takes most of a call alone
        case $shape in *8b) rate=${PREFIX_RATE_8B:-2} sessions=24 repeats=${PREFIX_REPEATS:-1} limit=${PREFIX_TIMEOUT_8B:-420} ;;
          *) rate=${PREFIX_RATE_1B:-4} sessions=40 repeats=${PREFIX_REPEATS:-2} limit=${PREFIX_TIMEOUT_1B:-360} ;; esac
        name=prefix-$shape-spec${PREFIX_SPEC:-4}${PREFIX_KV_GB:+-kv$PREFIX_KV_GB}
        timeout $limit python3 bench/prefix_load.py --shape $shape --adapters 20 --system-len 1000 \
          --sessions ${PREFIX_SESSIONS:-$sessions} --turns 3 --session-rate $rate --think-s 1 \
          --repeats $repeats --traffics ${PREFIX_TRAFFICS:-chat unshared} --spec ${PREFIX_SPEC:-4} ${PREFIX_KV_GB:+--kv-cache-gb $PREFIX_KV_GB} \
          --out "$OUT/$name.json" 2>"$OUT/$name.log" >/dev/null
        echo "$name rc $?"; grep '^startup\|^warmed\|^compare\|^run\|Error' "$OUT/$name.log"
        pack
      done ;;
    coldstart)  # 300 requests at 10/s right after start-up from an empty Triton cache, then again with it filled
      for spec in 0 4; do
        rm -rf "/tmp/triton-cache-$spec"
        for run in cold warm; do
          timeout 200 python3 bench/serve_load.py --shape llama-3.2-1b --spec $spec --runs poisson:10 --requests 300 \
            --compile-cache "/tmp/triton-cache-$spec" --out "$OUT/start-spec$spec-$run.json" \
            2>"$OUT/start-spec$spec-$run.log" >/dev/null
          echo "coldstart spec $spec $run rc $?"; grep '^run \|^startup' "$OUT/start-spec$spec-$run.log"
        done
      done ;;
    forward)  # points 1, 2 and 4 (copy-engine graph inputs)
      timeout 200 python3 bench/decode.py --ranks 16 --batches 1 32 --adapters 0 32 --sections forward load \
        --kernel-settings "$KERNEL_SETTINGS" --out "$OUT/forward.json" 2>&1 | quiet >"$OUT/forward.log"
      echo "forward rc $?" ;;
    gate)  # point 3 (rank 64; add 16 for the rank-16 table)
      timeout 150 python3 bench/decode.py --peaked --ranks 64 --batches 32 --adapters 0 32 --near-scale 0.1 \
        --vfar-scale 100 --gen 64 --sections engine --kernel-settings "$KERNEL_SETTINGS" \
        --out "$OUT/gate.json" 2>&1 | quiet >"$OUT/gate.log"
      echo "gate rc $?" ;;
    gate16)  # point 3 at rank 16, and the HF peers (bench/hf_peer.py: base-only generate, PEFT mixed batch) on the same mix
      timeout 200 python3 bench/decode.py --peaked --ranks 16 --batches 32 --adapters 0 32 --near-scale 0.1 \
        --gen 64 --hf --sections engine --kernel-settings "$KERNEL_SETTINGS" \
        --out "$OUT/gate16_hf.json" 2>&1 | quiet >"$OUT/gate16_hf.log"
      echo "gate16 rc $?" ;;
    gate256)  # point 3 in 256-token windows (rank 64, near / far / very far and two middle scales), every mode in
      # 5 rounds, the median reported, and each gated mode against the better mode round by round (gate_check)
      timeout 420 python3 bench/decode.py --peaked --ranks 64 --batches 32 --adapters 0 32 --near-scale 0.1 \
        --vfar-scale 100 --mid-scales ${MID_SCALES:-2 3} --gen 256 --repeats "${REPEATS:-5}" --sections engine \
        --kernel-settings "$KERNEL_SETTINGS" --out "$OUT/gate256.json" 2>&1 | quiet >"$OUT/gate256.log"
      echo "gate256 rc $?"; grep '"vs_better"' "$OUT/gate256.log" ;;
    gate16_256)  # point 3 in 256-token windows (rank 16), every mode in 5 rounds, the median reported
      timeout 240 python3 bench/decode.py --peaked --ranks 16 --batches 32 --adapters 0 32 --near-scale 0.1 \
        --gen 256 --repeats "${REPEATS:-5}" --sections engine --kernel-settings "$KERNEL_SETTINGS" \
        --out "$OUT/gate16_256.json" 2>&1 | quiet >"$OUT/gate16_256.log"
      echo "gate16_256 rc $?"; grep '"vs_better"' "$OUT/gate16_256.log" ;;
    tp)  # issue 30 (needs nvidia-h200-x2): the 8B shape's decode forward at batch 1 and 32, adapters off and on, at
      # TP=1 then TP=2 (the step_ms ratio is the speed-up; rank 0's graph cannot be replayed alone, so no gpu_ms at
      # TP=2), then open-loop bursts with speculation gated at TP=1 and TP=2
      for tp in 1 2; do
        timeout 240 python3 bench/decode.py --shapes llama-3.1-8b --ranks 16 --batches 1 32 --adapters 0 32 \
          --sections forward --tp $tp --kernel-settings "$KERNEL_SETTINGS" \
          --out "$OUT/tp$tp-forward_8b.json" 2>&1 | quiet >"$OUT/tp$tp-forward_8b.log"
        echo "tp$tp forward rc $?"; grep -E '"step_ms"|Error' "$OUT/tp$tp-forward_8b.log" | head -8
        pack
      done
      for tp in 1 2; do
        timeout 240 python3 bench/serve_load.py --shape llama-3.1-8b --tp $tp --runs burst burst --requests 300 \
          --warmup 50 --spec 4 --out "$OUT/tp$tp-burst_8b.json" 2>"$OUT/tp$tp-burst_8b.log" >/dev/null
        echo "tp$tp burst rc $?"; grep '^run \|crash\|Error' "$OUT/tp$tp-burst_8b.log"
        pack
      done
      # the TP tests: the CPU ones (gloo) and the two-GPU one (NCCL, Triton kernels, CUDA graphs)
      timeout 200 python3 -m pytest tests/engine_ext/test_tensor_parallel.py -q -p no:cacheprovider \
        >"$OUT/tp_tests.log" 2>&1
      echo "tp tests rc $?: $(tail -1 "$OUT/tp_tests.log")" ;;
    fp8)  # issue 40: the W8A16 GEMM alone against cuBLAS bf16 and _scaled_mm (with a launch-settings sweep), then the
      # decode forward at 8B and 1B with bf16 and FP8 base weights in one run (FP8_SHAPES), adapters off and on
      # FP8_VARIANTS: whole settings the sweep also times (JSON words; default: wider GEMV tiles); FP8_GEMM_ARGS: the
      # products timed (default: the 8B's at the sweep's token counts, without _scaled_mm)
      read -r -a fp8_variants <<<"${FP8_VARIANTS:-{\"fp8_gemv_block_n\":128,\"fp8_block_k\":256\} {\"fp8_gemv_block_n\":128,\"fp8_warps\":8\}}"
      timeout ${FP8_GEMM_TIMEOUT:-240} python3 bench/fp8_gemm.py ${FP8_GEMM_ARGS:---shapes llama-3.1-8b --tokens 1 3 32 64 160 --no-scaled-mm} \
        ${FP8_SWEEP---sweep} --variants "${fp8_variants[@]}" --out "$OUT/fp8_gemm.json" >"$OUT/fp8_gemm.log" 2>&1
      echo "fp8 gemm rc $?"; grep sweep_best "$OUT/fp8_gemm.log" | cut -c1-400
      pack
      timeout ${FP8_FORWARD_TIMEOUT:-300} python3 bench/decode.py --shapes ${FP8_SHAPES:-llama-3.1-8b llama-3.2-1b} \
        --ranks 16 --batches 1 32 --adapters 0 32 --sections forward --quantization none fp8 --iters 20 \
        --kernel-settings "$KERNEL_SETTINGS" --out "$OUT/forward_fp8.json" 2>&1 | quiet >"$OUT/forward_fp8.log"
      echo "fp8 forward rc $?" ;;
    paths)  # issue 41: where a verify pass's LoRA runs (KernelSettings.lora_path), per shape and rank: the defaults,
      # folded, beside the products and after them (PATHS_VARIANTS: NAME=JSON words; PATHS_RANKS, default 16; about
      # 2 minutes at 1B on an H100, 4 at 8B), verify k=1..4 at batch 8 and 32
      # with the base model's floor; then where a batch-32 verify pass's GPU time goes, by kernel, on the defaults
      for shape in ${PATHS_SHAPES:-llama-3.2-1b llama-3.1-8b}; do
        for variant in ${PATHS_VARIANTS:-defaults='{}' fold='{"fold_multi_token_columns":1000000000,"fold_multi_layer_columns":0,"beside_multi_token_ranks":0}' beside='{"fold_multi_token_ranks":0,"beside_multi_token_ranks":65536}' after='{"fold_multi_token_ranks":0,"beside_multi_token_ranks":0}'}; do
          name=${variant%%=*}
          timeout ${PATHS_TIMEOUT:-150} python3 bench/decode.py --shapes $shape --ranks ${PATHS_RANKS:-16} --batches 8 32 \
            --adapters 0 8 32 --sections forward --iters 10 --kernel-settings "${variant#*=}" \
            --out "$OUT/paths-${shape#llama-}-$name.json" 2>&1 | quiet >"$OUT/paths-${shape#llama-}-$name.log"
          echo "paths $shape $name rc $?: $(grep 'batch 32 verify k=4' "$OUT/paths-${shape#llama-}-$name.log" | tr '\n' ' ')"
          pack
        done
        [ "${PATHS_PROFILE:-1}" = 0 ] && continue  # PATHS_PROFILE=0: the variants only
        timeout 120 python3 bench/profile_step.py --shape $shape --batch 32 --adapters 0 32 --rank 16 --tokens 1 5 \
          --out "$OUT/profile-${shape#llama-}.json" 2>&1 | quiet | tail -1
      done ;;
    vgemm)  # the base model's bf16 products from decode to verify-pass sizes, in two orientations and split in two
      timeout 120 python3 bench/verify_gemm.py --out "$OUT/verify_gemm.json" >"$OUT/verify_gemm.log" 2>&1
      echo "vgemm rc $?"; grep '"tokens": 160' "$OUT/verify_gemm.log" | cut -c1-200 ;;
    8b)  # the 8B shape, base and plain
      timeout 240 python3 bench/decode.py --shapes llama-3.1-8b --ranks 16 --batches 1 32 --adapters 0 32 \
        --sections forward --kernel-settings "$KERNEL_SETTINGS" \
        --out "$OUT/forward_8b.json" 2>&1 | quiet >"$OUT/forward_8b.log"
      echo "8b rc $?" ;;
    order)  # forward cost at batches 32-128 with rows in arrival order or grouped by adapter; eager vs graph
      timeout 200 python3 bench/forward_order.py --out "$OUT/order.json" >"$OUT/order.log" 2>&1
      echo "order rc $?" ;;
    attnrows)  # batch-128 forwards (decode, verify k=1..4, base-only of the same shapes) per attention tile height
      for rows in ${ATTN_ROWS:-16 32}; do
        timeout 150 python3 bench/forward_order.py --batches 128 --no-eager --kernel-settings "{\"attn_rows\": $rows}" \
          --out "$OUT/order-rows$rows.json" >"$OUT/order-rows$rows.log" 2>&1
        echo "attnrows $rows rc $?"
      done ;;
    profile)  # where a decode forward's GPU time goes, kernel by kernel (base and 32 rank-16 adapters)
      timeout 120 python3 bench/profile_step.py >"$OUT/profile.log" 2>&1; echo "profile rc $?" ;;
    fused)
      timeout 100 python3 bench/fused_sweep.py >"$OUT/fused.log" 2>&1; echo "fused rc $?" ;;
    attn)
      timeout 150 python3 bench/attn_sweep.py >"$OUT/attn.log" 2>&1; echo "attn rc $?" ;;
    *) echo "unknown step $step" ;;
  esac
  echo "  ($step: $((SECONDS - start)) s)"
  pack
done

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
for name in ("forward.json", "forward_8b.json", "forward_fp8.json", "gate.json", "gate16_hf.json", "gate256.json",
             "gate16_256.json"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    d = json.load(open(path))
    for r in d.get("forward", []):
        print(name, r.get("shape", ""), r.get("quantization", ""), r["mode"], "b", r["batch"], "a", r["adapters"],
              "gpu_ms %.3f" % r["gpu_ms"],  # the base model's verify-sized rows have no bytes model: nan
              "bytes_ms %.3f" % r.get("bytes_model_ms", float("nan")), "bw %.1f%%" % (100 * r.get("bw_fraction", float("nan"))))
    for r in d.get("load", []):
        print(name, "load r%d" % r["rank"], "load/h2d %.2f" % r["load_over_h2d"],
              "itl rise p50 %+.1f%% max %+.1f%%" % (100 * r["itl_rise_p50"], 100 * r["itl_rise_max"]))
    for r in d.get("engine", []):
        print(name, "r%d" % r["rank"], r["mode"], "%.0f tok/s" % r["tokens_per_s"], r.get("tokens_per_s_runs", ""),
              "acc", r.get("acceptance"),
              r.get("gate_decisions") or "", r.get("cycle_passes") or "", r.get("plain_cost_why") or "")
    for c in d.get("gate_check", []):
        print(name, "r%d" % c["rank"], c["mode"], "vs %s %+.1f%% (medians), rounds %s, acc %.2f"
              % (c["better"], 100 * c["vs_better"], c["vs_better_rounds"], c["acceptance"]))
    for r in d.get("hf", []):
        print(name, r["mode"], "b", r["batch"], "%.1f tok/s" % r["tokens_per_s"])
    for e in d.get("errors", []):
        print(name, "ERROR", e)
EOF
for f in "$OUT"/*.log; do grep -h "BEST" "$f" 2>/dev/null; done
pack
