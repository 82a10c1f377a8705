#!/usr/bin/env bash
# RubricHub data preparation for the SetGRPO recipes: RubricHub rows -> verl RL parquet files.
#
#   RUBRICHUB_TRAIN=/path/to/rubrichub_train.jsonl bash recipes/prepare_rubrichub.sh
#
# Reads a RubricHub file (.jsonl / .json / .parquet; one prompt with its weighted rubric per row), either one of the
# RubricHub_v1 release files as downloaded (prompt chat messages, Rubrics, rule-tagged criteria checked by code) or
# rows with question / id / rubrics. Duplicates (same id or same question text) are removed first, with one line
# saying how many; then it writes, with setgrpo_verl.grading.convert (rubric kept as JSON in
# reward_model.ground_truth, validated row by row), three disjoint splits:
#   $DATA_DIR/train.parquet   training prompts
#   $DATA_DIR/calib.parquet   calibration prompts (disjoint from train; used by `run.sh <recipe> calibrate`)
#   $DATA_DIR/test.parquet    validation prompts (RUBRICHUB_TEST if given -- its prompts are then left out of train and
#                             calib -- else held out from RUBRICHUB_TRAIN)
#
# Environment:
#   RUBRICHUB_TRAIN  required: the RubricHub training file, or several separated by commas (e.g. the release's
#                    rurbichub_v1_*.parquet shards)
#   RUBRICHUB_TEST   optional: a separate RubricHub evaluation file
#   DATA_DIR         output directory ($HOME/data/rubrichub)
#   CALIB_SIZE       calibration prompts held out from the training file (4096; the paper's Table 4 records used
#                    27,229 coverage + 27,229 risk groups)
#   VAL_SIZE         validation prompts held out when RUBRICHUB_TEST is not given (512)
#   SEED             shuffle seed of the split (0)
#   SYSTEM_PROMPT    optional system turn prepended to every prompt (a row's own system turn is kept either way)
#   PYTHON           python interpreter with setgrpo-verl installed (python3)

set -euo pipefail

: "${RUBRICHUB_TRAIN:?set RUBRICHUB_TRAIN to the RubricHub training file (.jsonl/.json/.parquet)}"
export RUBRICHUB_TRAIN
export RUBRICHUB_TEST=${RUBRICHUB_TEST:-}
export DATA_DIR=${DATA_DIR:-$HOME/data/rubrichub}
export CALIB_SIZE=${CALIB_SIZE:-4096}
export VAL_SIZE=${VAL_SIZE:-512}
export SEED=${SEED:-0}
export SYSTEM_PROMPT=${SYSTEM_PROMPT:-}

"${PYTHON:-python3}" - <<'EOF'
import os
import random

from setgrpo_verl.grading.convert import (drop_duplicate_rows, question_key, read_rubric_rows, rubrics_to_verl_rows,
                                          write_verl_parquet)

sources = [f for f in os.environ["RUBRICHUB_TRAIN"].split(",") if f]
rows, dropped = drop_duplicate_rows([row for f in sources for row in read_rubric_rows(f)])
print(f"{', '.join(sources)}: removed {dropped} duplicate rows (same id or same question text), "
      f"{len(rows)} distinct prompts remain")
test_file = os.environ["RUBRICHUB_TEST"]
if test_file:
    test, dropped_test = drop_duplicate_rows(read_rubric_rows(test_file))
    ids = {str(r["id"]) for r in test}
    questions = {question_key(r["question"]) for r in test}
    before = len(rows)
    rows = [r for r in rows if str(r["id"]) not in ids and question_key(r["question"]) not in questions]
    print(f"{test_file}: removed {dropped_test} duplicate rows; {before - len(rows)} training-file prompts that are "
          "also in the test file left out of train / calib")
random.Random(int(os.environ["SEED"])).shuffle(rows)
calib_size, val_size = int(os.environ["CALIB_SIZE"]), int(os.environ["VAL_SIZE"])
held_val = 0 if test_file else val_size
if calib_size < 1 or held_val + calib_size >= len(rows):
    raise SystemExit(f"error: {len(rows)} distinct rows cannot give {calib_size} calibration + {held_val} validation "
                     "prompts and a non-empty training set; lower CALIB_SIZE / VAL_SIZE")
if not test_file:
    test = rows[:held_val]
calib, train = rows[held_val:held_val + calib_size], rows[held_val + calib_size:]
system = os.environ["SYSTEM_PROMPT"] or None
out = os.path.expanduser(os.environ["DATA_DIR"])
for name, part in (("train", train), ("calib", calib), ("test", test)):
    path = write_verl_parquet(rubrics_to_verl_rows(part, split=name, system_prompt=system), os.path.join(out, f"{name}.parquet"))
    print(f"{path}: {len(part)} prompts")
EOF
