#!/usr/bin/env bash
# One command on a CUDA machine: check every CUDA kernel and model against the CPU, then time the
# dummy-weight benchmarks. Logs and JSON go to $OUT (or ./gpu_out).
#   scripts/gpu_check.sh [full|quick|benchonly|again|profile|timeline|detail|batch|moe|ab|envs|fp8|trees|sanitize|codedtile]   (quick: no large
#   published configs; benchonly: no correctness check; again: the kernel table repeated plus racecheck/
#   initcheck; profile: per-kernel times of one decode step under ncu; timeline: the captured steps' kernels
#   under nsys, what each adds to a step once overlapped (scripts/graph_timeline.py); detail: ncu's throughput,
#   occupancy and warp-stall sections for one kernel of that step (DETAIL_KERNEL); batch: the kernel table,
#   then B = 1, 8, 32, 64 under the A/B variants in one process per config (batchtable), then the
#   model checks; moe: fused vs unfused MoE layer side by side; ab: the batch-1 benchmarks of
#   OLD_BIN (a tiermoe_cuda_check built from an earlier commit, run with its defaults) and of this
#   build (defaults, PDL off, BF16 prompt activations; new-nostage: no GEMV stage), interleaved in
#   one run, then the kernel table; envs: this build's batch-1 benchmarks under ENV_VARIANTS; fp8: the FP8 KV
#   pages' checks, the models, then BF16 against FP8 pages (batch 1, interleaved); trees: this build against
#   the source overlays in trees/ (scripts/export_tree.sh; carry trees), each built here, timed interleaved; sanitize: compute-sanitizer on case ranges of the longest
#   groups as parallel processes, spread over the machine's GPUs, SAN_JOBS="tool group N:M;...", e.g. what docs/cuda.md's
#   "Numerics, as measured" reports; codedtile: the coded K/V tile loader probe, docs/cuda.md plan item 4)
# Binaries: $CHECK_BIN (e.g. built elsewhere and carried), else ./build-gpu/tiermoe_cuda_check,
# built (or brought up to date) here with CMake.
# $CHECK_XZ: an xz-compressed tiermoe_cuda_check built elsewhere, unpacked to ./build-gpu first (about
# 6 MB: with the tracked tree at 62.9 MiB it no longer fits the device's 64 MiB transfer, 2026-12-05):
#   cmake -S tests/cuda -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTIERMOE_DATA_DIR=$PWD \
#     -DTIERMOE_CHECK_CUDA_ARCH=90-real -DTIERMOE_CHECK_LINEINFO=OFF   # SASS only, no line info: the transfer is capped
#   cmake --build build-gpu && mkdir -p ab && strip -o /tmp/tcc build-gpu/tiermoe_cuda_check && xz -9e -c /tmp/tcc > ab/tcc.xz
#   (on the device) CHECK_XZ=ab/tcc.xz scripts/gpu_check.sh quick
# Mode sampling: device against host sampling (TIERMOE_CUDA_SAMPLE=0): greedy, top-k 40 + top-p 0.95
# (the device's select path) and top-p alone (its sort path); no check first (run
# `tiermoe_cuda_check --kernels-only sample_tokens` and `--models-only` before).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
MODE=${1:-full}
if [ "$MODE" = timeline-libs ]; then  # here, not on the GPU machine: the libraries the timeline's importer lacks there
  mkdir -p build-timeline/lib && cp -L /usr/lib/x86_64-linux-gnu/libdw.so.1 /usr/lib/x86_64-linux-gnu/libelf.so.1 build-timeline/lib/
  exit 0
fi
log() { echo "[$(date +%H:%M:%S)] $*"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
log unpack; scripts/unpack_model.sh
if [ -n "${CHECK_XZ:-}" ]; then mkdir -p build-gpu && xz -dc "$CHECK_XZ" > build-gpu/tiermoe_cuda_check && chmod +x build-gpu/tiermoe_cuda_check; fi
C=${CHECK_BIN:-./build-gpu/tiermoe_cuda_check}
tree_variants=()
if [ "$MODE" = trees ]; then  # each overlay in trees/ (scripts/export_tree.sh) is this tree with its files.
  # One with CMake arguments in its .cmake_args (e.g. no files and a build option, to time the option
  # against this build) is built beside this one's build, in /tmp/tiermoe-tree-LABEL; the others
  # incrementally in build-gpu, once this tree is built there (below): only the files they change recompile.
  for d in trees/*/; do
    label=$(basename "$d"); t=/tmp/tiermoe-tree-$label
    tree_variants+=("$label BIN=$t/build/tiermoe_cuda_check")
    [ -f "$d.cmake_args" ] || continue
    rm -rf "$t" && mkdir -p "$t" && cp -r src tests "$t"/ && cp -r "$d". "$t"/ || exit 1
    while IFS= read -r f; do [ -n "$f" ] && rm -f "$t/$f"; done < "$d.deleted"
    read -ra extra <<< "$(cat "$d.cmake_args")"
    ( cmake -S "$t/tests/cuda" -B "$t/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTIERMOE_DATA_DIR=$PWD "${extra[@]}" > "$t/build.log" 2>&1 &&
      cmake --build "$t/build" -j8 --target tiermoe_cuda_check >> "$t/build.log" 2>&1 || { echo "trees: $label did not build"; tail -20 "$t/build.log"; } ) &
  done
  [ ${#tree_variants[@]} -gt 0 ] || { echo "trees: no overlay in trees/ (scripts/export_tree.sh REF LABEL; carry trees)"; exit 2; }
fi
# Built here unless CHECK_BIN or CHECK_XZ gave a binary: also when build-gpu/ has one already, since
# a machine kept warm between calls keeps build-gpu/ while the sources are this call's (ninja
# rebuilds what changed; on 2026-12-07 a call that skipped the build timed the call before's binary).
if [ -z "${CHECK_BIN:-}${CHECK_XZ:-}" ] || [ ! -x $C ]; then
  log build
  cmake -S tests/cuda -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTIERMOE_DATA_DIR=$PWD > "$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j16 --target tiermoe_cuda_check >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
if [ "$MODE" = trees ]; then  # the source overlays: each laid over this tree, built in build-gpu, its binary
  # copied out, this tree's files put back (touched, so a later build recompiles them) and this binary restored
  cp "$C" /tmp/tiermoe-this || exit 1
  lay_files() {  # SRC FILE...: each FILE as SRC has it (touched, so ninja rebuilds it), or removed where SRC lacks it
    local src=$1 f; shift
    for f in "$@"; do if [ -f "$src/$f" ]; then mkdir -p "$(dirname "$f")" && cp "$src/$f" "$f" && touch "$f"; else rm -f "$f"; fi; done
  }
  for d in trees/*/; do
    label=$(basename "$d"); t=/tmp/tiermoe-tree-$label
    [ -f "$d.cmake_args" ] && continue
    log "build overlay $label"; b=$(mktemp -d)
    mapfile -t files < <(cd "$d" && find . -type f ! -name .deleted | sed 's|^\./||'; grep -v '^$' .deleted)
    for f in "${files[@]}"; do [ -f "$f" ] && mkdir -p "$b/$(dirname "$f")" && cp "$f" "$b/$f"; done
    lay_files "$d" "${files[@]}"
    mkdir -p "$t/build"
    cmake --build build-gpu -j16 --target tiermoe_cuda_check > "$OUT/build_$label.log" 2>&1 && cp "$C" "$t/build/" ||
      { echo "trees: $label did not build"; tail -20 "$OUT/build_$label.log"; }
    lay_files "$b" "${files[@]}"
    rm -rf "$b"
  done
  cp /tmp/tiermoe-this "$C"
fi
if [ "$MODE" = sanitize ]; then  # no check first: each SAN_JOBS entry "tool group N:M [word ...]" is one process
  # (TIERMOE_CHECK_SKIP=N:M: the group's cases N .. M-1; VAR=value words go to its environment, e.g.
  # "racecheck sample_tokens 0:88 TIERMOE_CHECK_SAMPLE_BATCHED=1", other words to compute-sanitizer, e.g.
  # "--kernel-name kns=attention_prefill_kernel --launch-skip 2 --launch-count 1"), all in parallel, each
  # cut off at SAN_S seconds; one summary line per job in $OUT/summary.txt, the logs in $OUT/sanitize_logs.tar.xz.
  IFS=';' read -ra san_jobs <<< "${SAN_JOBS:-racecheck attention_prefill 0:8;racecheck attention_prefill 8:16;racecheck moe_prefill 0:12;memcheck sample_tokens 0:88}"
  # On a machine with several GPUs the jobs take them in turn (job i on GPU i mod n).
  L=$(mktemp -d) n_gpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') job_i=0
  san_one() {  # job-index gpu tool group N:M [VAR=value | --option ...]
    local i=$1 gpu=$2 tool=$3 group=$4 range=$5; shift 5
    local envs=() opts=() w
    for w in "$@"; do if [[ $w =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$w"); else opts+=("$w"); fi; done
    local f=$L/job${i}_${tool}_${group}_${range/:/-}.txt t0=$(date +%s)
    env CUDA_VISIBLE_DEVICES=$gpu TIERMOE_CHECK_SKIP=$range "${envs[@]}" timeout ${SAN_S:-440} compute-sanitizer --tool $tool "${opts[@]}" $C --kernels-only $group > $f 2>&1; local rc=$?
    echo "job $i gpu $gpu: $tool $group $range $* rc=$rc $(( $(date +%s) - t0 ))s ok=$(grep -c '^ok' $f) fail=$(grep -c '^FAIL' $f) | $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' $f | tail -1)" >> "$OUT/summary.txt"
  }
  for job in "${san_jobs[@]}"; do  # the GPU index is taken here: a background job's expansions happen in its own shell
    gpu=$(( job_i % (n_gpu > 0 ? n_gpu : 1) ))
    san_one $job_i $gpu $job &
    job_i=$(( job_i + 1 ))
  done
  wait
  tar cf - -C $L . | xz -9 > "$OUT/sanitize_logs.tar.xz"
  sort -n -k2 "$OUT/summary.txt"; exit 0
fi
if [ "$MODE" = batch ]; then  # kernels first, the table, the models last (the longest part)
  log kernels; timeout 60 $C --kernels-only 2>&1 | tee "$OUT/check.txt"
  for cfg in olmoe-1b-7b-v8192.json qwen3-30b-a3b-L16-v8192.json; do
    log "batchtable $cfg"; timeout 90 $C batchtable --config configs/$cfg --ctx ${CTX:-1024} --gen 16 | tee -a "$OUT/batch.jsonl"
  done
  python3 - "$OUT/batch.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    print(f"{j['config']:30s} {j['variant']:20s} B={j['batch']:2d} ctx {j['prompt_tokens']}  step p50 {j['ms_per_step_p50']:.3f} ms  p99 {j['ms_per_step_p99']:.3f}  {j['tokens_per_s']:.0f} tokens/s  tokens = first variant {j['tokens_equal_to_first_variant']}")
PY
  log models; timeout ${MODELS_S:-150} $C --models-only 2>&1 | tee -a "$OUT/check.txt"
  grep -E "^(FAIL|==)" "$OUT/check.txt"; exit 0
elif [[ ! "$MODE" =~ ^(benchonly|sampling|envs|profile|timeline|detail|fp8|trees|codedtile)$ ]]; then  # sampling, envs: the benchmarks alone; profile, detail: ncu alone; timeline: nsys alone
  log check
  timeout 240 $C 2>&1 | tee "$OUT/check.txt"
fi
if [ "$MODE" = again ]; then  # the kernel table twice more, then the race and init checkers
  for i in 1 2; do $C --kernels-only | grep -E "FAIL|moe|==" | tee -a "$OUT/again.txt"; done
  for tool in racecheck initcheck; do
    log $tool; timeout 100 compute-sanitizer --tool $tool $C --kernels-only > "$OUT/$tool.txt" 2>&1; tail -4 "$OUT/$tool.txt"
  done
  grep -E "^(FAIL|==)" "$OUT/check.txt"; exit 0
fi
if [ "$MODE" = detail ]; then  # ncu sections of one kernel in one eager decode step: why it is slow
  # DETAIL_KERNEL: a regex of kernel function names (default attention_prefill); DETAIL_ROW: "config
  # ctx batch" (default the Qwen3 16-layer shape, 4096 keys, B = 64); DETAIL_COUNT launches (default 1);
  # TIERMOE_BENCH_KV=fp8-all: on FP8 pages.
  set -- ${DETAIL_ROW:-qwen3-30b-a3b-L16-v8192.json 4096 64}; log "detail ${DETAIL_KERNEL:-attention_prefill} $*"
  TIERMOE_CUDA_GRAPHS=0 timeout ${DETAIL_S:-300} ncu --profile-from-start off --clock-control none \
    --kernel-name "regex:${DETAIL_KERNEL:-attention_prefill}" --launch-count ${DETAIL_COUNT:-1} \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --log-file "$OUT/detail.txt" \
    $C profile --config configs/$1 --ctx $2 --batch $3 > /dev/null
  grep -vE "^==PROF==|^ *-+ *$|^$" "$OUT/detail.txt" | head -${DETAIL_LINES:-120}
  exit 0
fi
if [ "$MODE" = timeline ]; then  # nsys: the captured decode steps' kernels as they overlap in the graph
  # TIMELINE_ROWS: "config ctx" rows separated by ';'. nsys and its importer come with Nsight Compute
  # on the lent H200 (/opt/nvidia/nsight-compute/*/host); the importer needs libdw.so.1, which that
  # machine lacks: `scripts/gpu_check.sh timeline-libs` here copies Debian's (libdw1, libelf1) into
  # build-timeline/lib, to be carried.
  H=$(ls -d /opt/nvidia/nsight-compute/*/host 2>/dev/null | tail -1)
  NSYS=$(command -v nsys || echo "$H/target-linux-x64/nsys") IMP=$(ls "$H"/*/QdstrmImporter 2>/dev/null | head -1)
  IFS=';' read -ra trows <<< "${TIMELINE_ROWS:-olmoe-1b-7b-v8192.json 16;qwen3-30b-a3b-L16-v8192.json 4096}"
  for tr in "${trows[@]}"; do
    set -- $tr; n=$OUT/timeline_${1%.json}_$2; log "timeline $1 ctx=$2"
    [ -n "${TIMELINE_REUSE:-}" ] && [ -f "$n.qdstrm" ] ||  # TIMELINE_REUSE=1: import a trace left by an earlier call
      timeout 200 "$NSYS" profile --cuda-graph-trace=node -t cuda -o "$n" --force-overwrite true \
      $C bench --config "configs/$1" --ctx "$2" --gen 24 --repeats 1 > "$n.log" 2>&1
    [ -f "$n.nsys-rep" ] || LD_LIBRARY_PATH=$PWD/build-timeline/lib:$(dirname "$IMP") "$IMP" -i "$n.qdstrm" > "$n.import.log" 2>&1 ||
      { tail -3 "$n.import.log"; continue; }
    "$NSYS" export --type sqlite -o "$n.sqlite" --force-overwrite true "$n.nsys-rep" > /dev/null 2>&1
    python3 scripts/graph_timeline.py "$n.sqlite" "$1 ctx $2" | tee -a "$OUT/timeline.txt"
    rm -f "$n.qdstrm" "$n.nsys-rep"
  done
  exit 0
fi
if [ "$MODE" = profile ]; then  # ncu: every kernel of one eager decode step, summed per kernel name
  # PROFILE_ROWS: "config ctx batch" rows separated by ';' (batch > 1: one forward_batch step of that many sequences)
  IFS=';' read -ra prows <<< "${PROFILE_ROWS:-olmoe-1b-7b-v8192.json 16 1;olmoe-1b-7b-v8192.json 4096 1;qwen3-30b-a3b-L16-v8192.json 4096 1}"
  for cc in "${prows[@]}"; do
    set -- $cc; log "profile $1 ctx=$2 B=$3"
    TIERMOE_CUDA_GRAPHS=0 timeout 120 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
      --csv --print-units base --log-file "$OUT/ncu.csv" $C profile --config configs/$1 --ctx $2 --batch $3 > /dev/null
    python3 - "$OUT/ncu.csv" "$1 ctx=$2 B=$3" <<'PY' | tee -a "$OUT/profile.txt"
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')) if r[-1].replace(',', '').replace('.', '').isdigit()]
tot = collections.OrderedDict()
for r in rows:
    # ncu writes anonymous namespaces as <unnamed> (or (anonymous namespace)): dropped first.
    name = r[4].replace('void ', '').replace('<unnamed>::', '').replace('(anonymous namespace)::', '')
    name = name.replace('tiermoe::cuda::', '').split('(')[0]  # template arguments kept: <true, 8> vs <false, 8>
    c, t = tot.get(name, (0, 0.0)); tot[name] = (c + 1, t + float(r[-1].replace(',', '')) / 1e3)
s = sum(t for c, t in tot.values())
print(f"== {sys.argv[2]}: {len(rows)} kernels, {s:.1f} us of kernel time (ncu, serialized)")
for n, (c, t) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
    print(f"  {n:44s} x{c:4d} {t:8.1f} us  {t / c:6.2f} us each  {100 * t / s:5.1f}%")
PY
  done
  exit 0
fi
rows() {  # one line per JSON result in $1
  python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    print(f"{j['config']:30s} {j.get('variant', ''):14s} B={j['batch']:2d} ctx {j['prompt_tokens']}  step p50 {j['ms_per_token_p50']:.3f} ms  p99 {j['ms_per_token_p99']:.3f}  {j['tokens_per_s']:.0f} tokens/s  ttft {j['ttft_ms']:.1f} ms")
PY
}
# `bench` of each row ("config ctx gen repeats [batch]", rows separated by ';') under each variant ("label
# [BIN=path] [VAR=value ...]": this build, or BIN, with those variables), ROUNDS rounds interleaved,
# into $OUT/NAME.jsonl with the label as "variant"; then the table.
bench_variants() {  # NAME ROWS ROUNDS VARIANT...
  local name=$1 round row v w bin
  local -a brows cfg words envs vars=("${@:4}")
  IFS=';' read -ra brows <<< "$2"
  for row in "${brows[@]}"; do
    read -ra cfg <<< "$row"
    for round in $(seq "$3"); do
      for v in "${vars[@]}"; do
        read -ra words <<< "$v"
        bin=$C envs=()
        for w in "${words[@]:1}"; do if [[ $w == BIN=* ]]; then bin=${w#BIN=}; else envs+=("$w"); fi; done
        log "$name ${cfg[0]} ctx=${cfg[1]} ${words[*]} round $round"
        timeout ${BENCH_S:-90} env "${envs[@]}" "$bin" bench --config "configs/${cfg[0]}" --ctx "${cfg[1]}" --gen "${cfg[2]}" \
          --repeats "${cfg[3]}" ${cfg[4]:+--batch "${cfg[4]}"} | sed "s/^{/{\"variant\":\"${words[0]}\",/" >> "$OUT/$name.jsonl"
      done
    done
  done
  rows "$OUT/$name.jsonl"
}
if [ "$MODE" = ab ]; then  # before/after in one run: rounds of old, new, new + PDL per row
  # AB_VARIANTS (default "old new new-nopdl new-bf16prompt"; without "old" no OLD_BIN is needed):
  # each this build with one switch, or OLD_BIN with its own defaults.
  declare -A ab_env=(
    [old]="BIN=${OLD_BIN:-}" [new]=""
    [new-nopdl]="TIERMOE_CUDA_PDL=0"                  # no programmatic dependent launch
    [new-bf16prompt]="TIERMOE_CUDA_SPLIT=0"           # prompt activations in one BF16 part
    [new-nostage]="TIERMOE_CUDA_GEMV_STAGE=0"         # no GEMV input stage in shared memory
    [new-notc]="TIERMOE_CUDA_DECODE_TC=0"             # batch-1 decode attention never on the tensor cores
    [new-tcall]="TIERMOE_CUDA_DECODE_TC_MIN_G=1 TIERMOE_CUDA_DECODE_TC=1024"  # on them for every G (OLMoE's 1 too) from 1024 keys
    [new-tc1]="TIERMOE_CUDA_DECODE_TC=1"              # on them from the first key (G >= 4), for the short-context rows
    [new-rows1]="TIERMOE_CUDA_GEMV3_ROWS=1" [new-rows2]="TIERMOE_CUDA_GEMV3_ROWS=2"  # gemv3 with 1 / 2 rows per warp
    [new-routekernel]="TIERMOE_CUDA_ROUTE=kernel"     # the router as its own launch, not in the o projection
    [new-ropelate]="TIERMOE_CUDA_ROPE_EARLY=0"        # qk_norm_rope's pos, norm weights and angles after the wait
    [new-tcrows]="TIERMOE_CUDA_TC_KEYS=0"             # the tensor-core decode's row form instead of the keys form
    [new-smallgemv]="TIERMOE_CUDA_SMALL_T_BLAS=0"     # T = 2..8 projections always on the GEMVs (batches: batchtable)
    [new-gemvcores]="TIERMOE_CUDA_GEMV_TC=0"          # T = 2..8 projections off the tensor cores (batches: batchtable)
    [new-moerows]="TIERMOE_CUDA_MOE_TC=0")            # T = 2..8 MoE down by rows, not per distinct expert on the tensor cores
  ab_variants=()
  for v in ${AB_VARIANTS:-old new new-nopdl new-bf16prompt}; do
    [ -n "${ab_env[$v]+set}" ] || { echo "ab: unknown variant '$v' (one of: ${!ab_env[*]})"; exit 2; }
    [ $v != old ] || [ -x "${OLD_BIN:-}" ] || { echo "ab: OLD_BIN must name the earlier build's tiermoe_cuda_check"; exit 2; }
    ab_variants+=("$v ${ab_env[$v]}")
  done
  # AB_ROWS: "config ctx gen repeats" rows separated by ';' (default: the two shapes at ctx 16 and 4096)
  bench_variants ab "${AB_ROWS:-olmoe-1b-7b-v8192.json 16 128 3;olmoe-1b-7b-v8192.json 4096 64 2;qwen3-30b-a3b-L16-v8192.json 16 128 3;qwen3-30b-a3b-L16-v8192.json 4096 64 2}" 2 "${ab_variants[@]}"
  [ "${AB_CHECK:-1}" = 0 ] && exit 0  # AB_CHECK=0: the kernel table was run before
  log kernels; timeout 90 $C --kernels-only > "$OUT/check.txt" 2>&1; grep -E "^(FAIL|==)" "$OUT/check.txt"
  exit 0
fi
if [ "$MODE" = fp8 ]; then  # FP8 KV pages: their kernel checks, the FP8 model variants, then batch-1
  # benchmarks with BF16 and FP8 pages interleaved (FP8_ROWS: "config ctx gen repeats" rows separated by ';';
  # FP8_ROUNDS rounds)
  log kernels; timeout 150 $C --kernels-only fp8 > "$OUT/check.txt" 2>&1; grep -E "^(FAIL|==)" "$OUT/check.txt"
  log models; timeout ${MODELS_S:-200} $C --models-only FP8 > "$OUT/models.txt" 2>&1; grep -E "^(ok|FAIL|note|==)" "$OUT/models.txt"
  bench_variants fp8 "${FP8_ROWS:-olmoe-1b-7b-v8192.json 4096 64 2;qwen3-30b-a3b-L16-v8192.json 4096 64 2;olmoe-1b-7b.json 4000 64 2}" \
    "${FP8_ROUNDS:-2}" bf16 "fp8 TIERMOE_BENCH_KV=fp8-all"
  exit 0
fi
if [ "$MODE" = trees ]; then  # this build against the overlays' builds: TREE_CHECKS kernel groups in each
  # build, this one's first (';'-separated, default none), then ENV_ROWS ("config ctx gen repeats [batch]")
  # timed under "this" and each label, ENV_ROUNDS rounds
  wait  # the overlays' builds
  IFS=';' read -ra tree_checks <<< "${TREE_CHECKS:-}"
  for v in "this BIN=$C" "${tree_variants[@]}"; do
    label=${v%% *} bin=${v#*BIN=}
    [ -x "$bin" ] || { echo "trees: $label has no binary"; exit 1; }
    for g in "${tree_checks[@]}"; do
      timeout 120 "$bin" --kernels-only "$g" > "$OUT/check_${label}_$g.txt" 2>&1
      echo "$label $g: $(grep -E '^==.*cases' "$OUT/check_${label}_$g.txt" | tail -1)"; grep -m3 '^FAIL' "$OUT/check_${label}_$g.txt"
    done
  done
  # TREE_ENVS: "name VAR=value ..." entries separated by ';': every build under each, labelled LABEL-name
  IFS=';' read -ra tree_envs <<< "${TREE_ENVS:-}"
  [ ${#tree_envs[@]} -gt 0 ] || tree_envs=("")
  tree_runs=()
  for e in "${tree_envs[@]}"; do
    read -ra ew <<< "$e"
    suffix=${ew[0]:+-${ew[0]}} vars="${ew[*]:1}"
    tree_runs+=("this$suffix $vars")
    for v in "${tree_variants[@]}"; do tree_runs+=("${v%% *}$suffix ${v#* } $vars"); done
  done
  bench_variants trees "${ENV_ROWS:-olmoe-1b-7b-v8192.json 16 128 3;qwen3-30b-a3b-L16-v8192.json 16 128 3}" "${ENV_ROUNDS:-2}" \
    "${tree_runs[@]}"
  exit 0
fi
if [ "$MODE" = envs ]; then  # batch-1 benchmarks of this build under environment variants, interleaved
  # ENV_VARIANTS: "label VAR=value ..." entries separated by ';' (a label alone: the defaults);
  # ENV_ROWS: "config ctx gen repeats" rows separated by ';'; ENV_ROUNDS rounds (default 2).
  IFS=';' read -ra env_variants <<< "${ENV_VARIANTS:-default}"
  bench_variants envs "${ENV_ROWS:-qwen3-30b-a3b-L16-v8192.json 4096 64 2}" "${ENV_ROUNDS:-2}" "${env_variants[@]}"
  exit 0
fi
if [ "$MODE" = codedtile ]; then  # the coded K/V tile loader probe (tests/cuda/coded_tile.cu): its checks, then JSON lines
  timeout 300 $C codedtile | tee "$OUT/codedtile.txt"; exit "${PIPESTATUS[0]}"
fi
if [ "$MODE" = sampling ]; then  # same binary, two interleaved rounds
  # greedy; topk: the CLI's default sampling (the select path); topp: top-p alone (the sort path).
  # $HOST_MODES: the modes also timed with host sampling (TIERMOE_CUDA_SAMPLE=0).
  # $SAMPLING_ROWS: "config ctx gen repeats batch" rows, separated by ';'.
  IFS=';' read -ra srows <<< "${SAMPLING_ROWS:-qwen3-30b-a3b.json 16 64 2 1;olmoe-1b-7b-v8192.json 16 128 3 1;qwen3-30b-a3b.json 1024 32 1 8}"
  for round in 1 2; do
    for row in "${srows[@]}"; do
      set -- $row
      for mode in greedy topk topp; do
        s=""; [ $mode = topk ] && s="--temperature 0.8 --top-k 40 --top-p 0.95"
        [ $mode = topp ] && s="--temperature 0.8 --top-p 0.95"
        for dev in 0 1; do
          [ $dev = 0 ] && [[ " ${HOST_MODES:-greedy topk topp} " != *" $mode "* ]] && continue
          log "$1 ctx $2 B=$5 $mode TIERMOE_CUDA_SAMPLE=$dev round $round"
          TIERMOE_CUDA_SAMPLE=$dev timeout 80 $C bench --config configs/$1 --ctx $2 --gen $3 --repeats $4 --batch $5 $s |
            sed "s/^{/{\"variant\":\"$mode device=$dev r$round\",/" >> "$OUT/$MODE.jsonl"
        done
      done
    done
  done
  rows "$OUT/$MODE.jsonl"
  exit 0
fi
if [ "$MODE" = moe ]; then
  # The fused MoE layer against the unfused one (same binary, one run), B = 1 and 8, ctx 1024;
  # fused-routekernel: the fused kernels with the router as a launch of its own (TIERMOE_CUDA_ROUTE=kernel).
  sizes="1 8"; variants="grouped fused fused-routekernel unfused"; gen=64
  for cfg in olmoe-1b-7b-v8192.json qwen3-30b-a3b-L16-v8192.json; do
    for B in $sizes; do
      for moe in $variants; do
        log "$MODE $cfg B=$B $moe"
        route=oproj; [ $moe = fused-routekernel ] && route=kernel
        timeout 100 env TIERMOE_CUDA_MOE=${moe%-routekernel} TIERMOE_CUDA_ROUTE=$route $C bench --config configs/$cfg --ctx 1024 --gen $gen --repeats 2 --batch $B |
          sed "s/^{/{\"variant\":\"$moe\",/" >> "$OUT/$MODE.jsonl"
      done
    done
  done
  rows "$OUT/$MODE.jsonl"
  exit 0
fi
bench() {  # config-or-model ctx gen repeats [env]
  local src=$1 ctx=$2 gen=$3 rep=$4 arg
  if [ -f "configs/$src" ]; then arg="--config configs/$src"; else arg="--model $src"; fi
  log "bench $src ctx=$ctx gen=$gen ${5:-}"
  timeout 75 env ${5:-TIERMOE_NOP=1} $C bench $arg --ctx $ctx --gen $gen --repeats $rep | tee -a "$OUT/bench.jsonl"
}
log bench
bench models/tinymix-code 512 64 3
bench olmoe-1b-7b-v8192.json 16 128 3
bench olmoe-1b-7b-v8192.json 4096 64 2
bench qwen3-30b-a3b-L16-v8192.json 16 128 3
bench qwen3-30b-a3b-L16-v8192.json 4096 64 2
bench qwen3-30b-a3b-L16-v8192.json 16 128 3 TIERMOE_CUDA_GRAPHS=0
if [ "$MODE" = full ] || [ "$MODE" = benchonly ]; then
  bench olmoe-1b-7b.json 4000 64 2  # its context is 4096
  bench qwen3-30b-a3b.json 4096 64 2
  bench mixtral-8x7b.json 4096 32 2
  # Long contexts (docs/benchmarks.md "Long contexts"): the Qwen3 shapes take 40960 positions,
  # Mixtral 32768 (its weights need an H200).
  bench qwen3-30b-a3b-L16-v8192.json 32768 32 1
  bench qwen3-30b-a3b.json 32768 16 1
  bench mixtral-8x7b.json 32000 16 1
fi
if [ "$MODE" != benchonly ] && command -v compute-sanitizer >/dev/null; then
  log memcheck
  timeout 60 compute-sanitizer --tool memcheck $C --kernels-only > "$OUT/memcheck.txt" 2>&1
  tail -3 "$OUT/memcheck.txt"
fi
log summary
[ -f "$OUT/check.txt" ] && grep -E "^(FAIL|==)" "$OUT/check.txt"
python3 - "$OUT/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try: j = json.loads(line)
    except Exception: continue
    print(f"{j.get('config',''):30s} {j.get('env',''):22s} ctx {j['prompt_tokens']:5d}  p50 {j['ms_per_token_p50']:.3f} ms  p99 {j['ms_per_token_p99']:.3f}  ttft {j['ttft_ms']:.1f} ms  floor {j.get('floor_ms',0):.3f} ms  frac {j.get('fraction_of_floor',0):.2f}  bw {j.get('copy_bandwidth_GBps',0):.0f} GB/s")
PY
