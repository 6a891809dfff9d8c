#!/bin/bash
# Call 1 on a lent GPU machine, carry [.gpu/whl, .gpu/a]: install the wheels the image lacks,
# keep the first half of the GGUF under /root, print the software, run the CUDA tests.
source scripts/device/env.sh
mkdir -p /root/gg && cp .gpu/a/* /root/gg/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /root/site .gpu/whl/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers, accelerate, datasets, pyarrow, gguf, peft, safetensors as s
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__,
      'accelerate', accelerate.__version__, 'datasets', datasets.__version__, 'pyarrow',
      pyarrow.__version__, 'peft', peft.__version__, 'safetensors', s.__version__)"
set -o pipefail
timeout 420 python3 -m pytest -m gpu -rs -p no:cacheprovider tests/test_gpu.py tests/test_batch_step.py tests/test_gpu_families.py 2>&1 | tee "$OUT/test-gpu.log"
