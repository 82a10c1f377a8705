"""verl 0.9.1 integration of SetGRPO (see ``docs/verl_integration.md``).

* :mod:`.plugin` -- the ``verl.plugins`` entry point: registers the estimator, reward manager and trainer mode
  below right after verl imports the registry each one belongs to.
* :mod:`.estimator` -- the SetGRPO step ``setgrpo_step`` and the ``setgrpo`` advantage estimator.
* :mod:`.groups` -- rows grouped by uid and their Gram matrices, for calibration and the step alike.
* :mod:`.trainer` -- the ``setgrpo`` trainer mode (``trainer.v1.trainer_mode=setgrpo``): sketches every step,
  SetGRPO advantages, diagnostics and the online monitor.
* :mod:`.calibration` -- the trainer mode's calibration phase: rollouts, two scorings, sketches, one shard per
  batch, the record.
* :mod:`.batch` -- the reference scores and sketches the trainer reads from a rolled-out batch.
* :mod:`.worker` -- the actor worker with the ``compute_sketches`` RPC.
* :mod:`.reward_manager` -- the dual-reward manager ``setgrpo_dual``.
* :mod:`.config` -- typed ``algorithm.setgrpo`` config (``hydra_configs/setgrpo_trainer.yaml``).
* :mod:`.run_check` -- the pre-Ray check of a run (the Hydra callback) and a record's compatibility with it.
* :mod:`.reward_config` -- the grader and reference-score key as the reward worker and the check read them.
* :mod:`.prompts` -- which prompt a verl row is (the record's calibration prompts, the overlap check).

``import verl`` comes first so that verl's own initialisation (which loads this package's plugin) completes
before any submodule body runs, whichever submodule a program imports first.
"""

import verl  # noqa: F401  (import order: see above)
