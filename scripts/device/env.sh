# Sourced by the scripts here on a lent GPU machine (see README.md): headway from the checkout,
# the carried wheels and the rejoined embedded GGUF under /root, caches under /root.
export PYTHONPATH=/root/site:$PWD
export HEADWAY_CACHE=/root/cache HF_HOME=/root/hf HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
