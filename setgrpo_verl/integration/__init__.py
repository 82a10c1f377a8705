"""verl 0.9.1 integration of SetGRPO (see ``docs/verl_integration.md``).

* :mod:`.plugin` -- the ``verl.plugins`` entry point: registers everything below at ``import verl``.
* :mod:`.estimator` -- the ``setgrpo`` advantage estimator and the pure per-step glue ``setgrpo_step``.
* :mod:`.trainer` -- the ``setgrpo`` trainer mode (``trainer.v1.trainer_mode=setgrpo``): calibration phase,
  sketches every step, SetGRPO advantages, diagnostics and the online monitor.
* :mod:`.worker` -- the actor worker with the ``compute_sketches`` RPC.
* :mod:`.reward_manager` -- the dual-reward manager ``setgrpo_dual``.
* :mod:`.config` -- typed ``algorithm.setgrpo`` config (``hydra_configs/setgrpo_trainer.yaml``).

``import verl`` comes first so that verl's own initialisation (which loads this package's plugin, i.e.
imports the submodules above) completes before any submodule body runs; importing e.g.
``setgrpo_verl.integration.estimator`` before verl would otherwise re-enter it half-initialised.
"""

import verl  # noqa: F401  (import order: see above)
