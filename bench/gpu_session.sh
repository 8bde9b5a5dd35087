#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, in as few device calls as possible:
#
#     bash bench/gpu_session.sh STAGE...      (stages: tests decode ab abbase graph_steps yoco tune_norm moe moe_fp8
#                                              serving serving_ab serving_ref profile mtp mm grammar tp tp_tests
#                                              tp_decode tp_prefill tp_serving fp8 fp8kv fp8_gemv prompt_wave
#                                              moe_align)
#
# Runs from the repo root on the GPU machine (torch, triton and transformers installed there). Wheels the
# serving stage needs but the machine lacks (pyzmq, fastapi, uvicorn, openai, ...) are installed from .whl/
# when that folder is present (`bash bench/fetch_device_wheels.sh` fills it). Every result lands in $RESULTS
# (JSON, PNG, logs); with $OUT set (the device tool's output folder) they are packed into $OUT/results.tgz at
# the end.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
RESULTS=${RESULTS:-/tmp/srt-results}
mkdir -p "$RESULTS"
BENCH="python3 bench/bench_one_batch.py --load-format dummy --dtype bfloat16"

if [ -d .whl ]; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"

stage_tests() {  # the tests marked gpu: TESTS (files; default every file with a gpu mark), TESTS_PART=K/M (the
    # K-th of M shares of those files, K = 1..M: the whole suite no longer fits one call; on 2026-11-27 the first
    # of 3 shares ran past 470 s, so take 4), TESTS_TIMEOUT
    local files=${TESTS:-$(grep -rl "mark.gpu" test --include="test_*.py" | sort)}
    if [ -n "${TESTS_PART:-}" ]; then
        files=$(echo "$files" | tr ' ' '\n' | awk -v k="${TESTS_PART%/*}" -v m="${TESTS_PART#*/}" 'NF && (NR - 1) % m == k - 1')
    fi
    local out="$RESULTS/gpu-tests${TESTS_PART:+-$(echo "$TESTS_PART" | tr / -)}.txt"
    # a file that fails to import is reported and the other files still run (a missing wheel once voided a part);
    # at the time limit pytest gets SIGINT, so that it still prints the failures so far (a kill left only dots)
    timeout -s INT -k 30 ${TESTS_TIMEOUT:-400} python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        --continue-on-collection-errors $files >"$out" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed|KeyboardInterrupt" "$out"  # the last: it ran out of time
}

stage_decode() {  # decode at batch 1 and 32 (512-token context) and the 7000-token prefill, per model
    # BASELINE="--baseline transformers" times transformers in the same runs
    for model in ${MODELS:-E4B E2B 26B-A4B}; do
        extra="${BASELINE:-}"
        [ "$model" = 26B-A4B ] && extra="$extra --swa-full-tokens-ratio 1"
        timeout 240 $BENCH --model-path gemma-4-$model-it $extra --batch-size 1 32 --input-len 512 \
            --output-len 32 --json "$RESULTS/decode-$model.json"
        timeout 240 $BENCH --model-path gemma-4-$model-it $extra --batch-size 1 --input-len 7000 \
            --output-len 2 --json "$RESULTS/prefill-$model.json"
    done
}

stage_fp8() {  # bf16 vs --quantization fp8 side by side: decode E4B batch 1 and 32, 31B batch 1 (512-token
    # context), prefill 1 x 7000 of E4B, then the FP8 kernels' GPU tests. FP8_MODELS overrides "E4B:1 32;31B:1",
    # FP8_PREFILL_MODELS "E4B"; FP8_PARTS (default "decode prefill tests") splits the stage over device calls;
    # FP8_EXTRA: more flags for the FP8 runs, decode and prefill (e.g. "--kv-cache-dtype fp8_e4m3", #26's FP8
    # weights and KV: its prefill spills registers in the extend kernel, docs/benchmarks.md).
    # With --quantization fp8 the floors count the dense projections at one byte per weight (MoE experts at 16 bits).
    parts=" ${FP8_PARTS:-decode prefill tests} "
    IFS=';' read -ra runs <<<"${FP8_MODELS:-E4B:1 32;31B:1}"
    [[ $parts == *" decode "* ]] && for run in "${runs[@]}"; do
        model=${run%%:*}
        for quant in bf16 fp8; do
            flag="" && [ $quant = fp8 ] && flag="--quantization fp8 ${FP8_EXTRA:-}"
            [ "$model" = 26B-A4B ] && flag="$flag --swa-full-tokens-ratio 1"
            echo "--- $model $quant decode $flag"
            timeout 280 $BENCH --model-path gemma-4-$model-it $flag --batch-size ${run#*:} --input-len 512 \
                --output-len 32 --json "$RESULTS/fp8-decode-$model-$quant.json" 2>&1 | grep -E "^batch|Error|error"
        done
    done
    [[ $parts == *" prefill "* ]] && for model in ${FP8_PREFILL_MODELS:-E4B}; do
        for quant in bf16 fp8; do
            flag="" && [ $quant = fp8 ] && flag="--quantization fp8 ${FP8_EXTRA:-}"
            echo "--- $model $quant prefill 1 x 7000 $flag"
            timeout 240 $BENCH --model-path gemma-4-$model-it $flag --batch-size 1 --input-len 7000 --output-len 2 \
                --json "$RESULTS/fp8-prefill-$model-$quant.json" 2>&1 | grep -E "^batch|Error|error"
        done
    done
    [[ $parts == *" tests "* ]] && TESTS="test/kernels/test_decode_gemm_fp8_kernel.py test/kernels/test_decode_gemv_fp8_kernel.py \
        test/kernels/test_fp8_quant_kernel.py test/kernels/test_fp8_block_gemm_kernel.py test/test_fp8_linear.py \
        test/layers/test_linear.py" \
        stage_tests
}

stage_fp8_gemv() {  # the one-row FP8 kernel: its sweep (bench/tune/tune_decode_gemv_fp8.py), then batch-1 decode with
    # it and without (SRT_FP8_GEMV=0: W8A8) for GEMV_MODELS (default "E4B 31B"), FP8 weights + FP8 KV, 512 context
    timeout 300 python3 bench/tune/tune_decode_gemv_fp8.py --out "$RESULTS/tune-decode-gemv-fp8-h100.json" 2>&1 \
        | grep -E "^\[|^  |Error|error" | grep -v "^  ptx"
    for model in ${GEMV_MODELS:-E4B 31B}; do
        for gemv in 1 0; do
            echo "--- $model SRT_FP8_GEMV=$gemv"
            SRT_FP8_GEMV=$gemv timeout 200 $BENCH --model-path gemma-4-$model-it --quantization fp8 \
                --kv-cache-dtype fp8_e4m3 --batch-size 1 --input-len 512 --output-len 32 \
                --json "$RESULTS/fp8-gemv-$model-$gemv.json" 2>&1 | grep -E "^batch|Error|error" | grep -v floor
        done
    done
}

stage_fp8kv() {  # decode with --kv-cache-dtype auto beside fp8_e4m3, alternated (E4B batch 1 and 32, 512 context)
    # MODELS (default E4B), FP8KV_BATCH (default "1 32"), FP8KV_ROUNDS (default 2), FP8KV_INPUT_LEN (default 512)
    for model in ${MODELS:-E4B}; do
        extra=""
        [ "$model" = 26B-A4B ] && extra="--swa-full-tokens-ratio 1"
        for round in $(seq ${FP8KV_ROUNDS:-2}); do
            for kv in auto fp8_e4m3; do
                echo "--- $model kv-cache-dtype $kv (round $round)"
                timeout 240 $BENCH --model-path gemma-4-$model-it $extra --kv-cache-dtype $kv \
                    --batch-size ${FP8KV_BATCH:-1 32} --input-len ${FP8KV_INPUT_LEN:-512} --output-len 32 \
                    --json "$RESULTS/fp8kv-$model-$kv-$round.json" 2>&1 \
                    | grep -E "decode .* ms/step|KV memory|KV pools|Error|error" | grep -v floor
            done
        done
    done
}

stage_mtp() {  # MTP: plain decode step vs draft round vs verify step, ms per output token, simulated acceptance
    # MODELS (default E4B), MTP_BATCH (default "1 32"), ACCEPT_LEN (default 2.5 tokens per round, bonus included)
    for model in ${MODELS:-E4B}; do
        extra=""
        [ "$model" = 26B-A4B ] && extra="--swa-full-tokens-ratio 1"
        SRT_SIMULATE_ACCEPT_LEN=${ACCEPT_LEN:-2.5} timeout 420 $BENCH --model-path gemma-4-$model-it $extra \
            --speculative-draft-model-path gemma-4-$model-it-assistant --batch-size ${MTP_BATCH:-1 32} \
            --input-len 512 --output-len ${MTP_OUTPUT_LEN:-128} --json "$RESULTS/mtp-$model.json" 2>&1 \
            | grep -E "^batch|Error|error"
    done
}

stage_tp() {  # #28 on a machine with 2+ GPUs: all of the parts below (TP_SERVING=1 adds tp_serving)
    stage_tp_tests
    stage_tp_decode
    stage_tp_prefill
    [ -n "${TP_SERVING:-}" ] && stage_tp_serving
}

stage_tp_tests() {  # the tiny variants on two GPUs vs one (bf16, NCCL, CUDA graphs), two replicas
    nvidia-smi -L
    nvidia-smi topo -m | head -4
    timeout 400 python3 -m pytest -q -s -m gpu -p no:cacheprovider --tb=short test/test_tensor_parallel.py \
        test/test_data_parallel.py 2>&1 | grep -E "rank|^(FAILED|ERROR)|passed|failed|Error"
}

stage_tp_decode() {  # 31B TP=1 vs TP=2, decode batch 1 and 32 at 512 tokens; 26B-A4B TP=2 (TP_RUNS overrides)
    # a run is MODEL:TP:BATCHES[:FLAG], e.g. 31B:2:1:--disable-cuda-graph. 31B at TP=1 holds 13.2k KV tokens
    # beside its weights on one H100: batch 32 (17.4k tokens) and 24 (13.1k) do not fit (docs/benchmarks.md)
    for run in ${TP_RUNS:-31B:1:1 31B:2:1,32 26B-A4B:2:1,32}; do
        IFS=: read -r model tp sizes flag <<<"$run"
        extra="$flag" && [ "$model" = 26B-A4B ] && extra="$extra --swa-full-tokens-ratio 1"
        echo "--- $model TP=$tp batch $sizes $flag"
        timeout 300 $BENCH --model-path gemma-4-$model-it --tp-size $tp $extra --batch-size ${sizes//,/ } \
            --input-len 512 --output-len 32 --json "$RESULTS/tp$tp-decode-$model-bs${sizes//,/-}${flag//[ -]/}.json" \
            2>&1 | grep -E "^(TP|batch|all-|KV|device|decode step)|Error|error|fit"
    done
}

stage_tp_prefill() {  # 31B prefill 1 x 7000, TP=1 vs TP=2
    for tp in 1 2; do
        timeout 240 $BENCH --model-path gemma-4-31B-it --tp-size $tp --batch-size 1 --input-len 7000 \
            --output-len 2 --json "$RESULTS/tp$tp-prefill-31B.json" 2>&1 | grep -E "^(TP|batch)|Error|error"
    done
}

wait_healthy() {  # until the server on port 30000 answers /health, at most $1 seconds
    for _ in $(seq "$1"); do
        curl -sf http://127.0.0.1:30000/health >/dev/null && return 0
        sleep 1
    done
}

stage_tp_serving() {  # 31B dummy bf16 with --tp-size 2 behind the HTTP server: the chat workload (1000/1000, 32)
    python3 -m srt.launch_server --model gemma-4-31B-it --load-format dummy --tp-size 2 --port 30000 \
        --log-interval 5 >"$RESULTS/server-tp2-31B.log" 2>&1 &
    server=$!
    wait_healthy 300
    timeout ${TP_SERVING_TIMEOUT:-300} python3 bench/bench_serving.py --base-url http://127.0.0.1:30000 --workload chat \
        --output-json "$RESULTS/serving-tp2-31B-chat.json" | grep -E "throughput|Duration|Successful|TTFT|TPOT"
    kill -TERM $server
    wait $server
    tail -3 "$RESULTS/server-tp2-31B.log"
}

stage_grammar() {  # #25: 32 json_schema requests vs 32 free ones, decode step overhead (E4B dummy)
    timeout 300 python3 bench/bench_grammar.py --model-path gemma-4-E4B-it --load-format dummy --batch-size 32 \
        --output-len 64 --json "$RESULTS/grammar-E4B.json" 2>&1 | grep -E "batch|overhead|Error"
}

stage_mm() {  # the vision encoder: one call per image vs one batched call per size bucket (MODELS: E2B 26B-A4B)
    for model in ${MODELS:-E2B 26B-A4B}; do
        timeout 200 python3 bench/bench_mm_encoder.py --model gemma-4-$model-it --images-per-request 6 \
            --requests 1 4 --image-size 480 480 --json "$RESULTS/mm-encoder-$model.json" 2>&1 | grep -E "x|Error"
    done
}

ab_decode() {  # one A/B run: decode of AB_MODEL at AB_BATCH, 512-token context (AB_ARGS: more flags); its ms/step lines
    timeout 240 $BENCH --model-path gemma-4-${AB_MODEL:-E4B}-it --batch-size ${AB_BATCH:-1 32} --input-len 512 \
        --output-len 32 ${AB_ARGS:-} "$@" 2>&1 | grep -E "decode .* ms/step|Error|error" | grep -v floor
}

stage_ab() {  # decode with and without environment switches: AB="A=1 B=2;C=3" is two runs beside the plain one
    IFS=';' read -ra settings <<<"${AB:-}"
    for setting in "" "${settings[@]}"; do
        echo "--- ${setting:-(plain)}"
        ([ -z "$setting" ] || export $setting; ab_decode --json "$RESULTS/ab-$(echo "${setting:-plain}" | tr ' =,' '_.-').json")
    done
}

stage_abbase() {  # this tree vs the tree in $AB_BASE (its own srt/ and bench/), alternated AB_ROUNDS times
    # E4B (AB_MODEL) decode at batch 1 and 32 (512-token context) and the 1 x 7000 prefill, or the
    # bench_one_batch shapes in AB_SHAPES ("SHAPE;SHAPE"). Make AB_BASE where the commits are (the GPU machine's
    # copy may lack them) and carry it:
    #     mkdir base && git archive COMMIT srt bench | tar -x -C base
    [ -d "${AB_BASE:-base}/srt" ] || { echo "abbase: no ${AB_BASE:-base}/srt"; return 1; }
    IFS=';' read -ra shapes <<<"${AB_SHAPES:-"--batch-size 1 32 --input-len 512 --output-len 32;--batch-size 1 --input-len 7000 --output-len 2"}"
    for round in $(seq ${AB_ROUNDS:-1}); do
        for tree in . "${AB_BASE:-base}"; do
            label=$tree && [ "$tree" = . ] && label="this tree"
            name=$(basename "$(realpath "$tree")")
            echo "--- $label (round $round)"
            for shape in "${shapes[@]}"; do
                PYTHONPATH=$tree:$PYTHONPATH timeout 240 python3 "$tree/bench/bench_one_batch.py" --load-format dummy \
                    --dtype bfloat16 --model-path gemma-4-${AB_MODEL:-E4B}-it $shape \
                    --json "$RESULTS/abbase-${AB_MODEL:-E4B}-$name-$round-$(echo $shape | tr -d ' -' | cut -c1-24).json" 2>&1 \
                    | grep -E "^batch|Error|error" | grep -v floor
            done
        done
    done
}

stage_graph_steps() {  # prefills and mixed steps with CUDA graphs per token count and eagerly, alternated
    timeout 400 python3 bench/bench_graph_steps.py --model-path gemma-4-${AB_MODEL:-E4B}-it --load-format dummy \
        --dtype bfloat16 --prefill-lens ${STEP_LENS:-128 512 1000 2000} --decode-rows ${STEP_ROWS:-0 31} \
        --json "$RESULTS/graph-steps-${AB_MODEL:-E4B}.json" 2>&1 | grep -E "^prompt|Error|error"
}

stage_yoco() {  # YOCO on/off, side by side in one process
    for model in ${YOCO_MODELS:-E2B E4B}; do
        for shape in ${YOCO_SHAPES:-1x7000 8x2048}; do
            timeout 240 $BENCH --model-path gemma-4-$model-it --batch-size "${shape%x*}" --input-len "${shape#*x}" \
                --yoco-ab --repeats 5 --json "$RESULTS/yoco-$model-$shape.json"
        done
    done
}

stage_tune_norm() {  # warps of the residual add + norm kernel
    timeout 200 python3 bench/tune/tune_add_rms_norm.py --json "$RESULTS/tune-add-rms-norm.json"
}

stage_moe() {
    timeout 240 python3 bench/bench_moe.py --json "$RESULTS/moe.json"
}

stage_moe_fp8() {  # 26B-A4B's FP8 experts beside bf16 at decode sizes and a prefill; MOE_SWEEP="" sweeps blocks
    timeout ${MOE_TIMEOUT:-300} python3 bench/bench_moe.py --fp8 --tokens ${MOE_TOKENS:-1 32 7000} \
        ${MOE_SWEEP---no-sweep} --json "$RESULTS/moe-fp8.json" 2>&1 | sed -n '/^FP8 experts/,$p'
}

stage_prompt_wave() {  # fast-prefill's prompt steps in one process, kernel by kernel: WAVE_DECODING requests
    # (default 26, about concurrency 32's) decoding at WAVE_DECODING_LEN-token contexts (default 8192) while 4 prompts
    # of 8192 tokens arrive at once (bench/prompt_step_idle.py; E4B dummy bf16)
    timeout 300 python3 bench/prompt_step_idle.py --model-path gemma-4-${AB_MODEL:-E4B}-it --load-format dummy \
        --dtype bfloat16 --decoding ${WAVE_DECODING:-26} --decoding-len ${WAVE_DECODING_LEN:-8192} --prompts 4 \
        --kernels 16 --trace /tmp/prompt-wave.json >"$RESULTS/prompt-steps-wave.txt" 2>&1
    grep -v -i "warn\|USDT" "$RESULTS/prompt-steps-wave.txt" | tail -70
}

stage_moe_align() {  # the MoE slot-layout kernel per slot chunk at 26B-A4B's decode sizes
    timeout 120 python3 bench/tune/tune_moe_align.py 2>&1 | grep -E "slots|Error|error"
}

stage_serving() {  # 30 prompts x 7000 input / 10 output tokens at full concurrency, E4B
    # SERVER_ARGS: extra server flags; SERVING_RUNS: benchmark runs against the same server (later ones warm)
    python3 -m srt.launch_server --model gemma-4-E4B-it --load-format dummy --port 30000 \
        --log-interval ${LOG_INTERVAL:-5} ${SERVER_ARGS:-} >"$RESULTS/server.log" 2>&1 &
    server=$!
    wait_healthy 240
    for run in $(seq ${SERVING_RUNS:-1}); do
        suffix="" && [ "$run" -gt 1 ] && suffix="-run$run"
        timeout 300 python3 bench/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 30 \
            --random-input-len 7000 --random-output-len 10 --max-concurrency 30 --warmup-requests 2 \
            --output-json "$RESULTS/serving-E4B-30x7000$suffix.json" --plot "$RESULTS/serving-E4B-30x7000$suffix.png" \
            | grep -E "Total token throughput|Duration|Successful"
        echo "Triton kernels compiled so far: $(ls ~/.triton/cache 2>/dev/null | wc -l)"
    done
    kill -TERM $server
    wait $server
    tail -5 "$RESULTS/server.log"
}

stage_serving_ab() {  # named workloads with YOCO on and off side by side, a fresh server per setting
    # AB_WORKLOADS: run in turn (default fast-prefill yoco-30x7000; chat and summarize run YOCO on only unless
    # AB_YOCO="on off"); AB_MODEL (default E4B); AB_TIMEOUT: seconds per workload, default 260 so that the two
    # defaults fit one 10-minute device call (each takes ~2-3 minutes: two server starts of ~45 s and the runs);
    # SERVER_ARGS: extra server flags. Results: $RESULTS/ab-WORKLOAD.{json,png,txt}, server logs ab-*-yoco-*.log
    for workload in ${AB_WORKLOADS:-fast-prefill yoco-30x7000}; do
        limit=${AB_TIMEOUT:-260}
        yoco="" && [ -n "${AB_YOCO:-}" ] && yoco="--yoco $AB_YOCO"
        # serving_ab stops at --time-limit by itself (reporting what finished); `timeout` is the backstop
        timeout -k 10 "$limit" python3 bench/serving_ab.py --workload "$workload" $yoco --time-limit $((limit - 25)) \
            --out-dir "$RESULTS" --model gemma-4-${AB_MODEL:-E4B}-it --load-format dummy \
            --log-interval ${LOG_INTERVAL:-10} ${SERVER_ARGS:-} >"$RESULTS/ab-$workload.txt" 2>"$RESULTS/ab-$workload.err"
        echo "serving_ab $workload: exit $?"
        sed -n "/^$workload: concurrency/,\$p" "$RESULTS/ab-$workload.txt"
        grep -E "^error" "$RESULTS/ab-$workload.err"
    done
}

stage_serving_ref() {  # bench_one_batch at fast-prefill's shapes: the decode step its TPOT should come close to
    # batch 32 x 8192 does not fit one prefill forward's activations next to the pools on an 80 GB H100
    timeout 300 $BENCH --model-path gemma-4-${AB_MODEL:-E4B}-it --batch-size 8 16 --input-len 8192 --output-len 16 \
        --mem-fraction-static 0.5 \
        --json "$RESULTS/serving-ref-${AB_MODEL:-E4B}.json" 2>&1 | grep -E "^batch|Error|error"
}

stage_profile() {  # where time goes, kernel by kernel (eager by default; PROFILE_GRAPHS=1 profiles replays)
    # PROFILES: model:batch:phase[:extra flag], e.g. E4B:1:decode or 26B-A4B:1:decode:--swa-full-tokens-ratio=1;
    # PROFILE_EXTRA: flags for every run (e.g. "--kv-cache-dtype fp8_e4m3"); PROFILE_INPUT_LEN: the context (512)
    graphs="--disable-cuda-graph" suffix=""
    [ "${PROFILE_GRAPHS:-0}" = 1 ] && graphs="" suffix="-graphs"
    for run in ${PROFILES:-E4B:1:decode}; do
        IFS=: read -r model batch phase extra <<<"$run"
        out="$RESULTS/profile-$model-$phase-bs$batch$suffix.txt"
        timeout 200 python3 bench/profile_forward.py --model-path gemma-4-$model-it --load-format dummy \
            --dtype bfloat16 --phase "$phase" --batch-size "$batch" --input-len "${PROFILE_INPUT_LEN:-512}" $graphs \
            --rows 30 --trace "$RESULTS/trace.json" $extra ${PROFILE_EXTRA:-} >"$out" 2>&1
        grep -E "per forward|Self CUDA time total" "$out"
        python3 bench/kernel_timeline.py "$RESULTS/trace.json" --steps 4 >"${out%.txt}-timeline.txt" 2>&1
        python3 bench/kernel_timeline.py "$RESULTS/trace.json" --steps 4 --rows 0 --layer-marker _rms_norm_rope_kernel \
            --layer-index 2 >>"${out%.txt}-timeline.txt" 2>&1
        gzip -f "$RESULTS/trace.json" && mv "$RESULTS/trace.json.gz" "${out%.txt}-trace.json.gz"
    done
}

for stage in "$@"; do
    echo "=== $stage ($(date -u +%H:%M:%S))"
    "stage_$stage"
done
if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/results.tgz" -C "$RESULTS" .
fi
