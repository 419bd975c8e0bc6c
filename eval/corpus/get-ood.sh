#!/usr/bin/env bash
# Out-of-distribution held-out text for issue 21: kinds of text that share no source with the training mixture
# of recipes/smollm2-135m.yaml (Python 3.11 / Linux kernel docs + the general corpus of get-corpus.sh).
# Run as root from anywhere (Debian bookworm apt sources + PyPI reachable):   ROOT=/tmp/ood bash eval/corpus/get-ood.sh
# Output: $ROOT/text/<domain>.txt (one file per domain, 0.3-2 MB of plain text each), $ROOT/MANIFEST.tsv
# (domain, package, version, licence, what it is, bytes) and $ROOT/cloze.jsonl (LAMBADA-style items
# {"context", "target", "source"} cut from the fiction and news text). Idempotent: downloads are kept in $ROOT/dl
# and reused, the text is rebuilt (deterministically) on every run. Never commit the text it writes.
# Domains:
#   fiction_austen    Debian r-cran-janeaustenr   three Jane Austen novels (R lazy-load data, read by ood.py)
#   news_reports      PyPI gensim==4.4.0          ABC (Australia) news reports, the Lee corpus in gensim's test data
#   dialogue_wesnoth  Debian wesnoth-1.16-<campaign> x7   character dialogue of the Wesnoth campaigns
#   docs_postgresql   Debian postgresql-doc-15    the PostgreSQL 15 manual, HTML -> text
set -euo pipefail
ROOT=${ROOT:-/tmp/ood}
HERE=$(cd "$(dirname "$0")" && pwd)
DL=$ROOT/dl; X=$ROOT/x
mkdir -p "$DL/deb" "$DL/pypi" "$X" "$ROOT/text"

DEBS="r-cran-janeaustenr postgresql-doc-15
 wesnoth-1.16-tsg wesnoth-1.16-ei wesnoth-1.16-l wesnoth-1.16-ttb wesnoth-1.16-httt wesnoth-1.16-nr wesnoth-1.16-sof"
[ -n "$(ls /var/lib/apt/lists/*Packages* 2>/dev/null)" ] || apt-get update -qq
cd "$DL/deb"; chown _apt "$DL/deb" 2>/dev/null || true
for p in $DEBS; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download -q "$p"
done
: > "$ROOT/versions.tsv.part"
for p in $DEBS; do
  f=$(ls "${p}"_*.deb | sort -V | tail -1)
  [ -d "$X/$p" ] || { dpkg-deb -x "$f" "$X/$p.part" && mv "$X/$p.part" "$X/$p"; }
  printf '%s\t%s\n' "$p" "$(dpkg-deb -f "$f" Version)" >> "$ROOT/versions.tsv.part"
done

# PyPI: only the data file inside the wheel is used (the wheel is never installed); pinned to one wheel so the
# same file is fetched whatever Python runs this script.
GENSIM=4.4.0
d=$DL/pypi/gensim; mkdir -p "$d" "$X/pypi"
ls "$d"/gensim-$GENSIM-*.whl >/dev/null 2>&1 || pip download -q --no-deps --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311 -d "$d" "gensim==$GENSIM"
ln -sfn "$d" "$X/pypi/gensim"
printf 'gensim\t%s\n' "$GENSIM" >> "$ROOT/versions.tsv.part"
mv "$ROOT/versions.tsv.part" "$ROOT/versions.tsv"

python3 "$HERE/ood.py" "$ROOT"
du -b "$ROOT"/text/*.txt "$ROOT/cloze.jsonl"
