"""Writes tests/fixtures/tensorboard/: TensorBoard's own event-file writer
(the `tensorboard` package's EventFileWriter and its protos) given the
events of golden.json, into golden.tfevents. tests/tensorboard.rs has
megatrain's writer produce the same events and compares the bytes.

    .venv/bin/pip install tensorboard
    .venv/bin/python tools/make_tensorboard_golden.py
"""

import glob
import json
import math
import os
import shutil
import tempfile
import time
from unittest import mock

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "tensorboard")

# Every kind of event megatrain writes: the file's version line, a resumed
# run's purge (SessionLog START), scalars (several in one event; zero, a
# negative, NaN, ±inf, a value that rounds to f32, a step past 2^32) and a
# text sample (not ASCII).
SPEC = {
    "version_wall_time": 1764500000.25,
    "events": [
        {"kind": "start", "step": 7, "wall_time": 1764500001.5},
        {"kind": "scalars", "step": 8, "wall_time": 1764500002.125,
         "values": [["loss/train", "4.2109375"], ["optim/lr", "0.001"], ["throughput/tokens_per_s", "123456.789"]]},
        {"kind": "scalars", "step": 0, "wall_time": 1764500003.0,
         "values": [["loss/val", "0"], ["detail/x", "-2.5"]]},
        {"kind": "scalars", "step": 9, "wall_time": 1764500004.0,
         "values": [["a", "nan"], ["b", "inf"], ["c", "-inf"], ["d", "1e-30"]]},
        {"kind": "scalars", "step": 1099511627776, "wall_time": 1764500005.0, "values": [["loss/train", "1.5"]]},
        {"kind": "text", "step": 10, "wall_time": 1764500006.0, "tag": "sample",
         "text": "ROMEO:\nO, she doth teach the torches to burn bright — ½ ✓"},
    ],
}


def event(e):
    ev = event_pb2.Event(wall_time=e["wall_time"], step=e["step"])
    if e["kind"] == "start":
        ev.session_log.status = event_pb2.SessionLog.START
    elif e["kind"] == "scalars":
        ev.summary.CopyFrom(summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=t, simple_value=float(v)) for t, v in e["values"]
        ]))
    else:
        # As torch.utils.tensorboard's `text` summary writes it.
        meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(
            dtype="DT_STRING",
            string_val=[e["text"].encode("utf-8")],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]),
        )
        ev.summary.CopyFrom(summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=e["tag"] + "/text_summary", metadata=meta, tensor=tensor)
        ]))
    return ev


def main():
    os.makedirs(HERE, exist_ok=True)
    tmp = tempfile.mkdtemp()
    try:
        with mock.patch.object(time, "time", return_value=SPEC["version_wall_time"]):
            w = EventFileWriter(tmp)
        for e in SPEC["events"]:
            w.add_event(event(e))
        w.close()
        (path,) = glob.glob(os.path.join(tmp, "events.out.tfevents.*"))
        shutil.copyfile(path, os.path.join(HERE, "golden.tfevents"))
    finally:
        shutil.rmtree(tmp)
    with open(os.path.join(HERE, "golden.json"), "w") as f:
        json.dump(SPEC, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote", HERE)


if __name__ == "__main__":
    main()
