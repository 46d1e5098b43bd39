"""Writes lm-evaluation-harness's ``gpl3_perplexity`` task into a folder: the GPL-3
text's sections (``/usr/share/common-licenses/GPL-3``, Debian's base-files) as
documents scored by ``loglikelihood_rolling``, as wikitext's articles are."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TEXT = Path("/usr/share/common-licenses/GPL-3")
TASK = """task: gpl3_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    parts = re.split(r"\n\s*\n(?=\s*\d+\. )", TEXT.read_text())
    documents = [p.strip() for p in parts if len(p.strip()) > 200][:12]
    data = folder / "gpl3.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (folder / "gpl3_perplexity.yaml").write_text(TASK.format(data=data))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
