#!/usr/bin/env python3
"""Checks a library crate's layout (issue 30): which source file uses which (through `use`, inline
`crate::`/`super::`/`self::` paths and paths to child modules; a re-export is followed to the
file that defines the item), the cycles among files (pairs that import each other, and strongly
connected components of more than one file), and files over 1000 lines. Exits 1 on any.

    python3 ci/layout.py comm/src [--edges]    # --edges also prints every file's imports

Every library crate passes (fsio, comm, launch, data, models, ddp, apps), and ci/run.sh runs
it on each."""
import os
import re
import sys

src = sys.argv[1].rstrip('/')
show_edges = '--edges' in sys.argv

files = {}  # module path (tuple) -> file path
for root, dirs, names in os.walk(src):
    rel = os.path.relpath(root, src)
    if rel.split(os.sep)[0] == 'bin':
        continue
    for n in names:
        if not n.endswith('.rs'):
            continue
        parts = [] if rel == '.' else rel.split(os.sep)
        if n in ('lib.rs', 'main.rs'):
            mod = tuple(parts)
        elif n == 'mod.rs':
            mod = tuple(parts)
        else:
            mod = tuple(parts + [n[:-3]])
        files[mod] = os.path.join(root, n)


def strip(text):
    # drop comments and string/char literals (roughly), keep line structure
    out = []
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i)
            i = n if j == -1 else j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2)
            seg = text[i:(n if j == -1 else j + 2)]
            out.append('\n' * seg.count('\n'))
            i = n if j == -1 else j + 2
        elif c == 'r' and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i-1].isalnum() or text[i-1] == '_')):
            m = re.match(r'r(#*)"', text[i:])
            hashes = m.group(1)
            end = text.find('"' + hashes, i + len(m.group(0)))
            seg = text[i:(n if end == -1 else end + 1 + len(hashes))]
            out.append('""' + '\n' * seg.count('\n'))
            i = n if end == -1 else end + 1 + len(hashes)
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == '\\' else 1
            seg = text[i:j + 1]
            out.append('""' + '\n' * seg.count('\n'))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]):
            m = re.match(r"'(\\.|[^\\'])'", text[i:i + 4])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return ''.join(out)


code = {m: strip(open(p).read()) for m, p in files.items()}


def defined_in(mod, name):
    """Whether file `mod` defines item `name` itself (not a module, not a re-export)."""
    t = code[mod]
    return re.search(r'\b(fn|struct|enum|trait|type|const|static|macro_rules!)\s+' + re.escape(name) + r'\b', t) is not None


def reexports(mod):
    """`pub use` / `pub(crate) use` in file `mod`: name -> full path (list)."""
    t = code[mod]
    table = {}
    for m in re.finditer(r'pub(?:\([^)]*\))?\s+use\s+([^;]+);', t):
        for path in expand(m.group(1).replace('\n', ' ')):
            alias = path[-1]
            if ' as ' in alias:
                orig, alias = [x.strip() for x in alias.split(' as ')]
                path = path[:-1] + [orig]
            table[alias] = path
    return table


def expand(tree):
    """`a::{b, c::{d, e}}` -> [[a,b],[a,c,d],[a,c,e]]"""
    tree = tree.strip()
    depth = 0
    for i, ch in enumerate(tree):
        if ch == '{':
            if depth == 0:
                prefix = tree[:i].rstrip(':').strip()
                inner = tree[i + 1:tree.rindex('}')]
                items, d, cur = [], 0, ''
                for c in inner:
                    if c == ',' and d == 0:
                        items.append(cur)
                        cur = ''
                        continue
                    d += c == '{'
                    d -= c == '}'
                    cur += c
                items.append(cur)
                res = []
                pre = [p for p in prefix.split('::') if p] if prefix else []
                for it in items:
                    if not it.strip():
                        continue
                    for sub in expand(it):
                        res.append(pre + sub)
                return res
            depth += 1
        elif ch == '}':
            depth -= 1
    return [[p.strip() for p in tree.split('::') if p.strip()]]


def resolve(from_mod, path, in_tests):
    """The file (module tuple) that `path` (list of segments) reaches from `from_mod`."""
    if not path:
        return None
    head = path[0]
    if head == 'crate':
        base = ()
        rest = path[1:]
    elif head == 'super':
        base = from_mod if in_tests else from_mod[:-1]
        rest = path[1:]
        while rest and rest[0] == 'super':
            base = base[:-1]
            rest = rest[1:]
    elif head == 'self':
        base = from_mod
        rest = path[1:]
    elif from_mod + (head,) in files:
        # A path relative to the current module (uniform paths): a child module.
        base = from_mod
        rest = path
    else:
        return None
    mod = base
    i = 0
    while i < len(rest) and mod + (rest[i],) in files:
        mod = mod + (rest[i],)
        i += 1
    if i < len(rest):
        name = rest[i]
        if name in ('*', 'self'):
            return mod
        if not defined_in(mod, name):
            table = reexports(mod)
            if name in table:
                target = table[name]
                r = resolve(mod, target, False) if target[0] in ('crate', 'super', 'self') else resolve(mod, ['self'] + target, False)
                if r is not None:
                    return r
    return mod


edges = {m: set() for m in files}
for mod, t in code.items():
    test_start = t.find('mod tests {')
    for m in re.finditer(r'\buse\s+([^;]+);', t):
        in_tests = test_start != -1 and m.start() > test_start
        for path in expand(m.group(1).replace('\n', ' ')):
            path = [p.split(' as ')[0].strip() for p in path]
            r = resolve(mod, path, in_tests)
            if r is not None and r != mod:
                edges[mod].add(r)
    for m in re.finditer(r'(?<![\w:])((?:crate|super|self)(?:::\w+)+)', t):
        in_tests = test_start != -1 and m.start() > test_start
        r = resolve(mod, m.group(1).split('::'), in_tests)
        if r is not None and r != mod:
            edges[mod].add(r)


def name(m):
    return os.path.relpath(files[m], src)


# Tarjan's strongly connected components.
index, low, stack, on, sccs = {}, {}, [], set(), []
counter = [0]


def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        sccs.append(comp)


sys.setrecursionlimit(10000)
for v in files:
    if v not in index:
        visit(v)

ok = True
pairs = sorted({tuple(sorted((name(a), name(b)))) for a in edges for b in edges[a] if a in edges[b]})
for a, b in pairs:
    print(f'MUTUAL IMPORT: {a} <-> {b}')
    ok = False
for comp in sccs:
    if len(comp) > 1:
        print('CYCLE: ' + ', '.join(sorted(name(m) for m in comp)))
        ok = False
for m, p in sorted(files.items(), key=lambda kv: kv[1]):
    lines = sum(1 for _ in open(p))
    if lines > 1000:
        print(f'OVER 1000 LINES: {name(m)} ({lines})')
        ok = False
if show_edges:
    for m in sorted(files, key=name):
        print(f'{name(m)} -> ' + ', '.join(sorted(name(x) for x in edges[m])))
print('OK' if ok else 'FAILED')
sys.exit(0 if ok else 1)
