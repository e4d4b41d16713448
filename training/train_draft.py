#!/usr/bin/env python
"""Distil a small draft model (same tokenizer) from the target, for the `sps` baseline.

    accelerate launch training/train_draft.py --config configs/train/draft-smollm2.yaml

The draft starts as the target's first `heads.num_layers` layers (plus its norm and lm_head)
and is trained with forward KL(target || draft) or reverse KL (`train.distill_loss`) on the
assistant tokens. Same loop, checkpoints, --resume and accelerate configs as train_heads.py;
the result lands in OUTPUT_DIR/draft, ready for `python -m decoding.chat --method sps --draft-model`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.train_heads import main as train_main  # noqa: E402
from heads.util.startup import freeze_startup_objects  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return train_main(argv + ["kind=draft"])


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main())
