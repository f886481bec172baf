"""An offline Hugging Face cache written from local files: a process that never imports rlrunbook loads the staged
model and data set by their hub names, as after a download (``HF_HOME`` set, ``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rlrunbook.models import resolve_model
from rlrunbook.testing.hub_cache import stage_dataset, stage_model

READ_BACK = """
import json, datasets, transformers
from huggingface_hub import snapshot_download
rows = datasets.load_dataset("Org/Some-Set_V2")
streamed = datasets.load_dataset("Org/Some-Set_V2", split="train", streaming=True)
tokenizer = transformers.AutoTokenizer.from_pretrained("Org/Stand-In-7B")
print(json.dumps({"splits": sorted(rows), "train": list(rows["train"]["question"]), "test": len(rows["test"]),
                  "streamed": [row["question"] for row in streamed], "vocab": len(tokenizer),
                  "snapshot": snapshot_download("Org/Stand-In-7B")}))
"""


def test_a_staged_model_and_data_set_load_by_hub_name_offline(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{n}", "answer": n}) + "\n" for n in range(3)))
    hf_home = tmp_path / "hf"
    snapshot = stage_model(hf_home, "Org/Stand-In-7B", resolve_model("tiny"))
    stage_dataset(hf_home, "Org/Some-Set_V2", data)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "PYTHONPATH"}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", READ_BACK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["splits"] == ["test", "train"] and got["test"] == 3
    assert got["train"] == got["streamed"] == ["q0", "q1", "q2"]
    assert got["snapshot"] == str(snapshot) and got["vocab"] > 0
