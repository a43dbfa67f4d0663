#!/usr/bin/env python
"""Megatron-LM style entry point: same flags and code as `megadlms preprocess`.

    python tools/preprocess_data.py --input data/*.jsonl --output-prefix data/corpus --append-eod --workers 8
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megadlms.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
