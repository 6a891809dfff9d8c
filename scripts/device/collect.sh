#!/bin/bash
# Bring back the shards a background regeneration finished since it was copied (numbers >= $1).
first=${1:?first new shard number}
cd /root/regen && tar -czf "$OUT/regen-new.tar.gz" \
    $(ls data/part-*.jsonl.gz | awk -F'[-.]' -v first="$first" '$2 + 0 >= first') && ls -l "$OUT"
