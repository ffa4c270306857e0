"""A kvtier CLI run (an eval) with the 8-bit page summaries' codes limited to |code| <= LEVELS
(kv/summaries.py CODE_MAX, 2^b - 1): 127 is the product's 8-bit codes, 7 what 4-bit codes would
hold. A recall experiment for smaller summaries (issue 12: a 256K step scores 1.21 GB of 8-bit
summaries); the kernels keep 127, so run evals on CPU.

    python3 tools/summary_levels.py 7 eval planted --lengths 65536,262144 --selectors hybrid-mid/8 ...
    python3 tools/summary_levels.py 7 eval recall -m qwen2.5-coder-0.5b --selectors hybrid-mid/8 ...
"""

from __future__ import annotations

import sys

import kvtier.kv.summaries as summaries

if __name__ == "__main__":
    summaries.CODE_MAX = int(sys.argv.pop(1))
    if summaries.CODE_MAX & (summaries.CODE_MAX + 1) or not 1 <= summaries.CODE_MAX <= 127:
        sys.exit("LEVELS must be 2^b - 1, 1 .. 127")
    from kvtier.cli import main
    sys.exit(main())
