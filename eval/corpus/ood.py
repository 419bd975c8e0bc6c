#!/usr/bin/env python3
"""Out-of-distribution held-out text (issue 21): turn the packages fetched by get-ood.sh into plain text.

usage: ood.py ROOT     (ROOT/x/<package>/... extracted by get-ood.sh, ROOT/versions.tsv: package<TAB>version)
writes ROOT/text/<domain>.txt (one per domain, documents separated by a blank line), ROOT/MANIFEST.tsv and
ROOT/cloze.jsonl (LAMBADA-style: {"context": ..., "target": " word"}). Standard library only; deterministic.

None of these sources is in the training mixture of recipes/smollm2-135m.yaml (Python/Linux docs and the
general corpus of eval/corpus/get-corpus.sh): see the MANIFEST for what each one is.
"""
import bz2, glob, gzip, html, html.parser, io, json, lzma, os, re, struct, sys, zipfile, zlib

ROOT = sys.argv[1]
X, OUT = os.path.join(ROOT, 'x'), os.path.join(ROOT, 'text')
os.makedirs(OUT, exist_ok=True)
MAX_BYTES = 1_950_000
VERSIONS = {}
if os.path.exists(os.path.join(ROOT, 'versions.tsv')):
    for line in open(os.path.join(ROOT, 'versions.tsv')):
        if '\t' in line:
            k, v = line.rstrip('\n').split('\t', 1)
            VERSIONS[k] = v
MANIFEST = []


def P(*parts):
    return os.path.join(X, *parts)


def norm(t):
    t = t.replace('\r\n', '\n').replace('\r', '\n').replace('\x00', '').replace('\ufeff', '')
    t = re.sub(r'[ \t]+', ' ', t)
    t = re.sub(r' *\n *', '\n', t)
    t = re.sub(r'\n{3,}', '\n\n', t)
    return t.strip()


def write(domain, docs, packages, licence, what):
    """docs: list of strings, written in order until MAX_BYTES (whole documents; the last one cut at a paragraph)."""
    out, size = [], 0
    for d in docs:
        d = norm(d)
        if not d:
            continue
        b = len(d.encode()) + 2
        if size + b > MAX_BYTES:
            keep = []
            for para in d.split('\n\n'):
                pb = len(para.encode()) + 2
                if size + pb > MAX_BYTES:
                    break
                keep.append(para); size += pb
            if keep:
                out.append('\n\n'.join(keep))
            break
        out.append(d); size += b
    text = '\n\n'.join(out) + '\n'
    path = os.path.join(OUT, domain + '.txt')
    with open(path + '.part', 'w', encoding='utf-8') as f:
        f.write(text)
    os.replace(path + '.part', path)
    n = os.path.getsize(path)
    vers = ','.join(f'{p}={VERSIONS.get(p, "?")}' for p in packages)
    MANIFEST.append((domain, ','.join(packages), vers, licence, what, n))
    print(f'{domain:24s} {n/1e6:6.2f} MB ~{len(text)//4/1e3:6.0f}k tok  <- {vers}', flush=True)
    return text


# ------------------------------------------------------------------ R serialization (janeaustenr data)
class RReader:
    """Minimal reader of R's XDR serialization format (enough for character vectors and named lists)."""

    def __init__(self, b):
        self.b, self.i, self.refs = b, 0, []

    def int(self):
        v = struct.unpack_from('>i', self.b, self.i)[0]; self.i += 4; return v

    def header(self):
        assert self.b[:2] == b'X\n', 'not XDR serialization'
        self.i = 2
        ver = self.int(); self.int(); self.int()
        if ver == 3:
            n = self.int(); self.i += n

    def item(self):
        flags = self.int()
        t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if t in (254, 253, 252, 251, 250, 242, 241):   # NULL, environments, markers
            return None
        if t == 255:                                     # REFSXP
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t == 1:                                       # SYMSXP
            v = self.item(); self.refs.append(v); return v
        if t in (2, 3, 5, 6, 17, 239, 240):              # pairlist-like
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car = self.item(); cdr = self.item()
            cell = [(tag, car)]
            if isinstance(cdr, list) and cdr and isinstance(cdr[0], tuple):
                cell += cdr
            return cell
        if t == 9:                                       # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.b[self.i:self.i + n]; self.i += n
            return s.decode('utf-8' if flags & (1 << 15) == 0 else 'latin-1', 'replace')
        if t in (10, 13, 14, 15, 16, 19, 20):            # vectors
            n = self.int()
            if t in (10, 13):
                v = list(struct.unpack_from(f'>{n}i', self.b, self.i)); self.i += 4 * n
            elif t == 14:
                v = list(struct.unpack_from(f'>{n}d', self.b, self.i)); self.i += 8 * n
            elif t == 15:
                self.i += 16 * n; v = None
            else:
                v = [self.item() for _ in range(n)]
            if has_attr:
                attrs = dict(self.item() or [])
                names = attrs.get('names')
                if t == 19 and names:
                    return dict(zip(names, v))
            return v
        if t == 4:                                       # ENVSXP
            env = {}; self.refs.append(env); self.int()
            self.item(); self.item(); self.item(); self.item()
            return env
        raise ValueError(f'R type {t} not supported')


def unserialize(raw):
    r = RReader(raw); r.header(); return r.item()


def lazyload(dirpath, name):
    """Objects of an R lazy-load database NAME.rdx/NAME.rdb as {variable: value}."""
    rdx = open(os.path.join(dirpath, name + '.rdx'), 'rb').read()   # saveRDS: gzip; older R: 4-byte length + zlib
    idx = unserialize(gzip.decompress(rdx) if rdx[:2] == b'\x1f\x8b' else zlib.decompress(rdx[4:]))
    db = open(os.path.join(dirpath, name + '.rdb'), 'rb').read()
    out = {}
    for var, (off, ln) in idx['variables'].items():
        blob = db[off:off + ln]
        body = blob[4:]
        if body[:1] == b'Z':
            raw = zlib.decompress(body[1:])
        elif body[:1] == b'2':
            raw = bz2.decompress(body[1:])
        elif body[:1] == b'X':
            raw = lzma.decompress(body[1:])
        elif body[:1] == b'0':
            raw = body[1:]
        else:
            raw = zlib.decompress(body)
        out[var] = unserialize(raw)
    return out


def austen():
    data = lazyload(P('r-cran-janeaustenr', 'usr/lib/R/site-library/janeaustenr/data'), 'Rdata')
    docs = []
    for var, title in [('persuasion', 'Persuasion'), ('northangerabbey', 'Northanger Abbey'),
                       ('sensesensibility', 'Sense and Sensibility')]:
        lines = [l or '' for l in data[var]]
        paras, cur = [], []
        for l in lines + ['']:
            if l.strip():
                cur.append(l.strip())
            elif cur:
                paras.append(' '.join(cur)); cur = []
        # drop the title block before the first chapter
        for k, p in enumerate(paras):
            if re.match(r'^(CHAPTER|Chapter) (1|I)\b', p):
                paras = paras[k:]; break
        docs.append(title + '\n\n' + '\n\n'.join(paras))
    return write('fiction_austen', docs, ['r-cran-janeaustenr'],
                 'MIT (package); novels public domain',
                 'Jane Austen novels: Persuasion, Northanger Abbey, Sense and Sensibility (prose fiction, 1811-1817)')


# ------------------------------------------------------------------ news (gensim test data: Lee corpus)
def news():
    zf = glob.glob(P('pypi', 'gensim', '*.whl'))[0]
    z = zipfile.ZipFile(zf)
    docs = []
    for name in ('gensim/test/test_data/lee_background.cor', 'gensim/test/test_data/lee.cor'):
        for line in z.read(name).decode('utf-8', 'replace').split('\n'):
            line = re.sub(r'\s+', ' ', line).strip()
            if len(line.split()) >= 20:
                docs.append(line)
    return write('news_reports', docs, ['gensim'],
                 'LGPL-2.1 (gensim); articles: ABC (Australia) news, research corpus of Lee, Pincombe & Welsh 2005',
                 'Australian broadcast news reports 2001-2002 (Lee corpus, gensim test data)')


# ------------------------------------------------------------------ dialogue (Wesnoth campaign scenarios)
WML_STR = re.compile(r'_?\s*"((?:[^"]|"")*)"', re.S)


def wesnoth():
    docs = []
    for camp in sorted(glob.glob(P('wesnoth-1.16-*', 'usr/share/games/wesnoth/1.16/data/campaigns/*'))):
        files = sorted(glob.glob(os.path.join(camp, 'scenarios', '**', '*.cfg'), recursive=True))
        for f in files:
            src = open(f, encoding='utf-8', errors='replace').read()
            lines = []
            for m in re.finditer(r'\[message\](.*?)\[/message\]', src, re.S):
                block = m.group(1)
                sp = re.search(r'^\s*speaker\s*=\s*(.+?)\s*$', block, re.M)
                msg = re.search(r'^\s*message\s*=\s*((?:_?\s*"(?:[^"]|"")*"\s*\+?\s*)+)', block, re.M)
                if not sp or not msg:
                    continue
                speaker = sp.group(1).strip().strip('"')
                text = ''.join(s.group(1) for s in WML_STR.finditer(msg.group(1))).replace('""', '"')
                if '$' in speaker or '{' in speaker or speaker in ('unit', 'second_unit'):
                    speaker = 'Soldier'
                if speaker == 'narrator':
                    speaker = 'Narrator'
                if '$' in text or '{' in text or '<' in text:
                    continue
                text = re.sub(r'\s+', ' ', text).strip()
                if len(text.split()) < 3:
                    continue
                lines.append(f'{speaker}: {text}')
            if len(lines) >= 3:
                docs.append('\n'.join(lines))
    return write('dialogue_wesnoth', docs, sorted({os.path.basename(p) for p in glob.glob(P('wesnoth-1.16-*'))}),
                 'GPL-2+',
                 'scripted conversation: character dialogue of Battle for Wesnoth campaigns (speaker: line)')


# ------------------------------------------------------------------ documentation of other software
class DocHTML(html.parser.HTMLParser):
    SKIP_TAGS = {'pre', 'table', 'script', 'style', 'head'}
    SKIP_CLASSES = {'navheader', 'navfooter', 'toc', 'refsynopsisdiv', 'indexterm', 'footnotes'}
    BLOCKS = {'p', 'li', 'dt', 'dd', 'h1', 'h2', 'h3', 'h4', 'div', 'blockquote', 'td'}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.skip, self.buf, self.paras = [], 0, [], []

    def handle_starttag(self, tag, attrs):
        if tag in ('br', 'hr', 'img', 'meta', 'link', 'col', 'input'):
            return
        cls = set((dict(attrs).get('class') or '').split())
        skip = tag in self.SKIP_TAGS or bool(cls & self.SKIP_CLASSES)
        self.stack.append((tag, skip))
        if skip:
            self.skip += 1
        if tag in self.BLOCKS:
            self.flush()

    def handle_endtag(self, tag):
        while self.stack:
            t, skip = self.stack.pop()
            if skip:
                self.skip -= 1
            if t == tag:
                break
        if tag in self.BLOCKS:
            self.flush(heading=tag in ('h1', 'h2', 'h3', 'h4'))

    def handle_data(self, data):
        if not self.skip:
            self.buf.append(data)

    def flush(self, heading=False):
        t = re.sub(r'\s+', ' ', ''.join(self.buf)).strip(); self.buf = []
        if not t:
            return
        if heading:
            t = re.sub(r'^[\d.]+\s+', '', t)       # "2.2. Concepts" -> "Concepts"
            self.paras.append(t)
        elif len(t.split()) >= 6 and re.search(r'[a-z]', t):
            self.paras.append(t)


def postgres():
    base = P('postgresql-doc-15', 'usr/share/doc/postgresql-doc-15/html')
    # follow the book's own "next" links from the start page: tutorial first, reference pages last
    seen, order, page = set(), [], 'index.html'
    while page and page not in seen and os.path.exists(os.path.join(base, page)):
        seen.add(page); order.append(page)
        src = open(os.path.join(base, page), encoding='utf-8', errors='replace').read()
        m = re.search(r'<link rel="next" href="([^"#]+)"', src)
        page = m.group(1) if m else None
    docs = []
    for page in order[1:]:
        p = DocHTML(); p.feed(open(os.path.join(base, page), encoding='utf-8', errors='replace').read()); p.flush()
        if len(p.paras) >= 2:
            docs.append('\n\n'.join(p.paras))
    return write('docs_postgresql', docs, ['postgresql-doc-15'], 'PostgreSQL Licence (BSD-like)',
                 'PostgreSQL 15 manual (HTML -> text, code/tables dropped), in book order from the tutorial')


# ------------------------------------------------------------------ cloze (LAMBADA-style)
STOP = set('''the and for are but not you all any can had her was one our out his has him how its may new now
old see two who did get let put say she too use than that with have this will your from they been were said
each which their there what when then them these some would make like into time very upon such only also more
other could than well shall should must might here where much many most over just being those again before
own herself himself itself themselves myself yourself indeed ever never always soon still yet though about after
per cent'''.split())
SENT = re.compile(r'[^.!?]+[.!?]+["\'\u201d\u2019)]*\s*')
ABBR = re.compile(r'\b(Mr|Mrs|Ms|Dr|St|Esq|Col|Capt|Gen|Lt|Rev|Messrs|Jr|Sr|No|vs|etc|Mt|Co|Inc|Ltd|Govt|Sen|Rep|Gov'
                  r'|[A-Z])\.')


def cloze_items(text, source, want, join_paragraphs=False):
    """Non-overlapping passages of 60-150 words that end a sentence with a word (>= 3 letters, not a stopword)
    already seen in the passage. Units: paragraphs, or (join_paragraphs) runs of paragraphs between headings
    (a novel's chapter), joined with a space."""
    items, units, cur = [], [], []
    for para in text.split('\n\n'):
        if '\n' in para:                                  # not running prose
            continue
        if join_paragraphs and len(para.split()) >= 8:
            cur.append(para); continue
        if cur:
            units.append(' '.join(cur)); cur = []
        units.append(para)
    if cur:
        units.append(' '.join(cur))
    for doc in units:
        if len(doc.split()) < 60:
            continue
        # no sentence ends after an abbreviation ("Mrs. Allen", "George W. Bush")
        sents = [x.replace('\x01', '.') for x in SENT.findall(ABBR.sub('\\1\x01', doc) + ' ')]
        i = 0
        while i < len(sents):
            words, j = 0, i
            while j < len(sents) and words < 60:
                words += len(sents[j].split()); j += 1
            if words < 60:
                break
            while j < len(sents) and words + len(sents[j].split()) <= 150:
                cand = ''.join(sents[i:j]).rstrip()
                m = re.search(r'\s([A-Za-z]{3,})[.!?]$', cand)
                if m and m.group(1).lower() not in STOP and re.search(
                        r'\b' + m.group(1).lower() + r'\b', cand[:m.start()].lower()):
                    break
                words += len(sents[j].split()); j += 1
            passage = ''.join(sents[i:j]).rstrip()
            m = re.search(r'\s([A-Za-z]{3,})[.!?]$', passage)
            n = len(passage.split())
            if (m and 60 <= n <= 150 and m.group(1).lower() not in STOP
                    and re.search(r'\b' + m.group(1).lower() + r'\b', passage[:m.start()].lower())):
                items.append({'context': passage[:m.start()], 'target': ' ' + m.group(1), 'source': source})
                i = j              # items never overlap
            else:
                i += 1             # no good ending from here: try one sentence later
    if len(items) > want:                                  # spread evenly over the text
        step = len(items) / want
        items = [items[int(k * step)] for k in range(want)]
    return items


if __name__ == '__main__':
    texts = {}
    for step in (austen, news, wesnoth, postgres):
        texts[step.__name__] = step()
    items = (cloze_items(texts['austen'], 'fiction_austen', 600, join_paragraphs=True)
             + cloze_items(texts['news'], 'news_reports', 300))
    with open(os.path.join(ROOT, 'cloze.jsonl.part'), 'w', encoding='utf-8') as f:
        for it in items:
            f.write(json.dumps(it, ensure_ascii=False) + '\n')
    os.replace(os.path.join(ROOT, 'cloze.jsonl.part'), os.path.join(ROOT, 'cloze.jsonl'))
    print(f'cloze: {len(items)} items ' + str({s: sum(it["source"] == s for it in items) for s in
                                             ('fiction_austen', 'news_reports')}))
    with open(os.path.join(ROOT, 'MANIFEST.tsv'), 'w') as f:
        f.write('domain\tpackage\tversion\tlicence\twhat\tbytes\n')
        for m in MANIFEST:
            f.write('\t'.join(str(x) for x in m) + '\n')
        f.write(f'cloze\t(fiction_austen, news_reports passages)\t-\tas its sources\t'
                f'LAMBADA-style: {len(items)} passages of 60-150 words, target = final word (>=3 letters, '
                f'not a stopword, seen earlier in the passage)\t{os.path.getsize(os.path.join(ROOT, "cloze.jsonl"))}\n')
