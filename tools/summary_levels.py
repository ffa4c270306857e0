"""A kvtier CLI run (an eval) with the 8-bit page summaries' codes limited to |code| <= LEVELS: 127
is the product's 8-bit codes, 7 what 4-bit codes would hold (kv/summaries.py exponents: the least
e with max |key| <= LEVELS x 2^e). A recall experiment for smaller summaries (issue 12: a 256K
step scores 1.21 GB of 8-bit summaries); it patches the PyTorch path only, so run evals on CPU.

    python3 tools/summary_levels.py 7 eval planted --lengths 65536,262144 --selectors hybrid-mid/8 ...
    python3 tools/summary_levels.py 7 eval recall -m qwen2.5-coder-0.5b --selectors hybrid-mid/8 ...
"""

from __future__ import annotations

import sys

import torch

import kvtier.kv.summaries as summaries

LEVELS = int(sys.argv.pop(1))
SHIFT = {127: 7, 63: 6, 31: 5, 15: 4, 7: 3}  # LEVELS x 2^e covers [2^(x-1), 2^x) from e = x - SHIFT


def exponents(amax: torch.Tensor) -> torch.Tensor:
    """summaries.exponents with LEVELS in place of 127."""
    amax = amax.float()
    x = torch.frexp(amax).exponent.to(torch.int32)
    x = torch.where(amax < 2.0 ** -126, -126, x)
    e0 = (x - SHIFT[LEVELS]).clamp_min(summaries.E_MIN)
    return e0 + (amax > LEVELS * summaries.pow2(e0)).to(torch.int32)


summaries.exponents = exponents

if __name__ == "__main__":
    from kvtier.cli import main
    sys.exit(main())
