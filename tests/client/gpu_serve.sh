#!/bin/bash
# tiermoe serve --backend cuda on a GPU machine that lacks the CLI's libraries (the lent H200:
# Ubuntu 24.04, no ICU 72, no cpp-httplib, no Node). Two steps:
#
#   here:   bash tests/client/gpu_serve.sh prepare BUILD   # BUILD: a CUDA build of tiermoe, best
#           configured with -DTIERMOE_NATIVE=OFF; fills build-srvdev/ (ignored, ~25 MB, xz-packed)
#   there:  bash build-srvdev/gpu_serve.sh run            # carry build-srvdev; results in $OUT
#
# The working tree travels too: keep it small (models/tinymix-code/*.xz are not needed).
# "run" checks greedy CUDA == CPU == transformers on the golden fixture mixtral_oldcfg (alone,
# streamed, 8 at once, 48 mixed requests at once vs alone; CUDA graphs on and off), the protocol (completions, chat, streaming,
# errors, metrics), a c=1/8/32 load on tinymix-code's shapes with --load-format dummy, an agent
# loop with the prefix cache on and off, and preemption under a small --kv-memory-mb, with
# gpu_client.py (standard-library Python: the machine has no Node).
set -u
if [ "${1:-}" = prepare ]; then
  B=${2:?give the build directory}
  D=build-srvdev
  mkdir -p $D/lib $D/lib2
  cp "$B/tiermoe" tests/client/gpu_serve.sh tests/client/gpu_client.py $D/
  for l in libicuuc.so.72 libicudata.so.72 libcpp-httplib.so.0.11 libbrotlicommon.so.1 libbrotlidec.so.1 libbrotlienc.so.1; do
    cp -L /lib/x86_64-linux-gnu/$l $D/lib/
  done
  for l in libssl.so.3 libcrypto.so.3; do cp -L /lib/x86_64-linux-gnu/$l $D/lib2/; done  # used only if missing there
  xz -f -T2 $D/tiermoe $D/lib/libicudata.so.72  # the transfer to the device is capped; "run" unpacks them
  du -sh $D
  exit 0
fi
[ "${1:-}" = run ] || { echo "usage: $0 prepare BUILD | run" >&2; exit 2; }
D=$(cd "$(dirname "$0")" && pwd)
for f in $D/tiermoe.xz $D/lib/libicudata.so.72.xz; do [ -f $f ] && xz -d -f $f; done
chmod +x $D/tiermoe
T=$D/tiermoe
OUT=${OUT:-/tmp/gpu_serve}
mkdir -p $OUT
export LD_LIBRARY_PATH=$D/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
if ldd $T | grep -q "not found"; then export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$D/lib2; fi
exec > >(tee -a $OUT/log.txt) 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
ldd $T | grep -E "not found|icu|httplib|cuda|cublas|ssl"
command -v node curl python3
wait_listening() {  # $1: the server's log
  for i in $(seq 1 240); do grep -q listening "$1" && return 0; sleep 0.5; done; cat "$1"; return 1; }

# 1. A golden fixture (Mixtral-style, BF16 weights) with a tokenizer of its family.
mkdir -p /tmp/fx && cp tests/fixtures/models/mixtral_oldcfg/* /tmp/fx/ && cp tests/fixtures/tokenizers/llama_style/tokenizer.json /tmp/fx/
IDS=$(python3 -c "import json;print(','.join(map(str,json.load(open('/tmp/fx/reference.json'))['ids'])))")
python3 -c "import json;print('transformers greedy', json.load(open('/tmp/fx/reference.json'))['greedy_ids'])" | tee $OUT/gen.txt
for b in cuda cpu; do
  echo "generate --backend $b:" | tee -a $OUT/gen.txt
  $T generate --model /tmp/fx --backend $b $([ $b = cpu ] && echo --kv f32) --prompt-ids $IDS --greedy --json --max-tokens 16 | tee -a $OUT/gen.txt
done
for graphs in 1 0; do
  TIERMOE_CUDA_GRAPHS=$graphs $T serve --model /tmp/fx --backend cuda --port 8101 > /tmp/s1.log 2>&1 &
  P=$!
  wait_listening /tmp/s1.log && { echo "serve fixture, graphs=$graphs:"; python3 $D/gpu_client.py ids http://127.0.0.1:8101 $IDS 16 8;
    python3 $D/gpu_client.py mixed http://127.0.0.1:8101 $IDS 48; } | tee -a $OUT/serve_fixture.txt
  kill $P; wait $P
done

# 2. tinymix-code's shapes with random weights (--load-format dummy), its tokenizer and the
#    ChatML template of the Qwen-style fixture: protocol, chat, streaming, load.
mkdir -p /tmp/tm && cp models/tinymix-code/{config.json,generation_config.json,tokenizer.json} /tmp/tm/
cp tests/fixtures/tokenizers/qwen_style/tokenizer_config.json /tmp/tm/
$T serve --model /tmp/tm --backend cuda --load-format dummy --port 8102 > /tmp/s2.log 2>&1 &
P=$!
wait_listening /tmp/s2.log
python3 $D/gpu_client.py smoke http://127.0.0.1:8102 > $OUT/smoke.json; echo "smoke rc=$?"
if command -v curl >/dev/null; then
  curl -sN http://127.0.0.1:8102/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}' > $OUT/curl_stream.txt
fi
python3 $D/gpu_client.py loadgen http://127.0.0.1:8102 1,8,32 > $OUT/loadgen.txt; echo "loadgen rc=$?"
cat $OUT/loadgen.txt
python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8102/metrics').read().decode())" > $OUT/metrics.txt
kill $P; wait $P; echo "serve exit=$?"
tail -3 /tmp/s2.log

# 3. The prefix cache on the GPU: an agent loop (each turn resends everything so far) on
#    tinymix's shapes, the cache on (default) and off; time to first token and cached tokens by turn.
xz -dc models/tinymix-code/heldout.txt.xz > /tmp/heldout.txt
for mb in 256 0; do
  $T serve --model /tmp/tm --backend cuda --load-format dummy --port 8103 --prefix-cache-mb $mb > /tmp/s3.log 2>&1 &
  P=$!
  wait_listening /tmp/s3.log && { echo "agent loop, --prefix-cache-mb $mb:";
    python3 $D/gpu_client.py agent http://127.0.0.1:8103 /tmp/heldout.txt 6; } | tee -a $OUT/agent.txt
  kill $P; wait $P
done

# 4. Preemption: a KV budget of 8 pages (4 MB; 8 KB per token at tinymix's shapes, 64-token pages)
#    for 48 requests of up to 112 tokens sent at once: they queue, sequences crossing a page are
#    preempted and resumed, and each should still equal the same request alone. The control: the
#    same without the budget. (Random weights give near-ties, where batched and lone kernels' sums
#    may pick different tokens; the prefix cache is off in both.)
for mb in 4 0; do
  $T serve --model /tmp/tm --backend cuda --load-format dummy --port 8104 --prefix-cache-mb 0 \
    $([ $mb -gt 0 ] && echo --kv-memory-mb $mb) > /tmp/s4.log 2>&1 &
  P=$!
  wait_listening /tmp/s4.log && echo "--kv-memory-mb $mb: $(python3 $D/gpu_client.py mixed http://127.0.0.1:8104 $IDS,$IDS,$IDS 48)" | tee -a $OUT/preempt.txt
  python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8104/metrics').read().decode())" |
    grep -E "^tiermoe_preemptions" | tee -a $OUT/preempt.txt
  kill $P; wait $P; echo "serve exit=$?"
done

# 5. The step size on a bench shape (Qwen3-30B-A3B's 16 layers, 8192 tokens: tinymix's tokenizer
#    fits): a ~4,000-token prompt arriving among 4 decoding streams, --step-tokens 256 (the CPU's default) /
#    2048 (the GPU's), prefix cache off (the rounds send the same prompt): its time to first token and the
#    streams' inter-token gaps.
mkdir -p /tmp/q3 && cp configs/qwen3-30b-a3b-L16-v8192.json /tmp/q3/config.json && cp /tmp/tm/tokenizer.json /tmp/q3/
for st in 256 2048; do
  $T serve --model /tmp/q3 --backend cuda --load-format dummy --port 8105 --step-tokens $st --prefix-cache-mb 0 > /tmp/s5.log 2>&1 &
  P=$!
  wait_listening /tmp/s5.log && for r in 1 2 3 4; do echo "step-tokens $st, round $r: $(python3 $D/gpu_client.py long http://127.0.0.1:8105 /tmp/heldout.txt 13000)"; done | tee -a $OUT/step.txt
  kill $P; wait $P
done
date -u
