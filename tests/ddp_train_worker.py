"""Run by ``torchrun`` in tests/test_train.py: the same tiny EAGLE-3 training, any world size."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_tiny import tiny_examples, tiny_target, tiny_task  # noqa: E402

from verispec.train.loop import TrainConfig, Trainer  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    data = tiny_examples(16)
    task = tiny_task(tiny_target(), data)
    cfg = TrainConfig(out_dir=out, max_steps=4, batch_size=4, micro_batch_size=1, lr=3e-3, log_every=1,
                      progress=False, resume=False)
    Trainer(task, data, data[:4], cfg).fit()
