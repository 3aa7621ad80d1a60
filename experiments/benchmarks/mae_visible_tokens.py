"""What MAE's dropped tokens save: the MAE step with the encoder on the visible tokens only against the same step with
the encoder on every token (the hidden ones replaced by a mask token, SimMIM's way; `tfmp.ssl.mae.MAE(visible_only=
False)`), the decoder the same.

    python experiments/benchmarks/mae_visible_tokens.py --model=vit_small_p16 --image_size=224 --batch=8 \
        --decoders=512x8,128x2 --precision=mixed_bfloat16 --rounds=5

One process, the two steps built side by side and timed in interleaved rounds (each round: `--steps` steps of one,
then of the other; medians over the rounds), so machine noise hits both alike. Prints one JSON line per decoder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tfmp import tf_environment

tf_environment.prepare()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_p16")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mask_ratio", type=float, default=0.75)
    parser.add_argument("--decoders", default="512x8", help="WIDTHxDEPTH,... (heads: width / 32)")
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    from tfmp import models
    from tfmp.ssl.mae import MAE

    keras.mixed_precision.set_global_policy(args.precision)
    images = tf.constant(np.random.default_rng(0).uniform(size=(args.batch, args.image_size, args.image_size, 3)), tf.float32)
    for decoder in args.decoders.split(","):
        width, depth = map(int, decoder.split("x"))
        steps = {}
        for visible_only in (True, False):
            keras.utils.set_random_seed(0)
            model = MAE(models.build_encoder(args.model, (args.image_size, args.image_size, 3)), mask_ratio=args.mask_ratio,
                        decoder_width=width, decoder_depth=depth, decoder_heads=max(width // 32, 1), visible_only=visible_only)
            model.compile(optimizer=keras.optimizers.AdamW(1e-4))
            model.train_on_batch(images)  # traces and builds the optimizer
            steps[visible_only] = model
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for visible_only, model in steps.items():
                started = time.perf_counter()
                for _ in range(args.steps):
                    model.train_on_batch(images)
                times[visible_only].append((time.perf_counter() - started) / args.steps)
        visible, every = statistics.median(times[True]), statistics.median(times[False])
        print(json.dumps({"model": args.model, "image_size": args.image_size, "batch": args.batch, "precision": args.precision,
                          "mask_ratio": args.mask_ratio, "decoder": decoder, "visible_tokens_step_ms": round(1e3 * visible, 1),
                          "all_tokens_step_ms": round(1e3 * every, 1), "speedup": round(every / visible, 2),
                          "rounds": args.rounds, "steps_per_round": args.steps}), flush=True)


if __name__ == "__main__":
    main()
