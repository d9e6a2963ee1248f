#!/usr/bin/env bash
# The checks that need a GPU, in one run: text-lm trained on the GPU (the demo config, a wider
# model, and the demo config on the CPU beside them), SIGKILL/resume drills training each family
# on the GPU, the CUDA tests, and the GPU checkpoint benchmark. CI has no GPU; run this where
# one is. The steps run in that order, the newest code first, each under its own limit.
#
#   bash bench/gpu_checks.sh [OUTDIR]       # logs go to OUTDIR (default: $OUT or /tmp)
#
# On a machine whose Python lacks Tracks' own needs (blake3, pandera, SQLAlchemy, ...), put
# their wheels in .whl/ first: they are installed into /tmp/site for this run only. Each
# step has its own time limit, so one that hangs leaves the others their time.
set -u
out=${1:-${OUT:-/tmp/tracks-gpu-checks}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
{
    nvidia-smi
    "$python" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
    echo "cores: $(nproc)"
    df -h /tmp
    findmnt -T /tmp
} >"$out/env.txt" 2>&1
head -20 "$out/env.txt"

status=0
step() {  # step NAME SECONDS COMMAND...: run it under a limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local began=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local code=$?
    tail -n "${TAIL:-30}" "$out/$name.log"
    echo "== $name: exit $code after $((SECONDS - began))s"
    [ "$code" -eq 0 ] || status=1
}

work=$(mktemp -d)
step textlm_demo_cuda "${TEXTLM_LIMIT:-60}" "$python" bench/textlm_device.py --device cuda \
    --workdir "$work/textlm"
step textlm_wide_cuda "${TEXTLM_LIMIT:-60}" "$python" bench/textlm_device.py --device cuda \
    --shape wide --max-steps "${WIDE_STEPS:-1000}" --workdir "$work/textlm"
step textlm_demo_cpu "${TEXTLM_CPU_LIMIT:-40}" "$python" bench/textlm_device.py --device cpu \
    --max-steps "${CPU_STEPS:-100}" --workdir "$work/textlm"
step textlm_kill_drill "${DRILL_LIMIT:-110}" "$python" bench/kill_drill.py --device cuda \
    --family text-lm --kills "${DRILL_KILLS:-20}" --seed 0
step cuda_tests "${CUDA_TESTS_LIMIT:-60}" "$python" -m pytest -q -p no:cacheprovider \
    tests/test_checkpoint_cuda.py
step kill_drill "${DRILL_LIMIT:-110}" "$python" bench/kill_drill.py --device cuda \
    --kills "${DRILL_KILLS:-20}" --seed 0
step gpu_bench "${BENCH_LIMIT:-110}" "$python" bench/checkpoint_gpu.py --repeats "${REPEATS:-3}"
exit $status
