"""A reward model already trained by 02_train_reward.py as a plain model folder that any OpenAI-compatible server can
serve (its LoRA adapter merged into the weights; 02 --merge DIR does the same right after training):

    python tools/merge_reward_model.py runs/demo/reward_model runs/demo/reward_model_merged
    transformers serve runs/demo/reward_model_merged --host 127.0.0.1 --port 8000 --device cpu --dtype float32
    python 03_train_policy.py --critic openai --critic-base-url http://127.0.0.1:8000/v1 --critic-api completions \\
        --critic-model runs/demo/reward_model_merged --reward-model runs/demo/reward_model_merged

The folder keeps the reward model's reward_model.json, so --reward-model DIR cuts the input and budgets the critique as
stage 2 trained it; with --critic-api completions at temperature 0 the served critic writes what --critic local writes.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from infra import reward_models  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reward_model", help="stage 2's output folder (adapter + reward_model.json)")
    p.add_argument("out_dir", help="the merged model folder to write (replaced if it exists)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bf16", "fp16"], help="the merged weights' dtype")
    args = p.parse_args()
    try:
        reward_models.check_reward_model(args.reward_model, "")
        print(reward_models.merge_reward_model(args.reward_model, args.out_dir, args.dtype))
    except common.DataError as e:  # bad input: one line, exit code 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
