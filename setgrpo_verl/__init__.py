"""setgrpo-verl: SetGRPO (Set-Valued Group Relative Policy Optimization) for verl.

Layout
------
* ``setgrpo_verl.core``        - the mathematics (JRSC, GGSR, SRGO, calibration record); no verl import.
* ``setgrpo_verl.sketch``      - worker-side per-response gradient sketches (Gram matrices).
* ``setgrpo_verl.grading``     - rubric data model, graders (HTTP judge, local HF judge, function), dual scorer.
* ``setgrpo_verl.integration`` - verl glue: plugin, ``setgrpo`` estimator, reward manager, trainer mode, worker.
* ``setgrpo_verl.verl_cpu``    - a CPU backend for verl (platform, engine registration, transformers rollout).
* ``setgrpo_verl.runner``      - the command line (``setgrpo-verl``) and its run directories: the data split, the
  checks before verl starts, verl's ``main_ppo`` for calibrate / train / the GRPO baseline, offline validation.
* ``setgrpo_verl.report``      - PNG plots and tables from verl's metrics files and the record.
* ``setgrpo_verl.models``      - the embedded SmolLM2-135M-Instruct (the local judge's and the CPU runs' model).
* ``setgrpo_verl.rundir``      - a run directory's layout and markers (read by the runner and the report).
* ``setgrpo_verl.atomic``      - whole-file writes that are never seen half done (every file written whole).
"""

__version__ = "0.1.0"
