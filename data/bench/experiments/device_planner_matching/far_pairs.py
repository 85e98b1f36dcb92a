"""Where are the host's matched partners that lie outside a small spatial box? (ad hoc analysis)"""

import sys
from collections import Counter

import numpy as np

from sparseattn.planning.layout_pairs import full_blocks
from sparseattn.planning.pair_forward import _sharing_pairs
from sparseattn.workloads import get_workload

name = sys.argv[1] if len(sys.argv) > 1 else "vsa_wan14b_480p"
g = get_workload(name).build()
fid = np.flatnonzero(full_blocks(g.q))
nt, nh, nw, _ = g.q.tile_grid
sel = g.block_mask()
kp = g.k.live_pages.astype(np.float32)
co = np.stack(np.unravel_index(np.arange(g.q.num_blocks), (nt, nh, nw)), axis=1)
c = Counter()
ws_far = []
ws_near = []
ranks = []
for h in range(0, g.heads, 4):
    a, b, _ = _sharing_pairs(g.select_heads([h]), fid)
    d = co[b] - co[a]
    x = sel[h][fid].astype(np.float32)
    W = (x * kp) @ x.T
    np.fill_diagonal(W, 0)
    sa, sb = np.searchsorted(fid, a), np.searchsorted(fid, b)
    w = W[sa, sb]
    far = np.abs(d).max(axis=1) > 2
    ws_far += w[far].tolist()
    ws_near += w[~far].tolist()
    for t in map(tuple, d[far]):
        c[t] += 1
    # rank of the chosen partner within a's row of weights (0 = best)
    ranks += (W[sa] > w[:, None]).sum(axis=1).tolist()
print("far pairs (max|d|>2) offsets, most common:", c.most_common(15))
print(
    f"mean weight near {np.mean(ws_near):.1f} far {np.mean(ws_far):.1f}; n near {len(ws_near)} far {len(ws_far)}"
)
r = np.asarray(ranks)
print(
    "rank of host partner in a's row: ", {k: round(float(np.mean(r <= k)), 3) for k in (0, 1, 3, 7, 15, 31)}
)
# spatial distance of each block's best (argmax) partner
x = sel[0][fid].astype(np.float32)
W = (x * kp) @ x.T
np.fill_diagonal(W, 0)
bst = W.argmax(axis=1)
dd = np.abs(co[fid[bst]] - co[fid]).max(axis=1)
print("head 0: max|d| of each block's best partner:", np.bincount(dd))
