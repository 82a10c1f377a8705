"""What the command line shows while a stage runs (docs/cli.md#console): progress bars and one line per step.

verl's ``main_ppo`` prints thousands of lines per run (Ray start-up, worker logs, the console logger's metric dump
of every step). The command line writes all of them to the stage's ``main_ppo.log`` and, by default, shows only
a progress bar (tqdm, with rate and ETA) over

* the calibration groups, counted from the SetGRPO trainer's ``SetGRPO calibration: N groups so far`` lines (one
  as each batch's rollout, scoring and sketch pass begins, with the phase, and one per shard written), and
* the training steps, followed in the stage's ``metrics.jsonl`` (verl's file logger, one row per step), with one
  line of key metrics per step.

``--verbose`` streams verl's output unchanged instead. Nothing here changes what ``main_ppo`` prints.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

from tqdm import tqdm

__all__ = ["StageConsole", "STEP_METRICS", "override_value"]

#: The metrics of a step line: (verl / SetGRPO metric, label, format).
STEP_METRICS = (
    ("critic/score/mean", "score", "{:.3f}"),
    ("setgrpo/accepted_ratio", "accepted", "{:.2f}"),
    ("setgrpo/online_coverage_cum", "coverage", "{:.2f}"),
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("response_length/mean", "resp_len", "{:.0f}"),
    ("timing_s/step", "step_s", "{:.0f}"),
)

_CALIBRATION_LINE = re.compile(r"SetGRPO calibration: (\d+) groups so far(?: \((batch \d+: \w+)\))?")


def override_value(command: Sequence[str], key: str) -> Optional[str]:
    """The value of the last Hydra override ``key=value`` (or ``+key=value``) in ``command``, or None."""
    value = None
    for arg in command:
        name, sep, rest = arg.partition("=")
        if sep and name.lstrip("+") == key:
            value = rest
    return value


def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


class StageConsole:
    """The console of one stage: verl's lines go to ``log`` (and to ``out`` when ``verbose``); progress to ``out``.

    Args:
        stage: stage name shown on the bars.
        command: the stage's ``main_ppo`` command (read for ``trainer.total_training_steps`` and
            ``algorithm.setgrpo.calibration.num_prompts``, the totals of the bars).
        metrics_path: the stage's ``metrics.jsonl``.
        log: the open ``main_ppo.log``.
        verbose: stream every line of verl's output instead of the bars.
        out: where bars and lines go (default ``sys.stderr`` for bars, ``sys.stdout`` for verbose output).
    """

    def __init__(self, stage: str, command: Sequence[str], metrics_path: Path, log: TextIO, *, verbose: bool = False,
                 out: Optional[TextIO] = None):
        self.stage = stage
        self.metrics_path = Path(metrics_path)
        self.log = log
        self.verbose = verbose
        self.out = out
        self.total_steps = _int_or_none(override_value(command, "trainer.total_training_steps"))
        calibrates = override_value(command, "algorithm.setgrpo.record_path") in (None, "null")
        self.total_groups = (_int_or_none(override_value(command, "algorithm.setgrpo.calibration.num_prompts"))
                             if calibrates and stage != "grpo" else None)
        self.tail: list[str] = []
        self._groups_bar: Optional[tqdm] = None
        self._steps_bar: Optional[tqdm] = None
        self._offset = 0
        self._steps_seen: set[int] = set()

    def _bar(self, desc: str, total: Optional[int], unit: str, initial: int = 0) -> tqdm:
        return tqdm(total=total, desc=f"{self.stage}: {desc}", unit=unit, file=self.out or sys.stderr,
                    dynamic_ncols=True, mininterval=1.0, leave=True, initial=initial)

    def _write(self, text: str) -> None:
        tqdm.write(text, file=self.out or sys.stdout)

    # ------------------------------------------------------------------ verl's output (reader thread)
    def line(self, text: str) -> None:
        """One line of verl's output: to the log, the tail kept for error messages, and the console."""
        self.log.write(text)
        self.log.flush()
        self.tail = (self.tail + [text.rstrip()])[-40:]
        if self.verbose:
            out = self.out or sys.stdout
            out.write(text)
            out.flush()
            return
        match = _CALIBRATION_LINE.search(text)
        if match:
            done = int(match.group(1))
            if self._groups_bar is None:
                # the bar starts at the first count, which holds the groups of the shards a resumed calibration
                # kept: its rate and ETA count only the groups calibrated since, at this process's pace
                self._groups_bar = self._bar("calibration groups", self.total_groups, "group", initial=done)
            if match.group(2):  # the phase of the batch under way (rollout, scoring, sketch)
                self._groups_bar.set_postfix_str(match.group(2))
            self._groups_bar.update(max(0, done - self._groups_bar.n))

    # ------------------------------------------------------------------ metrics file (main thread)
    def poll(self) -> None:
        """Read the rows verl's file logger appended since the last call; one console line per new step."""
        if self.verbose:
            return
        try:
            size = self.metrics_path.stat().st_size
        except OSError:
            return
        if size < self._offset:  # verl truncates the file when it (re)starts logging
            self._offset = 0
        with open(self.metrics_path, "rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n") + 1  # complete lines only; the rest is read next time
        self._offset += end
        for raw in chunk[:end].splitlines():
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            data, step = row.get("data", {}), row.get("step")
            if not isinstance(step, int) or "timing_s/step" not in data or step in self._steps_seen:
                continue
            self._steps_seen.add(step)
            self._step(step, data)

    def _step(self, step: int, data: dict[str, Any]) -> None:
        if self._groups_bar is not None:
            self._groups_bar.close()
        if self._steps_bar is None:
            self._steps_bar = self._bar("training steps", self.total_steps, "step")
        parts = []
        for key, label, fmt in STEP_METRICS:
            value = data.get(key)
            if isinstance(value, (int, float)) and not math.isnan(value):
                parts.append(f"{label} {fmt.format(value)}")
        total = f"/{self.total_steps}" if self.total_steps else ""
        self._write(f"[setgrpo-verl] {self.stage} step {step}{total}: " + ", ".join(parts))
        self._steps_bar.update(max(0, len(self._steps_seen) - self._steps_bar.n))

    def close(self) -> None:
        """Close the bars (after the child exited and the last :meth:`poll`)."""
        for bar in (self._groups_bar, self._steps_bar):
            if bar is not None:
                bar.close()
