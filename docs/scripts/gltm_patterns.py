"""Pictures of GLTM's sparsity patterns for docs/mixers/gltm.md:

    python docs/scripts/gltm_patterns.py [OUT.png]      (default docs/gltm_patterns.png)

Top row: each pattern's supports on 32 tokens (row i, column j): the A-support N(i) in light, the B-support P(i)
(the past outputs token i reads) in dark. Bottom row: the communication graph seen from the last token, as the
number of hops of the shortest path from each earlier position j to it (edges j -> i for j in P(i)): how far
information must travel through past outputs. Everything comes from hf_mixers.ops.pattern_support.
"""

from __future__ import annotations

import sys
from collections import deque

from hf_mixers.ops import pattern_support

PATTERNS = ("banded", "pow2", "pow2_ce", "quad", "quad_ce")
LENGTH = 32


def hops_to_last(supports):
    """Shortest-path hops from every position to the last one, walking the graph backwards from it."""
    last = len(supports)
    hops = {last: 0}
    queue = deque([last])
    while queue:
        node = queue.popleft()
        for source in supports[node - 1]:
            if source not in hops:
                hops[source] = hops[node] + 1
                queue.append(source)
    return [hops.get(j) for j in range(1, last)]


def main(path="docs/gltm_patterns.png"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(2, len(PATTERNS), figsize=(3.2 * len(PATTERNS), 6.6),
                                gridspec_kw={"height_ratios": [3, 1.3]})
    for column, pattern in enumerate(PATTERNS):
        supports = pattern_support(pattern, LENGTH, window=4)
        picture = np.zeros((LENGTH, LENGTH))
        for i, row in enumerate(supports, start=1):
            picture[i - 1, i - 1] = 1  # the current token: A only
            for j in row:
                picture[i - 1, j - 1] = 2
        axes[0, column].imshow(picture, cmap="Blues", vmin=0, vmax=2.2)
        axes[0, column].set_title(f"{pattern}: max |P(i)| = {max(len(r) for r in supports)}", fontsize=10)
        axes[0, column].set_xlabel("j (read)")
        axes[0, column].set_ylabel("i (token)")
        hops = hops_to_last(supports)
        axes[1, column].bar(range(1, LENGTH), [h if h is not None else 0 for h in hops], color="tab:blue")
        axes[1, column].set_title(f"hops from j to token {LENGTH} (max {max(h for h in hops if h is not None)})",
                                  fontsize=9)
        axes[1, column].set_xlabel("j")
    figure.suptitle(f"GLTM patterns on {LENGTH} tokens (banded: w = 4); dark: B-support P(i), light: the current "
                    "token (A-support = both)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
