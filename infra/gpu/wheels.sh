#!/usr/bin/env bash
# wheels.sh (`make gpu-wheels`): put into .gpu-wheels/ the wheels that the GPU machine lacks,
# for its Python 3.12 on x86-64 Linux. Runs HERE, where PyPI is reachable; the GPU machine
# has no network, so infra/gpu/check.sh installs these with `pip install --no-index --no-deps`.
#
#   make gpu-wheels                                # or: bash infra/gpu/wheels.sh
#
# - DeepSpeed is published as source only: it is built as a pure-Python wheel (no compiled
#   ops; the fused ones are compiled just in time on the GPU machine, with its nvcc).
# - The rest are downloaded as cp312 manylinux (or pure-Python) wheels: what DeepSpeed and
#   webdataset need beyond what that machine has (hjson, pydantic and its parts,
#   braceexpand), and typing-extensions, whose version pydantic-core needs (>= 4.16) is
#   newer than the machine's may be.
# Versions come from constraints.txt (the versions bertpipe is tested with). One version of
# each is kept: a wheel of another version, or of a package no longer listed, is removed. A
# wheel already there is not fetched again. Last, every wheel's requirements are checked
# against the carried set plus what the GPU machine is known to have.
#
# Environment:
#   PYTHON           the Python whose pip builds and downloads (default .venv/bin/python: it
#                    has setuptools and torch, which the DeepSpeed build needs)
#   GPU_WHEELS_DIR   where the wheels go (default .gpu-wheels in the repository)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
DIR=${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}
CONSTRAINTS=$ROOT/constraints.txt

# what is carried: DeepSpeed (built) and these (downloaded)
DOWNLOADS=(hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
    webdataset braceexpand)
# on the GPU machine already (its image's package list); a requirement of a carried wheel
# must be one of these or carried itself
PRESENT=(torch transformers tokenizers numpy fsspec pyyaml safetensors tqdm msgpack psutil
    py-cpuinfo ninja einops packaging nvidia-ml-py matplotlib pandas setuptools pip
    typing-extensions)

export PIP_DISABLE_PIP_VERSION_CHECK=1

# the canonical form of a distribution name, as wheel file names spell it: pydantic_core
canon() { echo "$1" | tr 'A-Z.-' 'a-z__'; }

# the version constraints.txt pins for $1, or nothing
pinned() {
    local want line name
    want=$(canon "$1")
    while IFS= read -r line; do
        [[ $line == *==* && $line != \#* ]] || continue
        name=${line%%==*}
        if [[ $(canon "$name") == "$want" ]]; then
            echo "${line#*==}"
            return
        fi
    done <"$CONSTRAINTS"
}

# whether a wheel of exactly $1 (canonical name) version $2 is in $DIR
have() { compgen -G "$DIR/$1-$2-*.whl" >/dev/null; }

mkdir -p "$DIR"
if [[ ! -x $PYTHON ]]; then
    echo "wheels.sh: $PYTHON not found: run \`make install\` first, or set PYTHON" >&2
    exit 2
fi

declare -A WANT=()  # canonical name -> version
ds_version=$(pinned deepspeed)
if [[ -z $ds_version ]]; then
    echo "wheels.sh: deepspeed is not pinned in constraints.txt" >&2
    exit 2
fi
WANT[deepspeed]=$ds_version
specs=()
for name in "${DOWNLOADS[@]}"; do
    version=$(pinned "$name")
    if [[ -z $version ]]; then
        # not pinned: ask pip for the newest, then keep what it fetched
        echo "wheels.sh: $name is not in constraints.txt; taking the newest release" >&2
        specs+=("$name")
        continue
    fi
    WANT[$(canon "$name")]=$version
    have "$(canon "$name")" "$version" || specs+=("$name==$version")
done

# remove wheels of other versions, or of packages no longer carried
for path in "$DIR"/*.whl; do
    [[ -e $path ]] || continue
    file=${path##*/}
    name=$(canon "${file%%-*}")
    rest=${file#*-}
    version=${rest%%-*}
    if [[ -z ${WANT[$name]+x} ]]; then
        listed=0
        for spec in "${specs[@]}"; do [[ $(canon "$spec") == "$name" ]] && listed=1; done
        if ((!listed)); then
            echo "removing $file (not carried)"
            rm -f "$path"
        fi
    elif [[ ${WANT[$name]} != "$version" ]]; then
        echo "removing $file (constraints.txt pins ${WANT[$name]})"
        rm -f "$path"
    fi
done

if have deepspeed "$ds_version"; then
    echo "deepspeed $ds_version: already built"
else
    echo "building deepspeed $ds_version as a pure-Python wheel (DS_BUILD_OPS=0) ..."
    DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation \
        "deepspeed==$ds_version" -w "$DIR"
fi

if ((${#specs[@]})); then
    echo "downloading ${specs[*]} ..."
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DIR" "${specs[@]}"
else
    echo "downloads: all present"
fi

# every requirement (extras left out) must be carried or on the GPU machine
"$PYTHON" - "$DIR" "${PRESENT[@]}" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

folder, present = Path(sys.argv[1]), sys.argv[2:]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


wheels = sorted(folder.glob("*.whl"))
names = [canon(w.name.split("-")[0]) for w in wheels]
dupes = sorted({n for n in names if names.count(n) > 1})
if dupes:
    sys.exit(f"wheels.sh: more than one version of {', '.join(dupes)} in {folder}")
known = set(names) | {canon(p) for p in present}
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:") or "extra ==" in line:
                continue
            req = canon(re.split(r"[\s;<>=!~\[(]", line.split(":", 1)[1].strip())[0])
            if req not in known:
                missing.append(f"{wheel.name} needs {req}")
if missing:
    sys.exit("wheels.sh: not carried and not on the GPU machine:\n  " + "\n  ".join(missing))
print(f"requirements: every one carried or on the GPU machine ({len(wheels)} wheels)")
EOF

ls -l "$DIR"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
echo "total: $(du -sh "$DIR" | cut -f1) in $DIR"
