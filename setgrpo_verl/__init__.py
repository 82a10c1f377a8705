"""setgrpo-verl: SetGRPO (Set-Valued Group Relative Policy Optimization) for verl.

Layout
------
* ``setgrpo_verl.core``        - the mathematics (JRSC, GGSR, SRGO, calibration record); no verl import.
* ``setgrpo_verl.sketch``      - worker-side per-response gradient sketches (Gram matrices).
* ``setgrpo_verl.grading``     - rubric data model, graders (HTTP judge, local HF judge, function), dual scorer.
* ``setgrpo_verl.integration`` - verl glue: plugin, ``setgrpo`` estimator, reward manager, trainer mode, worker.
* ``setgrpo_verl.runner``      - the single-machine calibrate/train loop; ``setgrpo_verl.cli`` its command line.
"""

__version__ = "0.1.0"
