"""Your own data, as a --dataset loader: a corpus already tokenized into a NumPy array of token
ids (tokens.npy in --data-dir, as your tokenizer would write it), its last tenth held out.
Train on it with any script:

  python fsdp.py --dataset tests/token_data.py --data-dir DIR --vocab-size 512

A loader is a Python file or module whose function load(config) returns an object with
describe(), loss_floor and batch(step, start, stop, split) (common.py's Data section).
"""

import os

import numpy as np

import common


class Tokens:
    loss_floor = None  # unknown for real data

    def __init__(self, config):
        path = os.path.join(config.data_dir or ".", "tokens.npy")
        common.require(os.path.isfile(path), "data_dir", f"has no {path}, e.g. --data-dir DIR")
        data = np.load(path, mmap_mode="r")  # read a window at a time, never the whole file
        cut = len(data) * 9 // 10
        self.splits = {"train": data[:cut], "eval": data[cut:]}
        self.seed, self.length = config.seed, config.seq_len + 1
        self.text = f"{path}: {len(data):,} tokens, the last tenth held out"

    def describe(self):
        return self.text

    def batch(self, step, start, stop, split="train"):
        """Rows [start, stop) of batch `step`: windows at places drawn from (seed, split, step,
        row), so any process makes the same rows and a resumed run sees the same batches."""
        tokens, rows = self.splits[split], []
        for row in range(start, stop):
            rng = np.random.default_rng((self.seed, common.SPLITS[split], step, row))
            place = rng.integers(len(tokens) - self.length + 1)
            rows.append(tokens[place : place + self.length])
        return np.stack(rows).astype(np.int32)


def load(config):
    return Tokens(config)
