#!/bin/bash
# After join.sh: train the recipe $1 (a regeneration left running is paused meanwhile), export it in
# bf16, and bring back the export (split under 16 MiB) and the run's figures. A run cut off at the
# TRAIN_S limit (default 480 s) resumes from its last checkpoint when the same command is sent again. FORMAT picks
# the export layout (default eagle3-hf; medusa-vllm or eagle1 for the other recipes).
source scripts/device/env.sh
pkill -STOP -f "[d]ata regenerate"  # [d]: never matches a shell whose command names it
set -o pipefail
RUN=${RUN:-/root/run}; RESUME=""; [ -d "$RUN/checkpoints" ] && RESUME=--resume  # a second call goes on
timeout "${TRAIN_S:-480}" python3 -m headway.train --config "$1" train.output_dir=$RUN $RESUME "${@:2}" 2>&1 | tr '\r' '\n' | grep -v "^train [a-z0-9]*: " | tee "$OUT/train.log"
rm -rf /root/export; python3 -m headway export $RUN --format "${FORMAT:-eagle3-hf}" --out /root/export --dtype bfloat16 || exit 1
cp $RUN/*.json $RUN/eval.jsonl $RUN/learning_curve.png "$OUT/" 2>/dev/null  # figures and curve
rm -rf /root/export.tar "$OUT"/export.tar.part-*; tar -C /root -cf /root/export.tar export && split -b 15M -d /root/export.tar "$OUT/export.tar.part-"
pkill -CONT -f "[d]ata regenerate"
[ ! -f /root/regen.log ] || tail -c 400 /root/regen.log | tr '\r' '\n' | tail -2
