"""Pre-train a diffusion language model: the same flags as `megadlms train`.

    python pretrain_difflm.py --model-path qwen3-1.7b --data-path DATA_text_document \
        --tokenizer-model TOKENIZER_DIR --fp8-format hybrid --micro-batch-size 4 --train-iters 1000
    torchrun --nproc_per_node 8 pretrain_difflm.py ...
"""

import sys

from megadlms.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:], prog="pretrain_difflm.py"))
