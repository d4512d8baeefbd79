"""An alpaca .jsonl made from a text, for timing instruction data loads
(BENCHMARKS.md, "Training data"): each record's instruction is "Continue: "
and 200 characters, its output the next 200; the text is walked `repeats`
times.

    python3 benches/mkjsonl.py ../shared/data/tinyshakespeare.txt sft.jsonl 10
"""
import json
import sys

text_path, out_path, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
text = open(text_path, encoding="utf-8").read()
n = 0
with open(out_path, "w", encoding="utf-8") as out:
    for _ in range(repeats):
        for i in range(0, len(text) - 400, 400):
            a, b = text[i : i + 200], text[i + 200 : i + 400]
            out.write(json.dumps({"instruction": "Continue: " + a, "input": "", "output": b}) + "\n")
            n += 1
print(f"{n} records in {out_path}")
