"""Start-up is quiet: no NLTK download attempts from if-verifiable, no transformers warning or progress bar per
model load. (That a rule needing absent NLTK data still fails loudly is tested in test_rubric.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_NLTK_PROBE = """
import json, nltk
from setgrpo_verl.grading.rules import registry, missing_nltk_data
registry("ifbench")
registry("ifeval")
absent = []
for path, name in [("tokenizers/punkt", "punkt"), ("tokenizers/punkt_tab", "punkt_tab"),
                   ("taggers/averaged_perceptron_tagger_eng", "averaged_perceptron_tagger_eng"),
                   ("corpora/stopwords", "stopwords")]:
    try:
        nltk.data.find(path)
    except LookupError:
        absent.append(name)
print(json.dumps({"refused": sorted(missing_nltk_data()), "absent": sorted(absent),
                  "download_restored": nltk.download.__module__}))
"""


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_if_verifiable_import_attempts_no_nltk_download(tmp_path):
    proc = _python(_NLTK_PROBE, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "nltk_data" not in out and "Error loading" not in out, out[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # exactly the data if-verifiable wanted and that is not installed was refused; the real downloader is back
    assert report["refused"] == report["absent"]
    assert report["download_restored"].startswith("nltk")


_MODEL_PROBE = """
from setgrpo_verl.models import embedded_model_dir, load_causal_lm
embedded_model_dir()  # a first conversion (progress bars) happens before the measured part
import sys
print("---measured---", file=sys.stderr, flush=True)
model, tok = load_causal_lm()
ids = tok("Hello , world ! It's here .")["input_ids"]
print(repr(tok.decode(ids)))
print(tok.clean_up_tokenization_spaces)
"""


@pytest.mark.slow
def test_model_load_and_decode_print_nothing(tmp_path):
    proc = _python(_MODEL_PROBE, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = proc.stderr.split("---measured---", 1)[1]
    assert "clean_up_tokenization_spaces" not in measured and "Loading weights" not in measured, measured[-2000:]
    text, flag = proc.stdout.strip().splitlines()[-2:]
    assert text == repr("Hello , world ! It's here .")  # BPE decoding keeps the spaces before punctuation
    assert flag == "False"
