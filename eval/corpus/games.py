# Vendored from the sparsify team's shared tools (tools/corpus/: get-corpus.sh, build.py, sword.py, games.py), unchanged but for this comment. Never commit the text it writes (licences per file in MANIFEST.tsv).
import json, os, re, sys, glob

KEYS = {'description', 'text', 'dynamic_line', 'message', 'msg', 'info', 'messages', 'snippet', 'snippets',
        'str', 'str_sp', 'success_message', 'failure_message', 'use_message', 'effect_message', 'speech',
        'dialogue', 'lore', 'flavor', 'desc'}

def walk(o, key=None, out=None):
    if isinstance(o, str):
        if key in KEYS and len(o) >= 40 and ' ' in o:
            out.append(o)
    elif isinstance(o, dict):
        for k, v in o.items():
            # 'str' inside name objects is usually short; keep only if long enough (handled by len filter)
            walk(v, k if k in KEYS else (key if k in ('str', 'str_sp', 'ctxt', 'yes', 'no') else k), out)
    elif isinstance(o, list):
        for v in o:
            walk(v, key, out)
    return out

def cdda(root):
    out = []
    for p in sorted(glob.glob(os.path.join(root, '**', '*.json'), recursive=True)):
        if '/gfx/' in p or '/names/' in p or '/font' in p:
            continue
        try:
            d = json.load(open(p, encoding='utf-8'))
        except Exception:
            continue
        walk(d, None, out)
    seen = set(); res = []
    for s in out:
        s = re.sub(r'<[^>]{1,40}>', '', s).strip()
        if s and s not in seen:
            seen.add(s); res.append(s)
    return '\n\n'.join(res)

if __name__ == '__main__':
    t = cdda(sys.argv[1])
    open(sys.argv[2], 'w').write(t + '\n'); print(len(t))

def endless_sky(root):
    out = []; seen = set()
    for p in sorted(glob.glob(os.path.join(root, 'data', '**', '*.txt'), recursive=True)):
        para = []
        for line in open(p, encoding='utf-8', errors='replace'):
            s = line.strip()
            m = re.match(r'^(?:(?:description|spaceport|log|message|dialog|tip|help|name)\s+(?:"[^"]*"\s+)*)?`(.*)`$', s) or \
                re.match(r'^(?:(?:description|spaceport|log|dialog|tip|help)\s+(?:"[^"]*"\s+)*)"(.*)"$', s)
            if m:
                t = m.group(1).strip()
                if len(t) >= 20 and ' ' in t:
                    para.append(t); continue
            if para:
                blk = '\n'.join(para)
                if blk not in seen:
                    seen.add(blk); out.append(blk)
                para = []
        if para:
            blk = '\n'.join(para)
            if blk not in seen:
                seen.add(blk); out.append(blk)
    return '\n\n'.join(out)

def crossfire(root):
    out = []; seen = set()
    for dp, dn, fn in os.walk(root):
        for f in fn:
            p = os.path.join(dp, f)
            try:
                lines = open(p, encoding='latin-1').read().split('\n')
            except Exception:
                continue
            inmsg = False; buf = []
            for ln in lines:
                if ln.strip() == 'msg':
                    inmsg = True; buf = []; continue
                if ln.strip() == 'endmsg':
                    inmsg = False
                    txt = '\n'.join(l for l in buf if not l.startswith('@'))
                    txt = txt.strip()
                    if len(txt) >= 60 and txt not in seen:
                        seen.add(txt); out.append(txt)
                    continue
                if inmsg:
                    buf.append(ln)
    return '\n\n'.join(out)

def crawl(root):
    out = []; seen = set()
    files = glob.glob(os.path.join(root, 'dat', 'descript', '*.txt'))  # English descriptions + quotes only
    for p in sorted(files):
        raw = open(p, encoding='utf-8', errors='replace').read()
        for ent in re.split(r'^%%%%\s*$', raw, flags=re.M):
            lines = [l for l in ent.strip().split('\n') if not l.startswith('#')]
            if len(lines) < 2:
                continue
            body = '\n'.join(lines[1:]).strip()
            body = re.sub(r'<[^>]{0,20}>', '', body)
            body = re.sub(r'@[a-z_]+@', 'you', body)
            if len(body) >= 60 and ' ' in body and body not in seen:
                seen.add(body); out.append(body)
    return '\n\n'.join(out)
