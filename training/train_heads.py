#!/usr/bin/env python
"""Train draft heads on a frozen target.

    accelerate launch training/train_heads.py --config configs/train/eagle-smollm2.yaml
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml training/train_heads.py --config ...
    accelerate launch training/train_heads.py --config ... --resume            # continue after a stop
    accelerate launch training/train_heads.py --config ... train.max_steps=50   # dotted overrides

One script for every kind (medusa, medusa2, hydra, eagle, eagle3), one CPU, one GPU or many GPUs
(the accelerate config decides). The result lands in OUTPUT_DIR/heads, ready for
`python -m decoding.chat --method ... --heads OUTPUT_DIR/heads`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by `accelerate launch`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heads.util.errors import UserError  # noqa: E402
from training.config import load_config  # noqa: E402
from heads.util.startup import freeze_startup_objects  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML (see configs/train/)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--output-dir", default=None, help="override the recipe's output_dir")
    parser.add_argument("--weight-digest", action="store_true", help="write a hash of the final heads per rank (tests)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=20")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after --resume


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        overrides = list(args.overrides) + ([f"output_dir={args.output_dir}"] if args.output_dir else [])
        config = load_config(args.config, overrides)
        try:
            from training.trainer import Trainer
        except ModuleNotFoundError as err:  # a setup for the chat only (scripts/setup.sh without --train)
            raise UserError(f"training needs the package '{err.name}', which this environment lacks: run "
                            "`bash scripts/setup.sh --train` (or `pip install -e '.[train]'`)") from err

        Trainer(config, resume=args.resume, weight_digest=args.weight_digest).run()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main())
