"""Reads a run directory's TensorBoard event files with the loader
`tensorboard --logdir` runs (plugin_event_accumulator: scalars and texts as
tensors, orphaned data purged) and checks that they show what the run's metrics.jsonl holds: every
step's train loss, validation loss and learning rate (as f32), and its
text sample.

    .venv/bin/pip install tensorboard
    .venv/bin/python tools/check_tensorboard.py RUN_DIR
"""

import json
import os
import sys

import numpy as np
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

TAGS = {"loss": "loss/train", "val_loss": "loss/val", "lr": "optim/lr"}


def main(run):
    acc = EventAccumulator(run, size_guidance={"tensors": 0})
    acc.Reload()
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    checked = 0
    for key, tag in TAGS.items():
        want = [(r["step"], np.float32(r[key])) for r in records if r.get(key) is not None]
        got = [(e.step, np.float32(tensor_util.make_ndarray(e.tensor_proto).item())) for e in acc.Tensors(tag)]
        assert got == want, f"{tag}: {got[:5]}... != {want[:5]}..."
        checked += len(got)
    want = [(r["step"], r["sample"]) for r in records if "sample" in r]
    got = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("sample/text_summary")] if want else []
    assert got == want, f"samples: {got} != {want}"
    print(f"{run}: {checked} scalars and {len(got)} samples as metrics.jsonl has them; tags {sorted(acc.Tags()['tensors'])[:6]}...")


if __name__ == "__main__":
    main(sys.argv[1])
