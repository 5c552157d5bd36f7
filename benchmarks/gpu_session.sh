#!/usr/bin/env bash
# One GPU lease's measurements for the open GPU items (issues #19, #20, #22), as steps that each fit a
# device call; every step is time-limited and writes its log (and JSON) under $OUT (at most 8 files come
# back), and a step cut at its limit still writes the rows it measured. Usage, through the device tool:
#
#   bash benchmarks/gpu_session.sh headline breakdown-mamba2     # then, if time is left: check
#
# A lease is 15 minutes of device time in all (starting the machine included): docs/benchmarks.md, "GPU
# session", has the order. Wheels carried in .whl (`datasets`, which the GPU image lacks; only `train` and
# `quality` need them) are installed into /tmp/site first when the folder is there.
#
# Steps:
#   headline   #19's headline: Codestral Mamba2 7B against Mistral 7B v0.1 at batch 1, 32k and 128k tokens
#              (jaxembed bench model-comparison, four points, 120 s each at most)
#   breakdown-mamba2 #19: the Mamba2 rows of `breakdown` only (batch 1 x 32k)
#   check      Pallas kernels compiled for real against their XLA references (benchmarks/kernels.py), and the
#              SSD backward kernel timed for 1..16 heads per program (the rule behind choose_heads_per_program)
#   conv       #19/#20: Mamba2's layer SSD with x convolved in the kernel against XLA's conv + the kernel, at
#              Codestral's inference shapes and the training step's (benchmarks/kernels.py --only conv)
#   segments   #19: SSD, mLSTM and WKV7 at batch 1 with the sequence split into 1..16 segments (the sweep behind
#              kernels.common.sequence_segments; T = 4096 is the batch-1 vertical chunk); since session 21 also
#              mLSTM with its outputs a kernel parallel over chunks (BlockSizes.parallel_outputs); since session 22
#              WKV7 with its chunk factors a kernel parallel over chunks (BlockSizes.parallel_factors), first
#   breakdown  #19: projection floor, full embed, GEMM/kernel/glue per family (benchmarks/gpu_breakdown.py)
#   mlstm-split #19: xLSTM's breakdown with mLSTM's outputs a kernel parallel over chunks (the walk storing each
#              chunk's entering state; BlockSizes.parallel_outputs), beside the breakdown step's fused kernel
#   wkv7-split #19: RWKV7's breakdown with WKV7's chunk factors a kernel parallel over chunks (the walk two
#              products a chunk, on wgmma; BlockSizes.parallel_factors), chunks of 32 and of 64
#   memory     #19: compiled temporaries per schedule at the models' own depth, from shapes (program_memory.py)
#   dsf        #19: the same with XLA's dynamic-slice fusion forced on (GEMMs reading each layer's slice of the
#              stacked weights in place); jax 0.11.2's XLA already does it by default (docs/benchmarks.md, session 13)
#   compare    #19: the 7B recurrent models against Mistral's sliding window (jaxembed bench model-comparison)
#   warm       #22: warm start, a fresh process's compile share (benchmarks/warm_start.py)
#   train      #20: the two throughput configs on the packages corpus built there (tokens/s and MFU), and the
#              8-layer one with one length group (as before session 14) for the ratio
#   quality    #20: a from-scratch Mamba2 against BM25 on this repository's corpus (carry .gpu-data: made by
#              `tar -C data -czf .gpu-data/packages-mined.tar.gz packages/train-mined.jsonl packages/heldout-2000.jsonl`);
#              resumes from its checkpoint when run again
set -uo pipefail
OUT=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "gpu_session: the wheels in .whl did not install; steps that need them will fail"
fi
# the checkout first (jaxembed is not installed on the GPU image; the benchmark scripts import it), then the wheels
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, never stop the rest
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%FT%TZ), limit ${limit}s): $*"
    # SIGTERM at the limit (the scripts then write what they measured), SIGKILL 15 s later
    timeout -k 15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]}"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"

for s in "$@"; do
    case $s in
        headline) step headline 300 $PY -m jaxembed.cli bench model-comparison --batch 1 --lengths 32k,128k \
            --series "Mamba2 (Codestral 7B),Mistral 7B v0.1 (window 4096)" --timeout 120 --overwrite --output "$OUT/headline" ;;
        breakdown-mamba2) step breakdown-mamba2 200 $PY benchmarks/gpu_breakdown.py --families mamba2 --layers 4 \
            --cases 1x32k --json "$OUT/breakdown-mamba2.json" ;;
        check) step check ${CHECK_LIMIT:-420} $PY benchmarks/kernels.py --only check --out "$OUT/check" ;;
        conv) step conv 240 $PY benchmarks/kernels.py --only conv --out "$OUT/conv" ;;
        segments) step segments 340 $PY benchmarks/kernels.py --only sweep --families wkv7 mlstm ssd \
            --sweep-lengths 4096 16384 --out "$OUT/segments" ;;
        breakdown) step breakdown 420 $PY benchmarks/gpu_breakdown.py --families mamba2,rwkv7,xlstm --layers 4 \
            --cases 1x32k,32x4k --json "$OUT/breakdown.json" ;;
        mlstm-split) step mlstm-split 240 $PY benchmarks/gpu_breakdown.py --families xlstm --layers 4 \
            --cases 1x32k,32x4k --tile mlstm=64,32,8,parallel --json "$OUT/breakdown-mlstm-split.json" ;;
        wkv7-split)
            for L in 32 64; do
                step "wkv7-split-$L" 200 $PY benchmarks/gpu_breakdown.py --families rwkv7 --layers 4 --cases 1x32k,32x4k \
                    --tile "wkv7=$L,64,8,parallel" --json "$OUT/breakdown-wkv7-split-$L.json"
            done ;;
        memory) step memory 300 $PY benchmarks/program_memory.py ;;
        dsf) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" step dsf 420 $PY \
            benchmarks/gpu_breakdown.py --families mamba2,rwkv7,xlstm --layers 4 --cases 1x32k,32x4k \
            --json "$OUT/breakdown-dsf.json" ;;
        compare) step compare 540 $PY -m jaxembed.cli bench model-comparison --batch 1 --lengths 8k,32k,128k \
            --timeout 120 --overwrite --output "$OUT/compare" ;;
        warm) step warm 300 $PY benchmarks/warm_start.py --how api,cli --max-length 4096 --threads 16 ;;
        train)
            step corpus 240 $PY -m jaxembed.cli corpus packages data/packages
            for c in 8l-512 24l-768; do
                step "train-$c" 420 $PY -m jaxembed.cli train "configs/train/gpu-throughput-$c.yaml"
                cp "runs/gpu-throughput-$c/metrics.jsonl" "$OUT/metrics-$c.jsonl" 2>/dev/null
            done
            # the same 8-layer run padded as before session 14 (one length group), for the ratio
            sed -e 's|runs/gpu-throughput-8l-512|runs/gpu-throughput-8l-512-g1|' \
                -e 's|^  log_every: 10|  log_every: 10\n  length_groups: 1|' configs/train/gpu-throughput-8l-512.yaml \
                > /tmp/gpu-throughput-8l-512-g1.yaml
            step train-8l-512-g1 300 $PY -m jaxembed.cli train /tmp/gpu-throughput-8l-512-g1.yaml
            cp runs/gpu-throughput-8l-512-g1/metrics.jsonl "$OUT/metrics-8l-512-g1.jsonl" 2>/dev/null ;;
        quality)
            mkdir -p data && tar -C data -xzf .gpu-data/packages-mined.tar.gz \
                || { echo "quality: carry .gpu-data/packages-mined.tar.gz"; continue; }
            step quality 480 $PY -m jaxembed.cli train configs/train/packages-mamba2-gpu-quality.yaml
            cp runs/packages-mamba2-gpu-quality/metrics.jsonl "$OUT/metrics-quality.jsonl" 2>/dev/null
            step quality-table 120 $PY benchmarks/train_quality.py table data/packages/heldout-2000.jsonl \
                "Mamba2 d256 4L full + mined (GPU)=runs/packages-mamba2-gpu-quality" ;;
        *) echo "unknown step $s (headline, breakdown-mamba2, check, conv, segments, breakdown, mlstm-split, wkv7-split,"\
                "memory, dsf, compare, warm, train, quality)"
           exit 2 ;;
    esac
done
