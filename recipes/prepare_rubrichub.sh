#!/usr/bin/env bash
# RubricHub data preparation for the SetGRPO recipes: RubricHub rows -> verl RL parquet files.
#
#   RUBRICHUB_TRAIN=/path/to/rubrichub_train.jsonl bash recipes/prepare_rubrichub.sh
#
# Reads a RubricHub-format file (.jsonl / .json / .parquet; one prompt with its weighted rubric per row) and writes,
# with setgrpo_verl.grading.convert (rubric kept as JSON in reward_model.ground_truth, validated row by row):
#   $DATA_DIR/train.parquet   training prompts
#   $DATA_DIR/calib.parquet   calibration prompts (disjoint from train; used by `<model>.sh calibrate`)
#   $DATA_DIR/test.parquet    validation prompts (RUBRICHUB_TEST if given, else held out from RUBRICHUB_TRAIN)
#
# Environment:
#   RUBRICHUB_TRAIN  required: the RubricHub training file
#   RUBRICHUB_TEST   optional: a separate RubricHub evaluation file
#   DATA_DIR         output directory ($HOME/data/rubrichub)
#   CALIB_SIZE       calibration prompts held out from the training file (4096; the paper's Table 4 records used
#                    27,229 coverage + 27,229 risk groups)
#   VAL_SIZE         validation prompts held out when RUBRICHUB_TEST is not given (512)
#   SEED             shuffle seed of the split (0)
#   SYSTEM_PROMPT    optional system turn prepended to every prompt
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

from setgrpo_verl.grading.convert import read_rubric_rows, rubrics_to_verl_rows, write_verl_parquet

rows = read_rubric_rows(os.environ["RUBRICHUB_TRAIN"])
random.Random(int(os.environ["SEED"])).shuffle(rows)
calib_size, val_size = int(os.environ["CALIB_SIZE"]), int(os.environ["VAL_SIZE"])
test_file = os.environ["RUBRICHUB_TEST"]
held_val = 0 if test_file else val_size
if calib_size < 1 or held_val + calib_size >= len(rows):
    raise SystemExit(f"error: {len(rows)} rows cannot give {calib_size} calibration + {held_val} validation prompts "
                     "and a non-empty training set; lower CALIB_SIZE / VAL_SIZE")
test = read_rubric_rows(test_file) if test_file else rows[:held_val]
calib, train = rows[held_val:held_val + calib_size], rows[held_val + calib_size:]
system = os.environ["SYSTEM_PROMPT"] or None
out = os.path.expanduser(os.environ["DATA_DIR"])
for name, part in (("train", train), ("calib", calib), ("test", test)):
    path = write_verl_parquet(rubrics_to_verl_rows(part, split=name, system_prompt=system), os.path.join(out, f"{name}.parquet"))
    print(f"{path}: {len(part)} prompts")
EOF
