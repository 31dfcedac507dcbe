#!/usr/bin/env bash
# Device call 2: join the model, wait for the build, then measure (each step bounded; skipped past the deadline).
# Run it from the checkout (bash tools/gpu/run2.sh): call 1's .gpu/ is not carried again, and is gone there.
set -u
H=$(cd "$(dirname "$0")" && pwd); W=${W:-/tmp/w}; T0=$(date +%s); DEADLINE=${DEADLINE:-560}; NGL=${NGL--ngl -1}; OUT=${OUT:-$W/out}; L=$W/logs; mkdir -p $OUT $L
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
# the model's parts: smol.00 (call 1) and smol.01 (call 1b) in $W, the rest carried in .gpu3/ (or .gpu2/)
parts=$(ls $W/smol.0[0-9] $PWD/.gpu2/smol.0[0-9] $PWD/.gpu3/smol.0[0-9] 2>/dev/null | awk -F/ '{print $NF, $0}' | sort -u -k1,1 | cut -d' ' -f2)
[ -s $W/smol.gguf ] || cat $parts > $W/smol.gguf
[ "$(sha256sum $W/smol.gguf | cut -c1-16)" = "$(cat $W/smol.sha256)" ] || { echo "model parts do not join: $parts"; exit 1; }
while [ ! -f $W/build.rc ] && [ $(left) -gt 60 ]; do sleep 5; done
echo "build rc=$(cat $W/build.rc 2>/dev/null) in $(cat $W/build.s 2>/dev/null) s (waited $(( $(date +%s) - T0 )) s)"; tail -3 $W/build.log
[ "$(cat $W/build.rc 2>/dev/null)" = 0 ] || { tail -30 $W/configure.log $W/build.log > $OUT/build-failed.log; exit 1; }
ln -sfn $W/build/bin $W/site/llama_cpp/lib
export PYTHONPATH=$W/site:$W/edgespec LLAMA_CPP_LIB_PATH=$W/build/bin EDGESPEC_LLAMA_SERVER=$W/build/bin/llama-server
export EDGESPEC_CACHE_DIR=$W/cache PYTHONUNBUFFERED=1
[ -f /usr/lib/x86_64-linux-gnu/libstdc++.so.6 ] && export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
PY=${PY:-python3}; ES="$PY -m edgespec"
$ES --version 2>&1 | tail -3
step() { local name=$1 lim=$2; shift 2; local l=$(left); [ $l -lt 25 ] && { echo "SKIP $name (deadline)"; return; }
  [ $lim -gt $l ] && lim=$l; echo "== $name (limit $lim s, at $(( $(date +%s) - T0 )) s)"
  timeout $lim "$@" > $L/$name.out 2> $L/$name.err; echo "rc=$? ($(( $(date +%s) - T0 )) s)"; tail -n ${TAILN:-22} $L/$name.out; grep -v '^\s*$' $L/$name.err | tail -n 2; }
SH="$PY $H/shapes.py"
# default (the width chosen by cost, core/hold.py), suffix@free (the gate alone), fixed holds
M=${METHODS_CODE:-none,default,suffix@free,suffix@hold4,llama-server-ngram-simple,llama-server-ngram-mod}
MJ=${METHODS_JSON:-none,default,suffix@free,suffix@hold2,suffix@hold4,llama-server-ngram-mod}
R="--repeat ${REPEAT:-2}"
# code edits and JSON under tools/step_parts.py: the same bench, each part of a step timed apart (issue 51,
# item 1; the timers cost about 2 us a step, edgespec's methods only); the dev prompts without them
SP="$PY $H/../step_parts.py"
step code-smol 130 $SP $W/smol.gguf $NGL --prompts $W/code.jsonl ${LIMIT:-} --methods $M --max-tokens 128 $R --out $OUT/code-smol.jsonl --parts-out $OUT/parts-code.jsonl
step json-smol 110 $SP $W/smol.gguf $NGL --prompts $W/json.jsonl ${LIMIT:-} --methods $MJ --max-tokens 256 $R --out $OUT/json-smol.jsonl --parts-out $OUT/parts-json.jsonl
step chat-smol 110 $ES bench $W/smol.gguf $NGL --prompts $W/chat.jsonl ${LIMIT:-} --methods ${METHODS_CHAT:-none,default,suffix@free,suffix@hold4,llama-server-ngram-simple,llama-server-ngram-mod} --max-tokens 128 --repeat ${REPEAT_CHAT:-1} --out $OUT/chat-smol.jsonl
# the steady and alternating widths of this build (edgespec replay --cost), while time is left
step shapes-smol ${SHAPES_S:-30} $SH $W/smol.gguf 99
# the calibration before the streams: the 2026-11-27 run reached its deadline in them
TAILN=40 step cal-smol 30 $ES calibrate $W/smol.gguf $NGL --json
# memory across requests (issue 41): a stream of similar requests, in file order
SM="none,default,default+memory,llama-server-ngram-mod,llama-server-ngram-cache"
for s in extraction codebase agent; do
  step stream-$s-smol 90 $ES bench $W/smol.gguf $NGL --prompts $W/stream_$s.jsonl ${LIMIT:-} --methods $SM --max-tokens 128 --out $OUT/stream-$s-smol.jsonl
done
# the cost curves of real shapes, while time is left
while [ ! -f $W/gen.done ] && [ $(left) -gt 60 ]; do sleep 3; done; ls -la $W/*.gguf; cat $W/gen-*.log
TAILN=8 step shapes-8b 60 $SH $W/rand-8b.gguf 99
TAILN=8 step shapes-1.5b 45 $SH $W/rand-1.5b.gguf 99
# what comes back: the results files, the shapes, the calibration and one log of every step
cat $L/shapes-*.out > $OUT/shapes.jsonl 2>/dev/null; c=$(ls $W/cache/calibration/*[0-9a-f].json 2>/dev/null | head -1); [ -n "$c" ] && cp "$c" $OUT/calibration.json
for f in $L/*.out $L/*.err; do echo "=== $f"; cat $f; done > $OUT/steps.log 2>/dev/null
# the device returns at most 8 files: the results files travel as one archive (results.tgz)
(cd $OUT && ls *-smol.jsonl >/dev/null 2>&1 && tar czf results.tgz *-smol.jsonl parts-*.jsonl 2>/dev/null; rm -f *-smol.jsonl parts-*.jsonl)
echo "total $(( $(date +%s) - T0 )) s"; ls $OUT
