#!/usr/bin/env python3
"""Module-level import graph of a crate from `use crate::…` / `crate::…` paths; prints cycles.
Usage: scripts/import-graph.py CRATE_SRC_DIR [--rooms] [--edges]. Nodes are files (mod.rs = its folder's module); an edge
A -> B when A names a path under crate::B (the longest module prefix that is a file)."""
import os, re, sys
src = sys.argv[1]
mods = {}
for root, _, files in os.walk(src):
    for f in files:
        if not f.endswith('.rs'): continue
        p = os.path.join(root, f); rel = os.path.relpath(p, src)[:-3].split(os.sep)
        if rel[-1] == 'mod': rel = rel[:-1]
        if rel in (['lib'], ['main']): rel = []
        mods[p] = tuple(rel)
known = set(mods.values())
edges = {}
pat = re.compile(r'crate::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)')
def strip_tests(text):
    i = text.find('#[cfg(test)]')
    return text if i < 0 else text[:i]
for p, m in mods.items():
    text = strip_tests(open(p).read())
    text = re.sub(r'//.*', '', text)
    # expand `use crate::{a, b::c}` groups
    for g in re.finditer(r'crate::\{([^;]*?)\};', text, re.S):
        for part in re.split(r'[,\s{}]+', g.group(1)):
            if part: text += f'\ncrate::{part}'
    for u in pat.finditer(text):
        parts = tuple(u.group(1).split('::'))
        best = ()
        for i in range(len(parts), 0, -1):
            if parts[:i] in known: best = parts[:i]; break
        if best != m and not (m[:len(best)] == best and best == ()):
            edges.setdefault(m, set()).add(best)
if '--rooms' in sys.argv:
    # Collapse every file into its room: the first component of its module path.
    room = lambda m: m[:1]
    collapsed = {}
    for a, bs in edges.items():
        for b in bs:
            if room(a) != room(b) and b != ():
                collapsed.setdefault(room(a), set()).add(room(b))
    edges = collapsed
    mods = {k: room(v) for k, v in mods.items()}
# super:: edges
names = lambda m: '/'.join(m) or 'lib'
# cycles via Tarjan SCC
idx, low, st, on, sccs, c = {}, {}, [], set(), [], [0]
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in edges.get(v, ()):
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        s = []
        while True:
            w = st.pop(); on.discard(w); s.append(w)
            if w == v: break
        if len(s) > 1: sccs.append(s)
sys.setrecursionlimit(10000)
for v in list(mods.values()):
    if v not in idx: sc(v)
ignore_root = '--ignore-root' in sys.argv
found = 0
for s in sccs:
    print('cycle:', ', '.join(sorted(names(x) for x in s)))
    for a in s:
        for b in sorted(edges.get(a, ())):
            if b in s: print('   ', names(a), '->', names(b))
    found += 1
print(f"{found} cycle(s) among {len(set(mods.values()))} {'rooms' if '--rooms' in sys.argv else 'files'} (edges into the crate root, lib.rs, are not counted)")
if '--edges' in sys.argv:
    for a in sorted(edges):
        print('   ', names(a), '->', ', '.join(sorted(names(b) for b in edges[a])))
