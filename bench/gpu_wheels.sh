#!/usr/bin/env bash
# Build .whl/wheels.tar.xz: the Python 3.12 x86-64 wheels that bench/gpu_check.sh installs on a lent
# GPU machine (no network there; its image has torch 2.11, transformers 5.17, numpy, pandas, pyarrow,
# pillow, scipy, huggingface-hub 1.33, tokenizers 0.23.2, typer, torchvision ... but none of agnosia's
# store/manifest dependencies). Run here, from the repo root, where pip reaches PyPI:
#
#     bash bench/gpu_wheels.sh            # -> .whl/wheels.tar.xz (~28 MiB), .whl/wheels.txt
#
# Versions are requirements.lock's. transformers 5.24.0 is carried because the adapters target it; its
# other requirements (huggingface-hub>=1.31, tokenizers>=0.23.1,<0.24, safetensors>=0.8, typer, regex,
# ...) are met by the machine's own packages, so huggingface-hub 2.x and its httpx2 stack stay behind.
# The wheels are re-zipped uncompressed and packed into one xz archive: solid compression across all
# of them is ~28 MiB against ~52 MiB of plain wheels, and the working tree that travels to the machine
# is capped at 64 MiB. .whl/ must be ignored by git (.git/info/exclude holds /.whl/).
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=${WHEEL_SRC:-/tmp/agnosia-wheels-src}
PY=${PY:-python3}
PACKAGES=(
  transformers==5.24.0
  zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0
  duckdb==2.0.1
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  num2words==0.5.14
  dask==2026.8.0 distributed==2026.8.0 partd==1.4.2 locket==1.0.0 zict==3.0.0 tblib==3.2.2 tornado==6.6.1
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
  PLATFORMS+=(--platform "$p")
done

grep -q '^/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p "$SRC"
for spec in "${PACKAGES[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$SRC" "$spec"
done
# docopt (num2words' one requirement) is published as an sdist only: build its pure-Python wheel
ls "$SRC"/docopt-0.6.2-*.whl >/dev/null 2>&1 || "$PY" -m pip wheel -q --no-deps docopt==0.6.2 -w "$SRC"

mkdir -p .whl
rm -f .whl/*.whl .whl/wheels.tar.xz
"$PY" - "$SRC" .whl <<'EOF'
import lzma, os, sys, tarfile, tempfile, zipfile

src, out = sys.argv[1], sys.argv[2]
names = sorted(n for n in os.listdir(src) if n.endswith(".whl"))
seen = {}
for n in names:  # one version of each package: two stop the whole install there
    dist = n.split("-")[0].lower().replace("_", "-")
    if dist in seen:
        sys.exit(f"two wheels of {dist}: {seen[dist]} and {n}; remove one from {src}")
    seen[dist] = n
with tempfile.TemporaryDirectory() as tmp:
    for n in names:
        with zipfile.ZipFile(os.path.join(src, n)) as zi, \
                zipfile.ZipFile(os.path.join(tmp, n), "w", compression=zipfile.ZIP_STORED) as zo:
            for info in zi.infolist():
                copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                copy.external_attr = info.external_attr
                zo.writestr(copy, zi.read(info))
    with tarfile.open(os.path.join(out, "wheels.tar.xz"), "w:xz", preset=9) as tar:
        for n in names:
            tar.add(os.path.join(tmp, n), arcname=n)
with open(os.path.join(out, "wheels.txt"), "w") as f:
    f.write("\n".join(names) + "\n")
size = os.path.getsize(os.path.join(out, "wheels.tar.xz"))
print(f"{len(names)} wheels -> {out}/wheels.tar.xz ({size / 2**20:.1f} MiB)")
EOF
