"""A tiny GPT-2 by Hugging Face `transformers`, and its logits, for tests/test_init_from.py.

Every parameter drawn at random (biases and norms too, so that each one's place is checked), saved
as `transformers` saves it, with the logits of a fixed batch. `transformers` and `torch` are not
requirements of this project; in a virtual environment of their own:

  python3.11 -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers safetensors
  /tmp/hf/bin/python dev/gpt2.py                    # writes tests/gpt2/ (model, config, logits)
  /tmp/hf/bin/python dev/gpt2.py --check OUT        # a file in GPT-2's names: its logits against
                                                    # tests/gpt2's (tools/export.py --names gpt2)
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from transformers import GPT2Config, GPT2LMHeadModel

HERE = Path(__file__).resolve().parent.parent / "tests" / "gpt2"
CONFIG = dict(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=256, bos_token_id=0)
CONFIG["eos_token_id"] = 0


def make() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:  # 0.2: logits of a few units, so that a wrong place shows
                p.copy_(0.2 * torch.randn_like(p))
    return model


def logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", help="a .safetensors file in GPT-2's names to load and run")
    args = parser.parse_args(argv)
    if args.check:  # as a user loads it: the file as model.safetensors beside a config
        tensors = safetensors.torch.load_file(args.check)
        config = GPT2Config(**{**CONFIG, "vocab_size": len(tensors["wte.weight"])})
        with tempfile.TemporaryDirectory() as folder:
            config.save_pretrained(folder)
            shutil.copy(args.check, f"{folder}/model.safetensors")
            model = GPT2LMHeadModel.from_pretrained(folder).eval()
        saved = np.load(HERE / "logits.npz")
        theirs = saved["logits"]
        mine = logits(model, saved["tokens"])[..., : theirs.shape[-1]]
        apart = np.abs(mine - theirs).max() / np.abs(theirs).max()
        print(f"largest |difference| {apart:.1e} of the largest logit")
        return 0
    model = make()
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, CONFIG["n_positions"]))
    HERE.mkdir(exist_ok=True)
    model.save_pretrained(HERE)
    np.savez(HERE / "logits.npz", tokens=tokens, logits=logits(model, tokens))
    print(f"wrote {HERE}: {sorted(p.name for p in HERE.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
