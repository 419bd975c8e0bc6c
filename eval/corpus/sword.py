# Vendored from the sparsify team's shared tools (tools/corpus/: get-corpus.sh, build.py, sword.py, games.py), unchanged but for this comment. Never commit the text it writes (licences per file in MANIFEST.tsv).
"""Minimal SWORD zText/zCom/zLD reader (zlib-compressed modules) -> plain text."""
import sys, os, struct, zlib, re, html, glob

def read_blocks(prefix):  # prefix like .../ot.bz or .../ot.cz (without last letter)
    idx = open(prefix + 's', 'rb').read()
    data = open(prefix + 'z', 'rb').read()
    blocks = []
    for i in range(0, len(idx) - 11, 12):
        off, size, usize = struct.unpack('<III', idx[i:i+12])
        if size == 0:
            blocks.append(b''); continue
        try:
            blocks.append(zlib.decompress(data[off:off+size]))
        except Exception:
            blocks.append(b'')
    return blocks

def verses(prefix, entsize):
    blocks = read_blocks(prefix)
    vidx = open(prefix + 'v', 'rb').read()
    seen = set()
    for i in range(0, len(vidx) - entsize + 1, entsize):
        if entsize == 10:
            b, start, size = struct.unpack('<IIH', vidx[i:i+10])
        else:
            b, start, size = struct.unpack('<III', vidx[i:i+12])
        if size == 0 or b >= len(blocks):
            continue
        key = (b, start, size)
        if key in seen:  # linked entries
            continue
        seen.add(key)
        yield blocks[b][start:start+size].decode('utf-8', 'replace')

NOTE = re.compile(r'<note\b[^>]*>.*?</note>', re.S)
RF = re.compile(r'<(reference|rdg)\b[^>]*>.*?</\1>', re.S)
TITLE = re.compile(r'<title\b[^>]*>(.*?)</title>', re.S)
BR = re.compile(r'<(lb|br|p|/p|l|/l|div|/div)\b[^>]*?/?>', re.S)
TAG = re.compile(r'<[^>]+>')
WS = re.compile(r'[ \t\r\f\v]+')

def clean(s, keep_refs=True):
    s = NOTE.sub(' ', s)
    if not keep_refs:
        s = RF.sub(' ', s)
    s = TITLE.sub(lambda m: '\n' + m.group(1) + '\n', s)
    s = BR.sub('\n', s)
    s = TAG.sub('', s)
    s = html.unescape(s)
    s = WS.sub(' ', s)
    s = re.sub(r' *\n[ \n]*', '\n', s)
    return s.strip()

def module_text(moddir, driver, joiner):
    entsize = 12 if driver.endswith('4') else 10
    out = []
    for testament in ('ot', 'nt'):
        cands = glob.glob(os.path.join(moddir, testament + '.?zs'))
        if not cands:
            continue
        prefix = cands[0][:-1]
        if os.path.getsize(prefix + 's') == 0:
            continue
        vs = os.path.getsize(prefix + 'v')
        es = entsize
        if vs % 12 and not vs % 10: es = 10
        elif vs % 10 and not vs % 12: es = 12
        seen_txt = set()
        for v in verses(prefix, es):
            if v in seen_txt:
                continue
            seen_txt.add(v)
            t = clean(v)
            if t:
                out.append(t)
    return joiner.join(out)

def zld_text(path_prefix):
    zdx = open(path_prefix + '.zdx', 'rb').read()
    zdt = open(path_prefix + '.zdt', 'rb').read()
    idx = open(path_prefix + '.idx', 'rb').read()
    dat = open(path_prefix + '.dat', 'rb').read()
    blocks = []
    for i in range(0, len(zdx) - 7, 8):
        off, size = struct.unpack('<II', zdx[i:i+8])
        raw = zlib.decompress(zdt[off:off+size])
        n = struct.unpack('<I', raw[:4])[0]
        ents = []
        for j in range(n):
            eo, es = struct.unpack('<II', raw[4+8*j:12+8*j])
            ents.append(raw[eo:eo+es].decode('utf-8', 'replace').rstrip('\x00'))
        blocks.append(ents)
    out = []
    for i in range(0, len(idx) - 7, 8):
        off, size = struct.unpack('<II', idx[i:i+8])
        rec = dat[off:off+size]
        nl = rec.find(b'\n')
        key = rec[:nl].decode('utf-8', 'replace')
        b, e = struct.unpack('<IH', rec[nl+1:nl+7])
        try:
            body = clean(blocks[b][e], keep_refs=True)
        except IndexError:
            continue
        if body:
            out.append(key.title() + '\n' + body)
    return '\n\n'.join(out)

if __name__ == '__main__':
    kind, path, outp = sys.argv[1:4]
    if kind == 'zld':
        txt = zld_text(path)
    else:
        txt = module_text(path, kind, '\n\n' if 'Com' in kind else '\n')
    open(outp, 'w', encoding='utf-8').write(txt + '\n')
    print(outp, len(txt))
