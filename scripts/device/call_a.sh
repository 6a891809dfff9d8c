#!/bin/bash
# Call A of the two-call plan (README.md, "With two calls"), carry [.gpu/A]: keep the first GGUF
# part, the prompts and the shipped drafter under /root, install the wheels, print the software,
# run the CUDA tests (TEST_S seconds at most; 0: none), then the step costs (random weights, no
# GGUF needed; COSTS_S seconds at most, 0: none), then the chain probe (chain_probe.py, random
# weights, chains of 1 and 8 steps: PROBE_S seconds at most, default 0: none; ~80 s).
source scripts/device/env.sh
export TQDM_DISABLE=1
mkdir -p /root/gg /root/drafter
cp .gpu/A/part-00 .gpu/A/gguf.sha256 /root/gg/ && cp .gpu/A/mt-bench-8.jsonl /root/ || exit 1
[ ! -d .gpu/A/drafter ] || cp .gpu/A/drafter/* /root/drafter/ || exit 1  # not for training
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /root/site .gpu/A/whl/*.whl || exit 1
[ ! -d .gpu/A/drafter ] || { mkdir -p drafters/smollm2-135m-eagle3 && cp /root/drafter/* drafters/smollm2-135m-eagle3/; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda',
    torch.version.cuda, 'transformers', transformers.__version__)"
set -o pipefail
if [ "${TEST_S:-150}" -gt 0 ]; then
    timeout "${TEST_S:-150}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_gpu.py \
        tests/test_batch_step.py tests/test_batch_medusa.py \
        tests/test_seeded_sampling.py tests/test_batch_families.py tests/test_gpu_api.py \
        tests/test_gpu_families.py > "$OUT/test-gpu.log" 2>&1
    echo "pytest exit $?"  # the families last: the time limit cuts them first
    tail -45 "$OUT/test-gpu.log"
fi
[ "${COSTS_S:-100}" -gt 0 ] && timeout "${COSTS_S:-100}" python3 scripts/device/step_costs.py \
    --out "$OUT" --verify captured --tree-taus '' 2>&1 | grep -v Warning
if [ "${PROBE_S:-0}" -gt 0 ]; then
    timeout "${PROBE_S}" python3 scripts/device/chain_probe.py --out "$OUT" --chains 1,8 2>&1 \
        | grep -v -i "warn\|trained for another"
fi
true
